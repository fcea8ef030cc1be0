"""The memory planner (`python -m gyre.plan --memory`, gyre/backends/memplan/) against figures
worked out by hand here, and against the bytes the built-in CPU actor really holds.

The four configs below are typed from the published config.json files (Qwen/<name> on the
Hugging Face hub), not taken from gyre's KNOWN table; their parameter counts are held against
the published totals (Qwen3 technical report / model cards: 8.2B, 14.8B, 32.8B, 30.5B with
3.3B active). Every expected byte count is arithmetic on those fields, spelled out per model.
"""

from __future__ import annotations

import json

import pytest

from gyre.backends.memplan import MemPlanConfig, plan
from gyre.backends.memplan.advice import suggestions
from gyre.backends.models.sizes import model_dims, read_config

GIB = 2**30
V = 151936  # Qwen3 vocabulary
QWEN3 = dict(head_dim=128, vocab_size=V, tie_word_embeddings=False, rms_norm_eps=1e-6, rope_theta=1000000.0,
             hidden_act="silu", attention_bias=False, max_position_embeddings=40960, torch_dtype="bfloat16")
CONFIGS = {
    "Qwen3-8B": dict(QWEN3, architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=4096,
                     intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8),
    "Qwen3-14B": dict(QWEN3, architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=5120,
                      intermediate_size=17408, num_hidden_layers=40, num_attention_heads=40, num_key_value_heads=8),
    "Qwen3-32B": dict(QWEN3, architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=5120,
                      intermediate_size=25600, num_hidden_layers=64, num_attention_heads=64, num_key_value_heads=8),
    "Qwen3-30B-A3B": dict(QWEN3, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=2048,
                          intermediate_size=6144, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                          num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, decoder_sparse_step=1,
                          mlp_only_layers=[], norm_topk_prob=True),
}
PUBLISHED = {"Qwen3-8B": (8.2e9, None), "Qwen3-14B": (14.8e9, None), "Qwen3-32B": (32.8e9, None),
             "Qwen3-30B-A3B": (30.5e9, 3.3e9)}


def checkpoint(tmp_path, name):
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(CONFIGS[name]))
    return str(d)


# ---------------------------------------------------------------------------- parameter counts
# per layer: q (heads·128 × hidden), k and v (kv·128 × hidden), o, gate/up/down, 2 RMSNorms, q/k norms (128 each)
HAND_TOTAL = {
    "Qwen3-8B": 36 * (4096 * 4096 + 2 * 1024 * 4096 + 4096 * 4096 + 3 * 4096 * 12288 + 2 * 4096 + 2 * 128)
    + 2 * V * 4096 + 4096,
    "Qwen3-14B": 40 * (5120 * 5120 + 2 * 1024 * 5120 + 5120 * 5120 + 3 * 5120 * 17408 + 2 * 5120 + 2 * 128)
    + 2 * V * 5120 + 5120,
    "Qwen3-32B": 64 * (8192 * 5120 + 2 * 1024 * 5120 + 5120 * 8192 + 3 * 5120 * 25600 + 2 * 5120 + 2 * 128)
    + 2 * V * 5120 + 5120,
    # 128 experts of 3 · 2048 · 768, a router 128 × 2048
    "Qwen3-30B-A3B": 48 * (4096 * 2048 + 2 * 512 * 2048 + 2048 * 4096 + 128 * 3 * 2048 * 768 + 128 * 2048
                           + 2 * 2048 + 2 * 128) + 2 * V * 2048 + 2048,
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_parameter_counts_match_the_hand_count_and_the_published_totals(tmp_path, name):
    dims = model_dims(read_config(checkpoint(tmp_path, name)))
    assert dims.total == HAND_TOTAL[name]
    total, active = PUBLISHED[name]
    assert abs(dims.total - total) / total < 0.02
    if active is None:
        assert dims.active == dims.total
    else:  # 8 of 128 experts per token
        hand_active = HAND_TOTAL[name] - 48 * 120 * 3 * 2048 * 768
        assert dims.active == hand_active and abs(dims.active - active) / active < 0.02


def test_known_names_are_the_same_configs(tmp_path):
    for name in CONFIGS:
        assert model_dims(read_config(name.lower())).total == HAND_TOTAL[name]


# ---------------------------------------------------------------------------- per-GPU figures
# For each model: a typical layout, its parameters on one GPU (N, the last stage), activation
# bytes per micro-step token on that GPU (bf16: 2 bytes an element), the engine's weights per GPU
# (SGLang TP = the cell size) and its KV bytes per token (2 · layers · KV heads per GPU · 128 · 2).
def layer_act(h, q, kv, f, tp):  # input norm + QKV input, q k v + attn out, q/k-norm inputs, MLP norm + fc1 in, SwiGLU in + fc2 in
    return 2 * (2 * h + (2 * q + 2 * kv + q + kv) // tp + 2 * h + 3 * f // tp)


CASES = {  # name: (flags, N, act bytes/token, engine weights bytes, KV bytes/token)
    "Qwen3-8B": (dict(tp=4),
                 36 * ((2 * 4096 * 4096 + 2 * 1024 * 4096 + 3 * 4096 * 12288) // 4 + 2 * 4096 + 2 * 128)
                 + 2 * V * 4096 // 4 + 4096,
                 36 * layer_act(4096, 4096, 1024, 12288, 4) + 2 * 2 * 4096 + (2 + 4) * V // 4,
                 2 * (36 * ((2 * 4096 * 4096 + 2 * 1024 * 4096 + 3 * 4096 * 12288) // 4 + 2 * 4096 + 2 * 128)
                      + 2 * V * 4096 // 4 + 4096),
                 2 * 36 * (8 // 4) * 128 * 2),
    "Qwen3-14B": (dict(tp=8),
                  40 * ((2 * 5120 * 5120 + 2 * 1024 * 5120 + 3 * 5120 * 17408) // 8 + 2 * 5120 + 2 * 128)
                  + 2 * V * 5120 // 8 + 5120,
                  40 * layer_act(5120, 5120, 1024, 17408, 8) + 2 * 2 * 5120 + (2 + 4) * V // 8,
                  2 * (40 * ((2 * 5120 * 5120 + 2 * 1024 * 5120 + 3 * 5120 * 17408) // 8 + 2 * 5120 + 2 * 128)
                       + 2 * V * 5120 // 8 + 5120),
                  2 * 40 * (8 // 8) * 128 * 2),
    # pp 2: the last stage holds 32 layers, the head (V·5120 / 8) and the final norm; SGLang at TP 16
    # replicates the 8 KV heads (one per GPU)
    "Qwen3-32B": (dict(tp=8, pp=2, bucket_mb=512),
                  32 * ((2 * 8192 * 5120 + 2 * 1024 * 5120 + 3 * 5120 * 25600) // 8 + 2 * 5120 + 2 * 128)
                  + V * 5120 // 8 + 5120,
                  32 * layer_act(5120, 8192, 1024, 25600, 8) + 2 * 2 * 5120 + (2 + 4) * V // 8,
                  2 * (64 * ((2 * 8192 * 5120 + 2 * 1024 * 5120 + 3 * 5120 * 25600) // 16 + 2 * 5120 + 2 * 128)
                       + 2 * V * 5120 // 16 + 5120),
                  2 * 64 * 1 * 128 * 2),
    # ep 8, tp 1: every GPU holds the dense part whole and 16 of the 128 experts; a token's 8
    # expert copies (h + 3 · 768 each) and the fp32 router logits and probs (2 · 4 · 128 bytes)
    "Qwen3-30B-A3B": (dict(ep=8, bucket_mb=512),
                      48 * (2 * 4096 * 2048 + 2 * 512 * 2048 + 16 * 3 * 2048 * 768 + 128 * 2048 + 2 * 2048 + 2 * 128)
                      + 2 * V * 2048 + 2048,
                      48 * (2 * (2 * 2048 + (2 * 4096 + 2 * 512 + 4096 + 512) + 2 * 2048 + 8 * (2048 + 3 * 768)) + 8 * 128)
                      + 2 * 2 * 2048 + (2 + 4) * V,
                      2 * (48 * ((2 * 4096 * 2048 + 2 * 512 * 2048) // 8 + 128 * 3 * 2048 * 768 // 8 + 128 * 2048
                                 + 2 * 2048 + 2 * 128) + 2 * V * 2048 // 8 + 2048),
                      2 * 48 * 1 * 128 * 2),
}
# fits on (80 GB, 141 GB): the actor's peak is 26 bytes/param at the optimizer step (below)
ACTOR_FITS = {"Qwen3-8B": (True, True), "Qwen3-14B": (True, True), "Qwen3-32B": (True, True),
              "Qwen3-30B-A3B": (False, True)}


@pytest.mark.parametrize("gpu_gb", [80, 141])
@pytest.mark.parametrize("name", list(CASES))
def test_per_gpu_figures_equal_the_hand_calculation(tmp_path, name, gpu_gb):
    flags, n, act_per_token, engine_weights, kv_per_token = CASES[name]
    cfg = MemPlanConfig(model=checkpoint(tmp_path, name), gpu_gb=gpu_gb, **flags)
    p = plan(cfg)
    a, e = p.actor, p.engine
    assert a.params == n
    # bf16 weights, fp32 main grads, fp32 masters, Adam m and v: 2 + 4 + 4 + 8 = 18 bytes/param
    assert (a.weights, a.grads, a.masters, a.adam) == (2 * n, 4 * n, 4 * n, 8 * n)
    assert a.activations == 4096 * act_per_token
    # peak: the backward (2 + 2 + 4 + 8 bytes/param + activations) or the step (18 + 8 temporaries)
    assert a.peak == max(16 * n + 4096 * act_per_token, 26 * n)
    assert p.actor_fits == ACTOR_FITS[name][gpu_gb == 141] == (a.peak <= (gpu_gb - 1) * GIB)
    assert e.weights == engine_weights and e.kv_bytes_per_token == kv_per_token
    free = gpu_gb * GIB - GIB  # 1 GiB reserved for the CUDA context and NCCL
    assert e.kv_tokens == (int(0.7 * free) - engine_weights) // kv_per_token
    # --backend.no-offload-actor: SGLang sees the actor's weights, masters and Adam (14 bytes/param) as used
    assert e.kv_tokens_actor_resident == max(0, int(0.7 * (free - 14 * n)) - engine_weights) // kv_per_token
    assert p.host_offload_per_gpu == 14 * n
    assert p.host_snapshots == 3 * 2 * HAND_TOTAL[name]


def test_activations_with_full_recompute_keep_each_layer_input_and_one_layer():
    # Qwen3-8B, tp 4: 36 layer inputs (2 · 4096 bytes a token) + one layer's full set + the head's
    p = plan(MemPlanConfig(model="qwen3-8b", tp=4))
    per_token = 36 * 2 * 4096 + layer_act(4096, 4096, 1024, 12288, 4) + 2 * 2 * 4096 + 6 * V // 4
    assert p.actor.activations_recompute == 4096 * per_token


def test_a_full_model_update_does_not_fit_the_slack_of_an_h100_for_14b():
    """Issue 52's first finding: the whole 14B model (2 · 14.77e9 bytes) staged in the 30 % an H100 leaves."""
    p = plan(MemPlanConfig(model="qwen3-14b", tp=8, gpu="h100"))
    assert p.engine.update_staging == 2 * HAND_TOTAL["Qwen3-14B"]
    assert p.engine.slack == 79 * GIB - int(0.7 * (79 * GIB))
    assert not p.update_fits and not p.fits
    assert any("bucket" in s for s in suggestions(MemPlanConfig(model="qwen3-14b", tp=8), model_dims(read_config("qwen3-14b")), p))
    assert plan(MemPlanConfig(model="qwen3-14b", tp=8, gpu="h200")).update_fits


def test_one_gpu_cannot_train_8b_and_the_suggested_layout_fits():
    cfg = MemPlanConfig(model="qwen3-8b", gpu="h100")
    dims = model_dims(read_config("qwen3-8b"))
    p = plan(cfg, dims)
    assert p.actor.peak == 26 * HAND_TOTAL["Qwen3-8B"] and not p.actor_fits
    advice = suggestions(cfg, dims, p)
    layout = [s for s in advice if s.startswith("--parallel.tp")]
    assert layout and layout[0].startswith("--parallel.tp 4 --parallel.pp 1 --parallel.ep 1 --parallel.cell-size 4")
    assert plan(MemPlanConfig(model="qwen3-8b", gpu="h100", tp=4), dims).fits
    assert not plan(MemPlanConfig(model="qwen3-8b", gpu="h100", tp=2), dims).actor_fits


# ---------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("flags, needle", [
    (dict(gpu="a100"), "--gpu 'a100'"),
    (dict(tp=3), "--tp 3 must divide the attention heads (32)"),
    (dict(tp=2, cell_size=4), "--cell-size 4 must equal"),
    (dict(ep=2), "--ep 2: expert parallelism needs an MoE model"),
    (dict(mem_fraction=1.5), "--mem-fraction"),
    (dict(pp=5), "--pp 5 must divide the layers (36)"),
])
def test_bad_flags_are_refused_by_name(flags, needle):
    with pytest.raises(ValueError) as e:
        plan(MemPlanConfig(model="qwen3-8b", **flags))
    assert needle in str(e.value)


def test_missing_config_fields_are_named(tmp_path):
    raw = dict(CONFIGS["Qwen3-8B"])
    del raw["num_hidden_layers"], raw["intermediate_size"]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="num_hidden_layers, intermediate_size missing"):
        model_dims(read_config(str(tmp_path)))
    moe = dict(CONFIGS["Qwen3-30B-A3B"])
    del moe["moe_intermediate_size"]
    (tmp_path / "config.json").write_text(json.dumps(moe))
    with pytest.raises(ValueError, match="moe_intermediate_size missing"):
        model_dims(read_config(str(tmp_path)))


def test_cli_table_json_and_errors(capsys):
    from gyre.plan import main

    assert main(["--memory", "--model", "qwen3-8b", "--tp", "4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["fits"] and out["engine"]["kv_bytes_per_token"] == 2 * 36 * 2 * 128 * 2
    assert main(["--memory", "--model", "qwen3-8b"]) == 1  # one H100 does not hold the 8B actor
    assert "suggest: --parallel.tp 4" in capsys.readouterr().out
    assert main(["--memory", "--model", "qwen3-8b", "--gpu", "v100"]) == 2
    assert "--gpu 'v100' is not a known GPU" in capsys.readouterr().err


def test_defaults_are_the_runs_defaults():
    from gyre.backends.config import SglangOptions
    from gyre.backends.memplan import MICRO_STEP_TOKENS
    from gyre.config import TrainConfig

    assert MICRO_STEP_TOKENS == TrainConfig().max_tokens
    assert MemPlanConfig(model="x").mem_fraction == SglangOptions().mem_fraction_static


# ---------------------------------------------------------------------------- measured on CPU
def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("family, overrides", [
    ("qwen3", {}),  # tied embedding, head_dim 32 ≠ hidden / heads, q/k norms
    ("llama3.1", {}),
    ("qwen3-moe", {}),  # 4 experts, top 2, fused in memory
    ("qwen2.5", dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=2, intermediate_size=256,
                     num_hidden_layers=3)),  # q/k/v biases, a larger shape
])
def test_cpu_actor_state_matches_the_tensors_held_after_one_step(tmp_path, family, overrides):
    """Weights, gradients and AdamW state the planner gives the built-in actor (fp32, its own
    masters) against the nbytes of the tensors a CpuActor really holds: parameters (each once),
    their .grad after a forward/backward, and the optimizer's state after one step."""
    import torch

    from gyre.backends.actors.cpu_actor import CpuActor
    from gyre.backends.models.hf import load_model
    from tests.backends.helpers import random_step
    from tests.realmodels import write_checkpoint

    path = write_checkpoint(tmp_path / family, family, vocab_size=512, **overrides)
    actor = CpuActor(load_model(str(path)), is_core=True)
    ms = random_step(actor.model, seed=1, num_exec=2, seqs_per_exec=2, num_micro=1, vocab=256)[0]
    actor.forward_backward(ms)
    params = list(actor.model.parameters())  # a tied head is one tensor
    grads = _nbytes(p.grad for p in params if p.grad is not None)
    actor.optimizer_step()
    adam = _nbytes(v for s in actor.optimizer.state.values() for v in s.values() if torch.is_tensor(v))
    p = plan(MemPlanConfig(model=str(path), actor="cpu", dtype="float32", gpu_gb=64))
    a = p.actor
    for planned, held in ((a.weights, _nbytes(params)), (a.grads, grads), (a.adam, adam),
                          (a.weights + a.grads + a.adam, _nbytes(params) + grads + adam)):
        assert abs(planned - held) <= 0.10 * held, (planned, held)
    assert a.masters == 0 and a.weights == _nbytes(params)  # fp32 weights are their own masters
