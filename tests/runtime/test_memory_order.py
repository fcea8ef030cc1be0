"""Memory in the right order (issue 52): on the core cell the engine sizes its KV pool from the
memory free at its start, so the core's actor must be off the GPU by then
(`gyre.runtime.job.core_actor_offloaded`), and the log says the KV capacity in tokens the engine got.

The device is the conformance fake's `FakeGpu`; the fake sizes its pool as SGLang's model runner
does (tests/backends/sglang_fake.py `size_kv_pool`, with its sglang 0.5.23 file:line). The core
actor is the real one the job builds (factory.build_core_actor), resident on the fake GPU for the
bytes its tensors hold unless its memory says it is offloaded."""

from __future__ import annotations

import asyncio
import logging

import pytest
import torch

from gyre.backends import factory
from gyre.backends.models.vocab import load_vocab
from gyre.config import parse_config
from gyre.runtime import job
from tests.backends.sglang_fake import FakeEngine, FakeGpu

F = 0.5  # --sglang.mem-fraction-static in these runs


class Posted:
    """A WeightTransport's one-sided half, as far as the start-up uses it: the posted snapshot."""

    def post(self, version, params, *, published=False):
        self.version, self.params = version, params


def actor_bytes(actor) -> int:
    """What the actor holds on its device: every tensor its memory hand-over moves (parameters;
    no gradient or optimizer state exists before the first step)."""
    return sum(t.numel() * t.element_size() for t in actor.memory.tensors)


def hand_tokens(free_at_start: int, model_cfg, served: torch.dtype) -> tuple[int, int]:
    """(engine weight bytes, KV tokens) by hand: SGLang's rest = free after the weights −
    free before × (1 − f), over bytes per token = KV heads × 2 × head_dim × layers × dtype size."""
    elem = torch.empty((), dtype=served).element_size()
    n_params = sum(p.numel() for p in _meta_model(model_cfg).parameters())
    weights = n_params * elem
    head_dim = getattr(model_cfg, "head_dim", None) or model_cfg.hidden_size // model_cfg.num_attention_heads
    per_token = model_cfg.num_key_value_heads * 2 * head_dim * model_cfg.num_hidden_layers * elem
    rest = (free_at_start - weights) - free_at_start * (1 - F)
    return weights, int(rest) // per_token


def _meta_model(model_cfg):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(model_cfg)


def start_core_cell(tmp_path, monkeypatch, caplog, *flags: str):
    """The core cell's start-up as `job._train` orders it on position 0: the core actor (built,
    posted, offloaded: `core_actor_offloaded`), then the engine from the posted snapshot, started.
    Returns (actor, the fake engine, the adapter, the GPU's total)."""
    monkeypatch.setenv(factory.SGLANG_API_ENV, "tests.backends.sglang_fake:API")
    cfg = parse_config(["--backend.engine", "sglang", "--run-dir", str(tmp_path / "run"),
                        "--sglang.mem-fraction-static", str(F), *flags])
    gpu = FakeGpu(total=0)
    monkeypatch.setattr(FakeEngine, "gpu", gpu)
    real = factory.build_core_actor

    def resident(*a, **k):
        actor, model_cfg = real(*a, **k)
        gpu.hold("core actor", lambda: 0 if actor.memory.offloaded else actor_bytes(actor))
        # a GPU a few times the model: the KV pool's size depends visibly on what else is resident
        gpu.total = 8 * actor_bytes(actor)
        return actor, model_cfg

    monkeypatch.setattr(factory, "build_core_actor", resident)
    vocab = load_vocab(cfg.model.checkpoint, cfg.proxy.tokenizer_path)
    posted = Posted()
    actor, model_cfg = job.core_actor_offloaded(cfg, vocab.size, tmp_path / "ckpt", posted)
    eng = factory.build_engine(cfg.model, cfg.engine, cfg.backend, model_cfg, posted.params, version=posted.version,
                               eos_token_ids=list(vocab.stop_ids), sampleable_vocab=vocab.size, name="rank0",
                               transfer=cfg.transfer, sglang=cfg.sglang, run_dir=cfg.run_dir)

    async def go():
        await eng.start()
        fake = eng._engine
        await eng.stop()
        return fake

    with caplog.at_level(logging.INFO, logger="gyre.backends.engines.sglang_engine"):
        fake = asyncio.run(go())
    return actor, fake, eng, gpu.total, model_cfg


def test_the_kv_pool_is_sized_with_the_core_actor_offloaded_and_its_tokens_are_logged(tmp_path, monkeypatch, caplog):
    """Planted once: without the offload in `core_actor_offloaded` (the order before this fix:
    engine first, actor offloaded at `first_actor`) the engine saw total − the actor's bytes and
    this failed on pre_model_load_free."""
    actor, fake, eng, total, model_cfg = start_core_cell(tmp_path, monkeypatch, caplog)
    kv = fake.kv
    assert kv.pre_model_load_free == total  # the whole GPU: nothing of the actor is resident
    assert actor.memory.offloaded and actor_bytes(actor) > 0
    weights, tokens = hand_tokens(total, model_cfg, fake.dtype)
    assert (kv.weights_bytes, kv.available) == (weights, total - weights)
    assert kv.max_total_num_tokens == tokens and tokens > 0
    assert eng.kv_tokens == tokens
    up = [r.getMessage() for r in caplog.records if "sglang engine up" in r.getMessage()]
    assert len(up) == 1 and f"KV cache {tokens} tokens at mem_fraction_static {F:.2f}" in up[0], up
    # SGLang bounds the longest request by the pool too (tp_worker.py:568-572)
    assert eng.max_prompt_len == min(fake.context_len - 1, tokens - 1) - 5


def test_with_no_offload_the_actor_stays_resident_and_the_kv_pool_sizes_around_it(tmp_path, monkeypatch, caplog):
    """--backend.no-offload-actor: the actor holds its memory through every rollout, so the engine
    sizing around it is right; the pool is smaller by what the actor holds (the contrast that shows
    the first test measures residency, not a constant)."""
    actor, fake, eng, total, model_cfg = start_core_cell(tmp_path, monkeypatch, caplog, "--backend.no-offload-actor")
    held = actor_bytes(actor)
    assert not actor.memory.offloaded and fake.kv.pre_model_load_free == total - held
    _, tokens = hand_tokens(total - held, model_cfg, fake.dtype)
    assert fake.kv.max_total_num_tokens == eng.kv_tokens == tokens
    _, offloaded_tokens = hand_tokens(total, model_cfg, fake.dtype)
    assert tokens < offloaded_tokens


def test_a_gpu_too_full_for_the_kv_pool_fails_the_start_naming_the_flag():
    """kv_cache_configurator.py:3043-3058: no room left under mem_fraction_static is SGLang's
    ValueError naming --mem-fraction-static (the fake's sizing, on its own)."""
    from tests.backends.helpers import tiny_model
    from tests.backends.sglang_fake import size_kv_pool

    cfg = tiny_model().config
    gpu = FakeGpu(total=10 << 20)
    gpu.hold("someone else", (10 << 20) - (1 << 16))  # 64 KiB free: less than the tiny model's weights
    with pytest.raises(ValueError, match="--mem-fraction-static"):
        size_kv_pool(gpu, cfg, torch.float32, 0.9)
