"""Padded vocabulary: real Qwen2.5 has more embedding rows than tokenizer ids. With
`sampleable_vocab`, the engine never samples (nor lists among the top log-probs) an id at or
past it, however large that row's logit; the reported policy log-prob stays the trainer's
(log-softmax over every row)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from gyre.backends.config import CpuEngineConfig, ModelConfig
from gyre.backends.engines.cpu_engine import CpuEngine
from gyre.backends.protocols import SamplingParams
from tests.realmodels import build_model

LIMIT, PAD = 300, 40


@pytest.fixture(scope="module")
def padded():
    """A Llama 3.1 model (untied head) of LIMIT + PAD rows whose padded rows' logits dwarf the
    rest: residual dim 0 is held at +100 by the embedding, the final norm keeps only dim 0, and
    the padded head rows read it with weight 50 (logit ~400 against ~N(0, 8²) for real ids)."""
    model = build_model("llama3.1", LIMIT + PAD, seed=1)
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    sd["model.embed_tokens.weight"][:, 0] = 100.0
    sd["model.norm.weight"].zero_()
    sd["model.norm.weight"][0] = 1.0
    sd["lm_head.weight"][LIMIT:, 0] = 50.0
    return model.config, sd


def _generate(config, sd, limit, *, policy=True, n=6, tokens=60):
    async def go():
        engine = CpuEngine(config, sd, sampleable_vocab=limit,
                           config=CpuEngineConfig(logprobs="policy" if policy else "sampling"))
        await engine.start()
        try:
            async def one(i):
                sp = SamplingParams(max_tokens=tokens, temperature=1.0, top_p=1.0, seed=i, top_logprobs=5)
                return [ev async for ev in engine.generate(f"r{i}", [1 + i, 2, 3], sp)]
            return await asyncio.gather(*(one(i) for i in range(n)))
        finally:
            await engine.stop()
    return [ev for evs in asyncio.run(go()) for ev in evs]


@pytest.mark.parametrize("policy", [True, False])
def test_padded_rows_never_sampled_nor_listed(padded, policy):
    config, sd = padded
    events = _generate(config, sd, LIMIT, policy=policy)
    assert len(events) == 6 * 60
    assert max(ev.token_id for ev in events) < LIMIT
    assert all(t < LIMIT for ev in events for t, _ in ev.top)
    assert len({ev.token_id for ev in events}) > 20  # sampled at temperature 1, not stuck on one id
    if policy:  # log-softmax over every row: the padded mass makes each sampled id very unlikely
        assert max(ev.logprob for ev in events) < -100


def test_without_limit_the_padded_rows_win(padded):
    """The control: with every row sampleable, (almost) every token is a padded id."""
    config, sd = padded
    events = _generate(config, sd, None, n=2, tokens=30)
    assert sum(ev.token_id >= LIMIT for ev in events) >= 0.95 * len(events)


def test_limit_is_checked_and_passed_by_the_factory(padded):
    import types

    from gyre.backends.factory import build_engine

    config, sd = padded
    for bad in (0, LIMIT + PAD + 1):
        with pytest.raises(ValueError, match="sampleable_vocab"):
            CpuEngine(config, sd, sampleable_vocab=bad)
    sections = (ModelConfig(), CpuEngineConfig(), types.SimpleNamespace(engine="cpu", device="cpu"))
    engine = build_engine(*sections, config, sd, version=0, eos_token_ids=[], name="e", sampleable_vocab=LIMIT)
    assert engine.sampleable_vocab == LIMIT
    assert build_engine(*sections, config, sd, version=0, eos_token_ids=[], name="e").sampleable_vocab == LIMIT + PAD
