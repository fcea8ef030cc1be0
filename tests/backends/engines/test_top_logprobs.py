"""Alternatives per token (`SamplingParams.top_logprobs`, `TokenEvent.top`): the pure top-k, the CPU
engine against an independent float64 log-softmax of the model's logits, the deterministic
engine, and the HTTP / websocket engine wire (streams and abort replies)."""

from __future__ import annotations

import asyncio
import copy
import math

import pytest
import torch

from gyre.backends.config import CpuEngineConfig
from gyre.backends.engines.cpu_engine import CpuEngine
from gyre.backends.engines.det_engine import DeterministicEngine, sequence_hash
from gyre.backends.engines.engine_http import HttpEngine, serve_engine_async
from gyre.backends.engines.engine_mux import event_row, event_text, parse_event, parse_events, sampling_to_json
from gyre.backends.protocols import SamplingParams, TokenEvent
from gyre.backends.engines.sampling import nucleus, top_logprobs
from tests.backends.helpers import tiny_model


def test_top_logprobs_by_hand():
    lp = torch.log(torch.tensor([0.1, 0.5, 0.1, 0.3]))
    got = top_logprobs(lp, 3)
    assert [t for t, _ in got] == [1, 3, 0]  # ties (0 and 2) by ascending id
    assert [v for _, v in got] == pytest.approx([math.log(0.5), math.log(0.3), math.log(0.1)])
    assert [t for t, _ in top_logprobs(lp, 9)] == [1, 3, 0, 2] and top_logprobs(lp, 0) == []
    trunc = torch.tensor([0.0, float("-inf"), -1.0])
    assert [t for t, _ in top_logprobs(trunc, 3)] == [0, 2]  # outside a truncated distribution: left out


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=0)


def reference_logprobs(model, seq: list[int]) -> torch.Tensor:
    """float64 log-softmax of the model's logits at every position of `seq` [T, V], computed by the
    HF model itself in float64 (independent of the engine's decoder and KV cache)."""
    m = copy.deepcopy(model).double().eval()
    with torch.no_grad():
        logits = m(input_ids=torch.tensor([seq])).logits[0]
    return torch.log_softmax(logits.double(), dim=-1)


async def _collect(engine, rid, prompt, sp):
    return [ev async for ev in engine.generate(rid, prompt, sp)]


def _run_engine(model, prompt, sp, config=None):
    async def go():
        eng = CpuEngine.from_model(model, config=config)
        await eng.start()
        try:
            return await _collect(eng, "r", prompt, sp)
        finally:
            await eng.stop()

    return asyncio.run(go())


@pytest.mark.parametrize("k, temperature", [(5, 1.0), (1, 0.0), (12, 0.8)])
def test_cpu_engine_top_k_is_the_float64_log_softmax_of_the_logits(model, k, temperature):
    prompt = [5, 17, 99, 3, 42, 7]
    events = _run_engine(model, prompt, SamplingParams(max_tokens=8, temperature=temperature, seed=3, top_logprobs=k))
    ref = reference_logprobs(model, prompt + [e.token_id for e in events])
    sampled_in_top = 0
    for i, ev in enumerate(events):
        row = ref[len(prompt) - 1 + i]  # the distribution the i-th output token was drawn from
        want = torch.topk(row, k)
        assert len(ev.top) == k
        assert [v for _, v in ev.top] == sorted((v for _, v in ev.top), reverse=True)
        assert [t for t, _ in ev.top] == want.indices.tolist()
        assert [v for _, v in ev.top] == pytest.approx(want.values.tolist(), abs=2e-5)
        if ev.token_id in want.indices.tolist():
            sampled_in_top += 1
            assert dict(ev.top)[ev.token_id] == ev.logprob  # the very value the event reports
    assert sampled_in_top >= 1
    if temperature == 0:
        assert all(ev.top[0][0] == ev.token_id for ev in events)  # greedy: the sampled token is the top one


def test_cpu_engine_computes_no_top_unless_asked_and_samples_the_same(model):
    prompt = [9, 8, 7]
    plain = _run_engine(model, prompt, SamplingParams(max_tokens=6, seed=11))
    asked = _run_engine(model, prompt, SamplingParams(max_tokens=6, seed=11, top_logprobs=3))
    assert all(ev.top is None for ev in plain)
    assert [(e.token_id, e.logprob) for e in plain] == [(e.token_id, e.logprob) for e in asked]


def test_cpu_engine_sampling_logprobs_mode_reports_top_k_of_the_sampled_distribution(model):
    prompt = [1, 2, 3, 4]
    t, p = 0.7, 0.6
    events = _run_engine(model, prompt, SamplingParams(max_tokens=6, temperature=t, top_p=p, seed=5, top_logprobs=50),
                         config=CpuEngineConfig(logprobs="sampling"))
    ref = reference_logprobs(model, prompt + [e.token_id for e in events])
    for i, ev in enumerate(events):
        probs = torch.softmax(ref[len(prompt) - 1 + i] / t, -1)
        keep = nucleus(probs, p)
        dist = torch.log(torch.where(keep, probs, torch.zeros_like(probs)) / probs[keep].sum())
        n = min(50, int(keep.sum()))
        assert len(ev.top) == n  # only tokens that could be sampled
        assert [v for _, v in ev.top] == pytest.approx(torch.topk(dist, n).values.tolist(), abs=1e-4)
        assert dict(ev.top)[ev.token_id] == ev.logprob


def test_deterministic_engine_alternatives_are_a_plausible_top_k():
    eng = DeterministicEngine("d", salt=4, eos_prob=0.1)
    prompt = [10, 11, 12]

    events = asyncio.run(_collect(eng, "r", prompt, SamplingParams(max_tokens=20, top_logprobs=4)))
    seq = list(prompt)
    for ev in events:
        assert len(ev.top) == 4 and len({t for t, _ in ev.top}) == 4
        assert [v for _, v in ev.top] == sorted((v for _, v in ev.top), reverse=True)
        assert dict(ev.top)[ev.token_id] == ev.logprob
        assert sum(math.exp(v) for _, v in ev.top) <= 1.0 + 1e-9
        assert ev.top == eng.top_tokens(sequence_hash(seq, 4), ev, 4)  # a pure function of the sequence
        seq.append(ev.token_id)
    assert all(ev.top is None for ev in asyncio.run(_collect(eng, "q", prompt, SamplingParams(max_tokens=5))))


def test_wire_format_is_unchanged_without_alternatives_and_round_trips_with_them():
    plain = TokenEvent(5, -0.25, 3, "stop")
    assert event_text(plain) == "5 -0.25 3 stop" and event_text(TokenEvent(5, -0.1, 0)) == "5 -0.1 0"
    assert event_row(plain) == [5, -0.25, 3, "stop"]
    assert "top_logprobs" not in sampling_to_json(SamplingParams()) and sampling_to_json(SamplingParams(top_logprobs=2))["top_logprobs"] == 2
    for ev in (plain, TokenEvent(7, -1 / 3, 1, None, [(7, -1 / 3), (9, -2.5)]), TokenEvent(7, -0.5, 1, "length", [(1, -0.1)])):
        assert parse_event(event_text(ev).split()) == ev
        assert parse_events([event_row(ev)]) == [ev]


@pytest.mark.parametrize("transport", ["ws", "http"])
def test_http_engine_carries_alternatives_in_streams_and_abort_replies(transport):
    async def go():
        served = DeterministicEngine("srv", salt=9, token_delay=0.002)
        local = DeterministicEngine("local", salt=9)
        handle = await serve_engine_async(served)
        client = HttpEngine(handle.url, transport=transport)
        try:
            sp = SamplingParams(max_tokens=12, top_logprobs=3)
            got = await _collect(client, "a", [1, 2, 3], sp)
            want = await _collect(local, "a", [1, 2, 3], sp)
            assert got == want and all(len(e.top) == 3 for e in got)
            assert all(e.top is None for e in await _collect(client, "b", [1, 2, 3], SamplingParams(max_tokens=4)))
            # abort mid-stream: the reply's events keep their alternatives
            slow = SamplingParams(max_tokens=200, top_logprobs=2)
            stream = client.generate("c", [4, 5], slow)
            first = [await stream.__anext__() for _ in range(3)]
            aborted = await client.abort("c")
            await stream.aclose()
            assert len(aborted) >= 3 and aborted[:3] == first and all(len(e.top) == 2 for e in aborted)
        finally:
            await client.close()
            await handle.astop()

    asyncio.run(go())
