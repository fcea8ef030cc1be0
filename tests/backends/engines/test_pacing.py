"""Emulated accelerator knobs: CpuEngineConfig.min_decode_step_s, OptimizerConfig.min_s_per_ktok.

A paced decode step / micro-step lasts at least its floor (a lower bound, which sleeping
guarantees; no speed goal is tested here), pacing never changes tokens, log-probs or gradients,
and a floor of 0 (the default) never sleeps.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from gyre.backends.actors import cpu_actor as cpu_actor_mod
from gyre.backends.config import CpuEngineConfig, OptimizerConfig
from gyre.backends.actors.cpu_actor import CpuActor
from gyre.backends.engines.cpu_engine import CpuEngine
from gyre.backends.protocols import SamplingParams
from tests.backends.helpers import random_step, tiny_model

PROMPT = [5, 17, 99, 3, 42, 7]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=0)


def generate(model, cfg: CpuEngineConfig):
    """(tokens, log-probs, engine, wall seconds) of one seeded request of MAX_TOKENS tokens."""

    async def go():
        eng = CpuEngine.from_model(model, config=cfg)
        await eng.start()
        t0 = time.perf_counter()
        evs = [ev async for ev in eng.generate("r0", PROMPT, SamplingParams(max_tokens=MAX_TOKENS, seed=7))]
        wall = time.perf_counter() - t0
        await eng.stop()
        return [e.token_id for e in evs], [e.logprob for e in evs], eng, wall

    return asyncio.run(go())


def test_paced_decode_steps_last_at_least_the_floor_and_change_no_token(model):
    ref_tokens, ref_lps, ref_eng, ref_wall = generate(model, CpuEngineConfig())
    # Well above this machine's step compute now (a loaded machine slows it): every step sleeps.
    floor = max(0.05, 4 * ref_wall / MAX_TOKENS)
    tokens, lps, eng, wall = generate(model, CpuEngineConfig(min_decode_step_s=floor))
    assert eng.steps == MAX_TOKENS == len(tokens)  # one token per decode step for a lone request
    assert wall >= MAX_TOKENS * floor - 1e-3
    assert 0 < eng.paced_s <= MAX_TOKENS * floor
    assert tokens == ref_tokens and lps == ref_lps
    assert ref_eng.paced_s == 0.0 and ref_eng.slow_steps == 0


def test_a_floor_below_the_compute_counts_slow_steps_and_sleeps_nothing(model):
    _, _, eng, _ = generate(model, CpuEngineConfig(min_decode_step_s=1e-9))
    assert eng.slow_steps == eng.steps == MAX_TOKENS
    assert eng.paced_s == 0.0


def test_engine_floor_zero_never_sleeps_to_pace(model, monkeypatch):
    slept = []
    real_sleep = asyncio.sleep

    async def spy(delay, *a, **k):
        slept.append(delay)
        return await real_sleep(delay, *a, **k)

    monkeypatch.setattr(asyncio, "sleep", spy)
    _, _, eng, _ = generate(model, CpuEngineConfig(min_decode_step_s=0.0))
    assert eng.steps == MAX_TOKENS
    assert all(d == 0 for d in slept)  # only the loop's yield between steps


@pytest.fixture(scope="module")
def step():
    return random_step(tiny_model(seed=0, dtype=torch.float64), seed=3, num_exec=3, seqs_per_exec=2, num_micro=1)


def grads(actor):
    return {n: p.grad.clone() for n, p in actor.model.named_parameters() if p.grad is not None}


def test_paced_micro_step_lasts_at_least_tokens_times_the_rate_and_same_gradient(step):
    ms = step[0]
    ref = CpuActor(tiny_model(seed=0, dtype=torch.float64), is_core=True)
    t0 = time.perf_counter()
    ref_metrics = ref.forward_backward(ms)
    floor = max(0.15, 4 * (time.perf_counter() - t0))  # well above the compute, even on a loaded machine
    per_ktok = floor * 1000.0 / ms.num_tokens  # this micro-step's floor
    actor = CpuActor(tiny_model(seed=0, dtype=torch.float64), is_core=True, config=OptimizerConfig(min_s_per_ktok=per_ktok))
    t0 = time.perf_counter()
    metrics = actor.forward_backward(ms)
    wall = time.perf_counter() - t0
    assert wall >= floor - 1e-3
    assert 0 < actor.paced_s <= floor and actor.pace_overruns == 0
    assert metrics == ref_metrics
    g, g_ref = grads(actor), grads(ref)
    assert g.keys() == g_ref.keys() and all(torch.equal(g[n], g_ref[n]) for n in g)


def test_actor_floor_zero_never_sleeps(step, monkeypatch):
    def boom(_):
        raise AssertionError("time.sleep called with min_s_per_ktok = 0")

    monkeypatch.setattr(cpu_actor_mod.time, "sleep", boom)
    actor = CpuActor(tiny_model(seed=0, dtype=torch.float64), is_core=True)
    assert actor.config.min_s_per_ktok == 0.0
    actor.forward_backward(step[0])
    assert actor.paced_s == 0.0 and actor.pace_overruns == 0


def test_actor_floor_below_the_compute_is_counted_as_an_overrun(step, monkeypatch):
    monkeypatch.setattr(cpu_actor_mod.time, "sleep", lambda _: pytest.fail("slept past an overrun"))
    actor = CpuActor(tiny_model(seed=0, dtype=torch.float64), is_core=True, config=OptimizerConfig(min_s_per_ktok=1e-12))
    actor.forward_backward(step[0])
    assert actor.pace_overruns == 1 and actor.paced_s == 0.0
