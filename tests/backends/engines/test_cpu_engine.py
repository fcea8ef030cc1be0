"""CPU engine: continuous batching, determinism, log-probs vs the actor, stops, abort, updates."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gyre.backends.config import CpuEngineConfig
from gyre.backends.actors.cpu_actor import CpuActor
from gyre.backends.engines.cpu_engine import CpuEngine
from gyre.backends.protocols import RolloutEngine, SamplingParams
from tests.backends.helpers import VOCAB, tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=0)


def run(coro):
    return asyncio.run(coro)


async def collect(engine, rid, prompt, sp, delay=0.0):
    if delay:
        await asyncio.sleep(delay)
    return [ev async for ev in engine.generate(rid, prompt, sp)]


def prompts(n, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(rng.randint(1, 40))] for _ in range(n)]


def actor_logprobs(model, prompt, tokens):
    """ℓ of each output token under `model`, computed by the actor on the full sequence."""
    from gyre.trajectory.microstep import MicroStep

    seq = torch.tensor(prompt + tokens)
    n = len(seq)
    targets = torch.cat([seq[1:], torch.zeros(1, dtype=torch.long)])
    ms = MicroStep(input_ids=seq, position_ids=torch.arange(n), cu_seqlens=torch.tensor([0, n]), targets=targets,
                   target_mask=torch.zeros(n, dtype=torch.bool), behavior_logprobs=torch.zeros(n),
                   exec_index=torch.full((n,), -1), token_weight=torch.zeros(n, dtype=torch.float64),
                   advantages=torch.zeros(1, dtype=torch.float64), exec_lengths=torch.zeros(1, dtype=torch.long), num_executions=1)
    lp = CpuActor(model, is_core=False).forward_logprobs(ms)
    return lp[len(prompt) - 1 : n - 1]


def test_satisfies_protocol(model):
    assert isinstance(CpuEngine.from_model(model), RolloutEngine)


def test_concurrent_requests_join_and_leave_and_match_solo_runs(model):
    """20 requests of different prompt/output lengths, arriving at different times, through a
    batch capped at 6: each output equals that request run alone with the same seed, and the
    engine needed far fewer steps than tokens (requests shared decode steps)."""
    ps = prompts(20, seed=1)
    sps = [SamplingParams(max_tokens=3 + 2 * i % 17, temperature=1.0, top_p=0.9, seed=100 + i) for i in range(20)]

    async def together():
        eng = CpuEngine.from_model(model, config=CpuEngineConfig(max_batch=6))
        await eng.start()
        outs = await asyncio.gather(*[collect(eng, f"r{i}", ps[i], sps[i], delay=0.002 * (i % 5)) for i in range(20)])
        steps, health = eng.steps, await eng.health()
        await eng.stop()
        return outs, steps, health

    async def solo():
        eng = CpuEngine.from_model(model)
        await eng.start()
        outs = [await collect(eng, f"s{i}", ps[i], sps[i]) for i in range(20)]
        await eng.stop()
        return outs

    outs, steps, health = run(together())
    ref = run(solo())
    total = sum(len(o) for o in outs)
    assert [len(o) for o in outs] == [sp.max_tokens for sp in sps]
    for a, b in zip(outs, ref):
        assert [e.token_id for e in a] == [e.token_id for e in b]
        assert torch.allclose(torch.tensor([e.logprob for e in a]), torch.tensor([e.logprob for e in b]), atol=1e-5)
    assert steps < total / 3  # batched: ≥ 3 tokens per step on average
    assert health.running == 0 and health.waiting == 0 and health.ok


def test_same_seed_same_output_different_seed_differs(model):
    sp = lambda s: SamplingParams(max_tokens=24, temperature=1.2, seed=s)

    async def go():
        eng = CpuEngine.from_model(model)
        await eng.start()
        a = await collect(eng, "a", [1, 2, 3], sp(7))
        b = await collect(eng, "b", [1, 2, 3], sp(7))
        c = await collect(eng, "c", [1, 2, 3], sp(8))
        await eng.stop()
        return a, b, c

    a, b, c = run(go())
    assert [e.token_id for e in a] == [e.token_id for e in b]
    assert [e.token_id for e in a] != [e.token_id for e in c]


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.8), (0.0, 1.0)])
def test_engine_logprobs_equal_actor_logprobs(model, temperature, top_p):
    """The reported log-prob is log-softmax of the raw logits (policy) whatever the sampling
    temperature: it must equal the actor's ℓ on the same tokens to 1e-4."""
    ps = prompts(8, seed=2)

    async def go():
        eng = CpuEngine.from_model(model)
        await eng.start()
        outs = await asyncio.gather(*[collect(eng, f"r{i}", p, SamplingParams(max_tokens=15, temperature=temperature, top_p=top_p, seed=i))
                                      for i, p in enumerate(ps)])
        await eng.stop()
        return outs

    for p, out in zip(ps, run(go())):
        ref = actor_logprobs(model, p, [e.token_id for e in out])
        got = torch.tensor([e.logprob for e in out])
        assert (got - ref).abs().max() <= 1e-4
        if temperature == 0.0:  # greedy: each token is the argmax, so its ℓ is the max log-prob
            assert all(lp <= 0 for lp in got)


def test_sampling_logprob_mode_reports_tempered_distribution(model):
    """logprobs='sampling' at T=1, top_p=1 equals the policy log-prob; at T=0.5 it is larger
    for the chosen tokens on average (sharper distribution)."""
    async def go(mode, t):
        eng = CpuEngine.from_model(model, config=CpuEngineConfig(logprobs=mode))
        await eng.start()
        out = await collect(eng, "x", [5, 6, 7], SamplingParams(max_tokens=20, temperature=t, seed=3))
        await eng.stop()
        return out

    pol, samp = run(go("policy", 1.0)), run(go("sampling", 1.0))
    assert [e.token_id for e in pol] == [e.token_id for e in samp]
    assert torch.allclose(torch.tensor([e.logprob for e in pol]), torch.tensor([e.logprob for e in samp]), atol=1e-5)
    pol5, samp5 = run(go("policy", 0.5)), run(go("sampling", 0.5))
    assert sum(e.logprob for e in samp5) > sum(e.logprob for e in pol5)


def test_stop_token_stop_sequence_and_max_tokens(model):
    async def go():
        eng = CpuEngine.from_model(model)
        await eng.start()
        free = await collect(eng, "free", [9, 8, 7], SamplingParams(max_tokens=30, seed=11))
        ids = [e.token_id for e in free]
        seq = ids[10:12]
        first_seq = next(j for j in range(len(ids) - 1) if ids[j : j + 2] == seq)
        by_seq = await collect(eng, "seq", [9, 8, 7], SamplingParams(max_tokens=30, seed=11, stop_sequences=[seq]))
        tok = ids[6]
        by_tok = await collect(eng, "tok", [9, 8, 7], SamplingParams(max_tokens=30, seed=11, stop_token_ids=[tok]))
        await eng.stop()
        return free, ids, first_seq, by_seq, tok, by_tok

    free, ids, first_seq, by_seq, tok, by_tok = run(go())
    assert len(free) == 30 and free[-1].finish_reason == "length"
    assert [e.token_id for e in by_seq] == ids[: first_seq + 2] and by_seq[-1].finish_reason == "stop"
    assert [e.token_id for e in by_tok] == ids[: ids.index(tok) + 1] and by_tok[-1].finish_reason == "stop"
    assert all(e.finish_reason is None for e in by_tok[:-1])


def test_min_tokens_holds_back_stop_tokens_until_reached(model):
    """A third of the vocabulary as stop ids ends a free run within a few tokens; with
    min_tokens 12 none of them is among the first 12 tokens, and the reported log-probs are
    still the policy's (the actor's), not those of the masked draw."""
    stops = list(range(0, VOCAB, 3))

    async def go():
        eng = CpuEngine.from_model(model)
        await eng.start()
        free = await collect(eng, "free", [9, 8, 7], SamplingParams(max_tokens=40, seed=5, stop_token_ids=stops))
        held = await collect(eng, "held", [9, 8, 7], SamplingParams(max_tokens=40, seed=5, stop_token_ids=stops, min_tokens=12))
        await eng.stop()
        return free, held

    free, held = run(go())
    ids = [e.token_id for e in held]
    assert len(free) < 12 and free[-1].finish_reason == "stop"
    assert len(held) > 12 and not set(ids[:12]) & set(stops)
    assert held[-1].finish_reason in ("stop", "length")
    expected = actor_logprobs(model, [9, 8, 7], ids)
    assert [e.logprob for e in held] == pytest.approx(expected, abs=1e-4)


def test_abort_returns_exact_partial_output(model):
    """Abort after consuming k tokens: the returned tokens are what was yielded plus what was
    queued, a prefix of the unaborted run; the stream then yields exactly the queued rest."""
    sp = SamplingParams(max_tokens=200, seed=5)

    async def go():
        eng = CpuEngine.from_model(model)
        await eng.start()
        full = await collect(eng, "full", [3, 1, 4], sp)
        other = asyncio.create_task(collect(eng, "other", [2, 7], SamplingParams(max_tokens=40, seed=1)))
        seen = []
        stream = eng.generate("cut", [3, 1, 4], sp)
        async for ev in stream:
            seen.append(ev)
            if len(seen) == 7:
                await asyncio.sleep(0.01)  # let a few more tokens queue up
                partial = await eng.abort("cut")
                break
        rest = [ev async for ev in stream]
        other_out = await other
        await eng.stop()
        return full, seen, partial, rest, other_out

    full, seen, partial, rest, other_out = run(go())
    assert len(partial) >= 7 and len(partial) < 200
    assert [e.token_id for e in partial] == [e.token_id for e in full[: len(partial)]]
    assert partial[:7] == seen
    assert seen + rest == partial  # the stream ends with exactly the tokens abort reported
    assert len(other_out) == 40  # the abort touched no other request


def test_abort_unknown_request_raises(model):
    async def go():
        eng = CpuEngine.from_model(model)
        await eng.start()
        with pytest.raises(KeyError, match="nope"):
            await eng.abort("nope")
        await eng.stop()

    run(go())


def test_weight_update_mid_stream_versions_and_logprobs(model):
    """Update to new weights after 10 tokens of a running request: earlier tokens carry version
    0 and the old weights' ℓ, later ones version 1 and the new weights' ℓ (on the same full
    sequence); a concurrent request is not dropped."""
    new_model = tiny_model(seed=42)

    async def go():
        eng = CpuEngine.from_model(model)
        await eng.start()
        other = asyncio.create_task(collect(eng, "other", [4, 4], SamplingParams(max_tokens=60, seed=2)))
        out = []
        async for ev in eng.generate("main", [1, 2, 3, 4], SamplingParams(max_tokens=40, seed=9)):
            out.append(ev)
            if len(out) == 10:
                await eng.update_weights(new_model.state_dict(), version=1)
        o = await other
        await eng.stop()
        return out, o

    out, other = run(go())
    versions = [e.version for e in out]
    switch = versions.index(1)
    assert 10 <= switch <= 15  # tokens already sampled (queued) before the swap keep version 0
    assert versions == [0] * switch + [1] * (40 - switch)
    toks = [e.token_id for e in out]
    got = torch.tensor([e.logprob for e in out])
    old = actor_logprobs(model, [1, 2, 3, 4], toks)
    new = actor_logprobs(new_model, [1, 2, 3, 4], toks)
    assert (got[:switch] - old[:switch]).abs().max() <= 1e-4
    assert (got[switch:] - new[switch:]).abs().max() <= 1e-4
    assert (old[switch:] - new[switch:]).abs().max() > 1e-2  # the update really changed them
    assert len(other) == 60 and other[-1].version == 1


def test_update_weights_rejects_bad_state_dict(model):
    async def go():
        eng = CpuEngine.from_model(model)
        await eng.start()
        sd = dict(model.state_dict())
        sd.pop("model.norm.weight")
        with pytest.raises(ValueError, match="missing"):
            await eng.update_weights(sd, 1)
        sd = dict(model.state_dict())
        sd["model.norm.weight"] = torch.zeros(3)
        with pytest.raises(ValueError, match="model.norm.weight"):
            await eng.update_weights(sd, 1)
        assert eng.version == 0
        await eng.stop()

    run(go())


def test_lifecycle_release_resume_and_illegal_transitions(model):
    async def go():
        eng = CpuEngine.from_model(model)
        with pytest.raises(RuntimeError, match="created"):
            await eng.resume()
        await eng.start()
        with pytest.raises(RuntimeError, match="illegal"):
            await eng.start()
        task = asyncio.create_task(collect(eng, "busy", [1], SamplingParams(max_tokens=100, seed=0)))
        await asyncio.sleep(0.005)
        with pytest.raises(RuntimeError, match="drain"):
            await eng.release_memory()
        await task
        await eng.release_memory()
        h = await eng.health()
        assert h.released and h.ok
        with pytest.raises(RuntimeError, match="released"):
            await collect(eng, "x", [1], SamplingParams(max_tokens=2))
        await eng.update_weights(model.state_dict(), version=3)  # allowed while released
        await eng.resume()
        out = await collect(eng, "y", [1], SamplingParams(max_tokens=2, seed=0))
        assert [e.version for e in out] == [3, 3]
        await eng.stop()
        with pytest.raises(RuntimeError, match="illegal"):
            await eng.resume()

    run(go())


def test_bad_requests_are_rejected_with_the_field(model):
    async def go():
        eng = CpuEngine.from_model(model)
        await eng.start()
        with pytest.raises(ValueError, match="input_ids"):
            await collect(eng, "a", [VOCAB + 5], SamplingParams())
        with pytest.raises(ValueError, match="max_tokens"):
            await collect(eng, "b", [1], SamplingParams(max_tokens=0))
        with pytest.raises(ValueError, match="empty"):
            await collect(eng, "c", [], SamplingParams())
        t = asyncio.create_task(collect(eng, "dup", [1], SamplingParams(max_tokens=50)))
        await asyncio.sleep(0.002)
        with pytest.raises(ValueError, match="already in flight"):
            await collect(eng, "dup", [1], SamplingParams())
        await t
        await eng.stop()

    run(go())


def test_from_checkpoint_serves_the_saved_weights_and_stops_at_eos(tmp_path, model):
    """An engine built from the actor's HF checkpoint gives the same tokens/log-probs as one
    built from the model, and stops at the config's EOS id."""
    from gyre.backends.models.hf import save_checkpoint

    save_checkpoint(model, str(tmp_path))
    sp = SamplingParams(max_tokens=20, seed=4)

    async def go(eng):
        await eng.start()
        out = await collect(eng, "x", [7, 7, 7], sp)
        await eng.stop()
        return out

    a = run(go(CpuEngine.from_model(model)))
    b = run(go(CpuEngine.from_checkpoint(str(tmp_path), eos_token_ids=[])))
    assert [(e.token_id, e.logprob) for e in a] == [(e.token_id, e.logprob) for e in b]
    eos = a[5].token_id
    c = run(go(CpuEngine.from_checkpoint(str(tmp_path), eos_token_ids=[eos])))
    ids = [e.token_id for e in a]
    assert [e.token_id for e in c] == ids[: ids.index(eos) + 1] and c[-1].finish_reason == "stop"
    with pytest.raises(FileNotFoundError):
        CpuEngine.from_checkpoint(str(tmp_path / "nope"))


@settings(max_examples=8, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 12), st.integers(1, 30), st.sampled_from([None, 3, 8]), st.integers(0, 3),
                          st.sampled_from([[], list(range(0, VOCAB, 7)), list(range(0, VOCAB, 3))])),
                min_size=2, max_size=8), st.integers(1, 4))
def test_random_mixes_of_stops_aborts_and_batch_sizes_keep_every_stream_exact(model, reqs, max_batch):
    """Property: whatever mix of prompt lengths, max_tokens, aborts after k tokens and batch
    caps, each stream is a prefix of the request's solo run, ends exactly where its stop /
    max_tokens / abort says, and an abort returns exactly what the stream yielded."""
    async def one(eng, i, plen, max_tokens, abort_after, seed, stop_ids):
        sp = SamplingParams(max_tokens=max_tokens, seed=seed, stop_token_ids=stop_ids)
        prompt = [(7 * i + j) % VOCAB for j in range(plen)]
        got, partial = [], None
        async for ev in eng.generate(f"r{i}", prompt, sp):
            got.append(ev)
            if abort_after is not None and len(got) == abort_after and ev.finish_reason is None:
                partial = await eng.abort(f"r{i}")
        return prompt, sp, got, partial

    async def go():
        eng = CpuEngine.from_model(model, config=CpuEngineConfig(max_batch=max_batch))
        await eng.start()
        outs = await asyncio.gather(*[one(eng, i, *r) for i, r in enumerate(reqs)])
        solos = []
        for prompt, sp, _, _ in outs:
            solos.append(await collect(eng, f"solo{len(solos)}", prompt, sp))
        await eng.stop()
        return outs, solos

    outs, solos = run(go())
    for (prompt, sp, got, partial), solo in zip(outs, solos):
        ids, ref = [e.token_id for e in got], [e.token_id for e in solo]
        assert ids == ref[: len(ids)]
        if partial is None:
            assert ids == ref
            stopped = [j for j, t in enumerate(ids) if t in sp.stop_token_ids]
            if stopped:  # ends right after the first stop id
                assert stopped == [len(ids) - 1] and got[-1].finish_reason == "stop"
            else:
                assert len(ids) == sp.max_tokens and got[-1].finish_reason == "length"
        else:
            assert [e.token_id for e in partial] == ids  # stream ends with exactly what abort returned
