"""KV migration, engine level: export/import of a running request is bit-exact and continues
exactly what the source would have generated; the two-phase ticket is held until released."""

from __future__ import annotations

import asyncio

import pytest
import torch

from gyre.backends.config import CpuEngineConfig
from gyre.backends.engines.cpu_engine import CpuEngine
from gyre.backends.transfer.migration_policy import MigrationPolicy
from gyre.backends.transfer.migration import (LocalKvTransport, MigrationRefused, pack_state,
                                     unpack_state)
from gyre.backends.protocols import SamplingParams
from tests.backends.helpers import tiny_model

PROMPT = [5, 17, 42, 99, 3, 250, 7, 64, 128, 11, 200, 31]
SP = SamplingParams(max_tokens=40, temperature=1.0, top_p=0.95, seed=1234, min_tokens=30)


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=0)


def engine(model, name, **cfg):
    e = CpuEngine.from_model(model, config=CpuEngineConfig(**cfg), eos_token_ids=[0])
    e.name = name
    return e


def rows(events):
    return [(e.token_id, e.logprob, e.version) for e in events]


async def undisturbed(model, prompt=PROMPT, sp=SP):
    e = engine(model, "ref")
    await e.start()
    try:
        return [ev async for ev in e.generate("ref", prompt, sp)]
    finally:
        await e.stop()


async def run_until(src, rid, prompt, sp, k):
    """Start `rid` on `src`, read k tokens, leave the stream open (the request keeps running)."""
    stream = src.generate(rid, prompt, sp)
    seen = [await stream.__anext__() for _ in range(k)]
    return stream, seen


def test_pack_unpack_round_trip_is_bit_exact(model):
    async def main():
        src = engine(model, "src")
        await src.start()
        stream, _ = await run_until(src, "r", PROMPT, SP, 7)
        state = await src.export_request("r")
        await stream.aclose()
        await src.stop()
        return state

    state = asyncio.run(main())
    back = unpack_state(pack_state(state))
    assert back.prompt == state.prompt and back.kv_length == state.kv_length == len(PROMPT) + len(state.events) - 1
    assert rows(back.events) == rows(state.events) and back.sampling == state.sampling
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(back.kv_k + back.kv_v, state.kv_k + state.kv_v))
    assert len(back.kv_k) == 2 and back.kv_k[0].shape == (2, state.kv_length, 16)  # tiny: 2 layers, 2 kv heads, hd 16
    assert torch.equal(back.rng_state, state.rng_state) and back.model == state.model


@pytest.mark.parametrize("cut", [1, 9, 33])  # first token; mid-sequence; past min_tokens' end is near
def test_migrated_continuation_equals_undisturbed_run(model, cut):
    async def main():
        ref = await undisturbed(model)
        src, dst = engine(model, "src"), engine(model, "dst")
        await src.start(), await dst.start()
        stream, _ = await run_until(src, "a", PROMPT, SP, cut)
        state = await src.export_request("a")
        tail = [ev async for ev in stream]  # the source's stream ends (tokens produced but unread)
        assert rows(tail) == rows(state.events[cut:])
        dst.import_request("b", unpack_state(pack_state(state)))
        left = SamplingParams(**{**SP.__dict__, "max_tokens": SP.max_tokens - len(state.events),
                                 "min_tokens": max(0, SP.min_tokens - len(state.events))})
        cont = [ev async for ev in dst.generate("b", state.sequence(), left)]
        recomputed = [ev async for ev in dst.generate("c", state.sequence(), left)]  # today's reroute
        await src.stop(), await dst.stop()
        return ref, state.events + cont, state.events + recomputed

    ref, migrated, recomputed = asyncio.run(main())
    assert len(ref) == SP.max_tokens or ref[-1].finish_reason == "stop"
    assert rows(migrated) == rows(ref)  # tokens, log-probs (exact floats), versions
    assert migrated[-1].finish_reason == ref[-1].finish_reason
    assert rows(recomputed) != rows(ref)  # the check can tell: recompute restarts the RNG


def test_export_refuses_a_waiting_request_and_leaves_it_running(model):
    async def main():
        src = engine(model, "src")
        await src.start()
        stream = src.generate("w", PROMPT, SP)
        first = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0)  # queued, not yet prefilled
        with pytest.raises(MigrationRefused):
            await src.export_request("w")
        out = [await first] + [ev async for ev in stream]
        await src.stop()
        return out

    out = asyncio.run(main())
    assert rows(out) == rows(asyncio.run(undisturbed(model)))


def test_import_refuses_other_model_and_other_version(model):
    async def main():
        src = engine(model, "src")
        other = CpuEngine.from_model(tiny_model(seed=0, jitter=0.3).to(torch.float64), eos_token_ids=[0])
        newer = engine(model, "newer")
        newer.version = 3
        for e in (src, other, newer):
            await e.start()
        stream, _ = await run_until(src, "a", PROMPT, SP, 3)
        state = await src.export_request("a")
        await stream.aclose()
        with pytest.raises(MigrationRefused, match="model"):
            other.import_request("x", state)
        with pytest.raises(MigrationRefused, match="version"):
            newer.import_request("x", state)
        for e in (src, other, newer):
            await e.stop()

    asyncio.run(main())


def test_two_phase_source_holds_until_release(model):
    async def main():
        src, dst = engine(model, "m-src"), engine(model, "m-dst")
        src.attach_kv_transport(LocalKvTransport("m-src"))
        dst.attach_kv_transport(LocalKvTransport("m-dst"))
        await src.start(), await dst.start()
        stream, _ = await run_until(src, "a", PROMPT, SP, 5)
        events, handle = await src.migrate_out("a")
        await stream.aclose()
        assert src.held_migrations() == 1  # held: the target has not acknowledged
        nbytes = await dst.migrate_in("b", handle)  # the ack
        assert nbytes == handle["nbytes"] and src.held_migrations() == 1  # still held until the router releases
        assert await src.migrate_release(handle["key"]) and src.held_migrations() == 0
        with pytest.raises(KeyError):  # released: nothing left to pull
            await dst.migrate_in("c", handle)
        assert not await src.migrate_release(handle["key"])  # twice: harmless
        await src.stop(), await dst.stop()

    asyncio.run(main())


def test_cost_rule():
    p = MigrationPolicy(mode="auto", bandwidth_Bps=1e9, prefill_tok_s=10_000, overhead_s=0.01)
    learned = MigrationPolicy(mode="auto", overhead_s=0.0)
    learned.observe(10**9, 1.0)
    assert learned.estimate(1000, 1000, prefill_tok_s=500.0) == (1e-3, 2.0)  # measured rates used
    with pytest.raises(ValueError):
        learned.pays(1000, 1000)  # auto with no prefill rate: say so (the router then recomputes)
    # 16k tokens × 32 KiB/token = 512 MiB: 0.55 s to move vs 1.6 s to recompute → migrate
    assert p.pays(16384, 32 << 10)
    # 100 tokens: 0.013 s vs 0.01 s → recompute
    assert not p.pays(100, 32 << 10)
    assert MigrationPolicy(mode="always").pays(1, 1 << 30) and not MigrationPolicy(mode="off").pays(10**6, 1)
    with pytest.raises(ValueError):
        MigrationPolicy(mode="sometimes")


def test_long_prefill_in_query_blocks_matches_one_pass(model, monkeypatch):
    """Long contexts (what migration is for) prefill in query blocks; same logits as one pass."""
    from gyre.backends.engines import decoder
    from gyre.backends.engines.decoder import DecoderWeights, KVCache, extend

    w = DecoderWeights.from_state_dict(model.state_dict(), model.config)
    ids = torch.randint(0, 256, (50,), generator=torch.Generator().manual_seed(3))

    def logits(block, past=0):
        monkeypatch.setattr(decoder, "_QUERY_BLOCK", block)
        cache = KVCache.empty(w, 64)
        if past:
            extend(w, ids[:past], torch.arange(past), [past], [cache])
        out = extend(w, ids[past:], torch.arange(past, 50), [50 - past], [cache], all_logits=True)
        return out, cache

    one, c1 = logits(4096)
    for block, past in ((8, 0), (7, 13)):
        blocked, c2 = logits(block, past)
        torch.testing.assert_close(blocked, one[past:], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(c2.k[1][:, :50], c1.k[1][:, :50], rtol=1e-5, atol=1e-5)
