"""The CPU actor's memory (issue 51): the accounting by hand and against what autograd really
saves, activation checkpointing (same gradients, fewer saved bytes), bf16 compute, and the chunked
log-prob path that never holds [T, V] logits."""

from __future__ import annotations

import pytest
import torch

from gyre.backends.actors.accounting import layer_floats_per_token, memory_accounting
from gyre.backends.actors.cpu_actor import CpuActor, lm_head_weight
from gyre.backends.config import OptimizerConfig
from gyre.backends.models.arch.checkpointing import checkpoint_decoder_layers
from gyre.backends.models.hf import build_model
from gyre.loss import LossConfig
from tests.backends.helpers import random_step, tiny_model


def test_accounting_by_hand():
    # SmolLM2-135M's shape: 134,515,008 parameters (tied), hidden 576, 30 layers, 9 heads (head_dim
    # 64), 3 KV heads (kv_dim 192), intermediate 1536, vocab 49152; T = 4096, chunk 256.
    a = memory_accounting(134_515_008, 4096, 576, 30, 49152, intermediate=1536, heads=9, kv_heads=3)
    assert a["weights_bytes"] == a["grads_bytes"] == 538_060_032  # × 4 B
    assert a["optimizer_bytes"] == 1_076_120_064  # two moments
    # a layer: 8·576 + 2·192 + 4·1536 + 9 + 2 = 4608 + 384 + 6144 + 11 = 11147 floats a token
    assert layer_floats_per_token(576, 1536, 9, 3) == 11147
    # outside: 3·576 + 2·64 + 7 = 1863; log-probs: (256 + 576) · 49152 floats = 40,894,464
    assert a["activations_bytes"] == 4096 * (30 * 11147 + 1863) * 4 + 40_894_464 * 4 == 5_673_074_688
    assert a["total_bytes"] == 538_060_032 * 2 + 1_076_120_064 + 5_673_074_688
    c = memory_accounting(134_515_008, 4096, 576, 30, 49152, intermediate=1536, heads=9, kv_heads=3,
                          checkpointing=True)
    # each layer's input (30·576 = 17280) plus one layer being recomputed (11147)
    assert c["activations_bytes"] == 4096 * (17280 + 11147 + 1863) * 4 + 40_894_464 * 4 == 659_849_216
    # bf16 activations: half the per-token part; the log-prob buffers stay float32
    b = memory_accounting(134_515_008, 4096, 576, 30, 49152, intermediate=1536, heads=9, kv_heads=3, act_bytes=2)
    assert b["activations_bytes"] == 4096 * (30 * 11147 + 1863) * 2 + 40_894_464 * 4
    # a micro-step shorter than the chunk forms only its own rows
    assert memory_accounting(10, 2, 4, 1, 8, intermediate=6, heads=2, kv_heads=1, chunk=256)["activations_bytes"] == \
        2 * (64 + 23) * 4 + (2 * 8 + 8 * 4) * 4
    with pytest.raises(ValueError, match="tokens must be positive"):
        memory_accounting(10, 0, 4, 1, 8, intermediate=6, heads=2, kv_heads=1)


def _llama(layers=3, hidden=32, heads=4, kv_heads=2, intermediate=48, vocab=64, dtype=torch.float64):
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, intermediate_size=intermediate, vocab_size=vocab,
                      tie_word_embeddings=True, architectures=["LlamaForCausalLM"])
    return build_model(cfg, seed=0, dtype=dtype)


def _saved_floats_per_token(actor, ms) -> float:
    """Bytes autograd keeps for the backward of the actor's log-probs (unique storages, parameters
    left out), per token, in 4-byte units."""
    params = {p.untyped_storage().data_ptr() for p in actor.model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        actor._logprobs(ms)
    return sum(seen.values()) / 4 / ms.num_tokens


@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_accounting_counts_what_autograd_saves(checkpointing):
    """A 3-layer Llama (hidden 32, 4 heads, 2 KV heads, intermediate 48), one sequence: what the
    forward keeps for the backward is exactly the accounting's per-token activations. With
    checkpointing the forward keeps each layer's input only (the one layer recomputed at a time
    in the backward is the accounting's extra term, and RoPE's cos/sin are recomputed with it)."""
    model = _llama(dtype=torch.float32)
    actor = CpuActor(model, is_core=True, config=OptimizerConfig(activation_checkpointing=checkpointing))
    (ms,) = random_step(model, seed=1, num_exec=1, seqs_per_exec=1, num_micro=1, vocab=64)
    per_layer = layer_floats_per_token(32, 48, 4, 2)
    rest = 3 * 32 + 2 * 8 + 7
    want = 3 * 32 + rest - 2 * 8 if checkpointing else 3 * per_layer + rest
    assert _saved_floats_per_token(actor, ms) == want
    acct = memory_accounting(1, ms.num_tokens, 32, 3, 64, intermediate=48, heads=4, kv_heads=2,
                             checkpointing=checkpointing)
    kept = acct["activations_bytes"] - (min(256, ms.num_tokens) * 64 + 64 * 32) * 4
    assert kept / 4 / ms.num_tokens == (want + 2 * 8 + per_layer if checkpointing else want)


def test_a_tiny_qwen2_saves_what_the_accounting_says():
    """The same count on the tests' Qwen2 (q/k/v biases, untied head: a bias adds no saved tensor)."""
    model = tiny_model(seed=0, dtype=torch.float32)
    actor = CpuActor(model, is_core=True)
    (ms,) = random_step(model, seed=1, num_exec=1, seqs_per_exec=1, num_micro=1)
    c = model.config
    per_layer = layer_floats_per_token(c.hidden_size, c.intermediate_size, c.num_attention_heads, c.num_key_value_heads)
    rest = 3 * c.hidden_size + 2 * (c.hidden_size // c.num_attention_heads) + 7
    assert _saved_floats_per_token(actor, ms) == c.num_hidden_layers * per_layer + rest


def _grads(actor):
    return {n: p.grad.clone() for n, p in actor.model.named_parameters() if p.grad is not None}


def test_activation_checkpointing_gives_the_same_gradients():
    """float64, a step of three micro-steps with packed sequences: the gradients with every layer
    recomputed equal those with the activations kept (the recompute runs the same ops)."""
    step = random_step(tiny_model(seed=0, dtype=torch.float64), seed=3, num_exec=3, seqs_per_exec=2, num_micro=3)
    out = {}
    for ck in (False, True):
        actor = CpuActor(tiny_model(seed=0, dtype=torch.float64), is_core=True, loss=LossConfig(),
                         config=OptimizerConfig(activation_checkpointing=ck))
        sums = sum(actor.exec_logratio_partial_sums(ms) for ms in step)  # executions span micro-steps
        losses = [actor.forward_backward(ms, exec_logratio_sum=sums)["loss"] for ms in step]
        out[ck] = (losses, _grads(actor))
    assert out[True][0] == out[False][0]
    assert out[True][1].keys() == out[False][1].keys() and len(out[True][1]) > 0
    for n, g in out[False][1].items():
        assert torch.allclose(out[True][1][n], g, rtol=1e-12, atol=1e-15), n


def test_checkpointing_wraps_each_layer_once_and_leaves_no_grad_forwards_alone():
    model = _llama()
    assert checkpoint_decoder_layers(model) == 3 and checkpoint_decoder_layers(model) == 3
    ids = torch.randint(0, 64, (1, 9))
    with torch.no_grad():  # the forward-only pre-pass: no checkpoint frames, same output
        got = model(input_ids=ids, use_cache=False).logits
    want = _llama()(input_ids=ids, use_cache=False).logits
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="model.model.layers"):
        checkpoint_decoder_layers(torch.nn.Linear(2, 2))


def test_bf16_compute_keeps_float32_masters_and_is_close():
    """--actor.compute-dtype bfloat16: the decoder under CPU autocast; parameters, gradients and
    log-probs stay float32, and the log-probs are within bf16 rounding of the float32 ones."""
    (ms,) = random_step(tiny_model(seed=0), seed=2, num_exec=2, seqs_per_exec=2, num_micro=1)
    f32 = CpuActor(tiny_model(seed=0), is_core=True).forward_logprobs(ms)
    actor = CpuActor(tiny_model(seed=0), is_core=True, config=OptimizerConfig(compute_dtype="bfloat16"))
    bf = actor.forward_logprobs(ms)
    assert bf.dtype == torch.float32
    m = ms.target_mask
    err = float((bf[m] - f32[m]).abs().max())
    assert 0 < err < 0.1, err  # bf16 did run (not bit-equal), and stayed close
    actor.forward_backward(ms)
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in actor.model.parameters())


def test_log_probs_come_from_the_hidden_states_unless_the_head_is_unusual():
    model = tiny_model(seed=0)
    assert lm_head_weight(model) is model.lm_head.weight
    model.lm_head.bias = torch.nn.Parameter(torch.zeros(model.config.vocab_size))
    assert lm_head_weight(model) is None  # hidden @ Wᵀ would drop the bias: the actor takes the logits
    (ms,) = random_step(model, seed=2, num_exec=2, seqs_per_exec=2, num_micro=1)
    with torch.no_grad():
        model.lm_head.bias.fill_(0.5)  # a constant shift: the log-softmax does not change
    a = CpuActor(model, is_core=False).forward_logprobs(ms)
    b = CpuActor(tiny_model(seed=0), is_core=False).forward_logprobs(ms)
    assert torch.allclose(a, b, atol=1e-5)


def test_freed_memory_is_released_once_per_process_unless_the_environment_says_otherwise():
    """`release_freed_memory` sets glibc's M_MMAP_THRESHOLD once per process (fresh processes: it
    is process-wide), and leaves a MALLOC_MMAP_THRESHOLD_ from the environment alone."""
    import os
    import subprocess
    import sys

    code = ("from gyre.backends.actors.cpu_actor import release_freed_memory as r; "
            "print(r(), r())")
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.split() == ["True", "False"]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**env, "MALLOC_MMAP_THRESHOLD_": "131072"})
    assert out.stdout.split() == ["False", "False"]
