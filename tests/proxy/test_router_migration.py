"""Drain with KV migration, through the router, on real CPU engines (tiny model, in-process KV
transport): a migrated call continues exactly as an undisturbed run; every failure falls back to
recompute with no call aborted; the source never frees the KV before the target's ack."""

from __future__ import annotations

import asyncio

import pytest
import torch

from gyre.backends.config import CpuEngineConfig
from gyre.backends.engines.cpu_engine import CpuEngine
from gyre.backends.transfer.migration import LocalKvTransport
from gyre.backends.transfer.migration_policy import MigrationPolicy
from gyre.backends.protocols import SamplingParams
from gyre.proxy.router import Router
from tests.backends.helpers import tiny_model

PROMPT = [5, 17, 42, 99, 3, 250, 7, 64, 128, 11, 200, 31] * 3
SP = SamplingParams(max_tokens=30, temperature=1.0, top_p=0.95, seed=77, min_tokens=30)
STEP_S = 0.01  # paced decode steps: the drain lands mid-generation whatever the machine's load


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=0)


def make(model, name, transport=LocalKvTransport, version=0):
    e = CpuEngine.from_model(model, config=CpuEngineConfig(min_decode_step_s=STEP_S), eos_token_ids=[0], version=version)
    e.name = name
    if transport is not None:
        e.attach_kv_transport(transport(name))
    return e


def rows(events):
    return [(e.token_id, e.logprob, e.version) for e in events]


async def undisturbed(model, prompt, sp):
    e = make(model, "ref", transport=None)
    await e.start()
    out = [ev async for ev in e.generate("ref", prompt, sp)]
    await e.stop()
    return out


async def drained_run(model, *, target=None, mode="always", calls=1, cut=8, src=None):
    """Calls start on cell `c` (alone); after `cut` tokens of the first, pool `p` joins and `c`
    is drained. Returns (outputs per call, router, source, target)."""
    src = src or make(model, "c")
    dst = target or make(model, "p")
    router = Router(migration=MigrationPolicy(mode=mode))
    for e in (src, dst):
        await e.start()
    router.add_engine(src, kind="cell", index=0)
    outs = [[] for _ in range(calls)]
    reached = asyncio.Event()

    async def consume(i):
        async for ev in router.generate(f"call{i}", f"ex{i}", PROMPT, SP):
            outs[i].append(ev)
            if i == 0 and len(outs[i]) == cut:
                reached.set()

    tasks = [asyncio.create_task(consume(i)) for i in range(calls)]
    await reached.wait()
    router.add_engine(dst, kind="pool", index=0)
    moved = await router.drain("c")
    await asyncio.gather(*tasks)  # raises if any call was aborted
    for e in (src, dst):
        await e.stop()
    assert moved == calls
    return outs, router, src, dst


def test_drained_call_migrates_and_continues_exactly(model):
    async def main():
        ref = await undisturbed(model, PROMPT, SP)
        (out,), router, src, dst = await drained_run(model)
        return ref, out, router, src

    ref, out, router, src = asyncio.run(main())
    assert rows(out) == rows(ref)  # tokens, log-probs (exact floats), versions
    (rec,) = router.reroute_log
    assert (rec.mode, rec.source, rec.target, rec.tokens_recomputed, rec.fallback) == ("migrate", "c", "p", 0, None)
    assert rec.bytes_moved > 2 * 2 * 2 * 16 * 4 * len(PROMPT)  # at least the prompt's KV: 2 layers × K,V × 2 heads × hd 16 × fp32
    assert rec.latency_s > 0 and src.held_migrations() == 0
    stats = router.stats()["migration"]
    assert (stats["migrated"], stats["recomputed"], stats["tokens_recomputed"]) == (1, 0, 0)


def test_recompute_mode_is_the_baseline_it_is_compared_with(model):
    """Migration off: the call is recomputed (prompt + generated prefilled again) and, RNG
    restarted, diverges from the undisturbed run - so the exactness check above can fail."""

    async def main():
        ref = await undisturbed(model, PROMPT, SP)
        (out,), router, _, _ = await drained_run(model, mode="off")
        return ref, out, router

    ref, out, router = asyncio.run(main())
    (rec,) = router.reroute_log
    assert rec.mode == "recompute" and rec.tokens_recomputed >= len(PROMPT) + 8 and rec.bytes_moved == 0
    assert len(out) == SP.max_tokens and rows(out) != rows(ref)


def test_several_calls_all_migrate_none_recomputed(model):
    async def main():
        outs, router, src, _ = await drained_run(model, calls=3)
        return outs, router, src

    outs, router, src = asyncio.run(main())
    assert all(len(o) == SP.max_tokens for o in outs)
    stats = router.stats()["migration"]
    assert (stats["migrated"], stats["recomputed"], stats["tokens_recomputed"], stats["fallbacks"]) == (3, 0, 0, 0)
    assert src.held_migrations() == 0


class _BrokenPull(LocalKvTransport):
    def pull(self, handle):
        raise ConnectionError("link down")


class _SourceDiesMidPull(LocalKvTransport):
    """The source's process dies while the target reads: its held memory is gone."""

    def pull(self, handle):
        from gyre.backends.transfer import migration

        migration._local[handle["source"]].close()
        return super().pull(handle)


@pytest.mark.parametrize("case", ["target refuses", "transport error", "source dies mid-transfer"])
def test_failed_migration_falls_back_to_recompute(model, case):
    async def main():
        if case == "target refuses":
            target = make(model, "p", version=1)  # KV of version 0 cannot continue under version 1
        elif case == "transport error":
            target = make(model, "p", transport=_BrokenPull)
        else:
            target = make(model, "p", transport=_SourceDiesMidPull)
        (out,), router, src, _ = await drained_run(model, target=target)
        return out, router, src

    out, router, src = asyncio.run(main())
    assert len(out) == SP.max_tokens  # completed: nothing aborted, nothing lost
    (rec,) = router.reroute_log
    assert rec.mode == "recompute" and rec.fallback and rec.tokens_recomputed >= len(PROMPT) + 8
    assert src.held_migrations() == 0  # released after the failure too
    expected = {"target refuses": "version", "transport error": "link down", "source dies mid-transfer": "KeyError"}[case]
    assert expected in rec.fallback


def test_source_releases_only_after_the_ack(model):
    """Order of events on the seam: the target's migrate_in returns (the ack) before the source's
    transport drops the held buffer."""
    log = []

    class Spy(LocalKvTransport):
        def drop(self, key):
            log.append(("drop", key))
            super().drop(key)

    async def main():
        src = make(model, "c", transport=Spy)
        dst = make(model, "p")
        inner = dst.migrate_in

        async def migrate_in(rid, handle):
            n = await inner(rid, handle)
            log.append(("ack", handle["key"]))
            return n

        dst.migrate_in = migrate_in
        router = Router(migration=MigrationPolicy(mode="always"))
        for e in (src, dst):
            await e.start()
        router.add_engine(src, kind="cell", index=0)
        out = []

        async def consume():
            async for ev in router.generate("k", "ex", PROMPT, SP):
                out.append(ev)
                if len(out) == 5:
                    router.add_engine(dst, kind="pool", index=0)
                    asyncio.get_running_loop().create_task(router.drain("c"))

        await consume()
        for e in (src, dst):
            await e.stop()
        return router

    router = asyncio.run(main())
    assert router.stats()["migration"]["migrated"] == 1
    assert [kind for kind, _ in log] == ["ack", "drop"] and log[0][1] == log[1][1]


def test_auto_mode_follows_the_cost_rule(model):
    async def main(policy):
        src, dst = make(model, "c"), make(model, "p")
        router = Router(migration=policy)
        for e in (src, dst):
            await e.start()
        router.add_engine(src, kind="cell", index=0)
        out = []
        async for ev in router.generate("k", "ex", PROMPT, SP):
            out.append(ev)
            if len(out) == 4:
                router.add_engine(dst, kind="pool", index=0)
                asyncio.get_running_loop().create_task(router.drain("c"))
        for e in (src, dst):
            await e.stop()
        return router.reroute_log[0].mode

    # ~44 tokens × 512 B: a slow link loses to a fast prefill, a fast link wins
    assert asyncio.run(main(MigrationPolicy(mode="auto", bandwidth_Bps=1e3, prefill_tok_s=1e6))) == "recompute"
    assert asyncio.run(main(MigrationPolicy(mode="auto", bandwidth_Bps=1e12, prefill_tok_s=10.0))) == "migrate"


def test_over_http_control_endpoints(model):
    """Engines in their own server threads, the router speaking HTTP: only the handle crosses the
    control endpoints (the KV goes over the engines' transport); the continuation is exact."""
    from gyre.backends.engines.engine_http import HttpEngine, serve_engine

    src, dst = make(model, "c"), make(model, "p")
    hs, hd = serve_engine(src), serve_engine(dst)

    async def main():
        ref = await undisturbed(model, PROMPT, SP)
        a, b = HttpEngine(hs.url, name="c"), HttpEngine(hd.url, name="p")
        await a.start(), await b.start()
        router = Router(migration=MigrationPolicy(mode="always"))
        router.add_engine(a, kind="cell", index=0)
        out = []
        async for ev in router.generate("k", "ex", PROMPT, SP):
            out.append(ev)
            if len(out) == 6:
                router.add_engine(b, kind="pool", index=0)
                asyncio.get_running_loop().create_task(router.drain("c"))
        await a.close(), await b.close()
        return ref, out, router

    try:
        ref, out, router = asyncio.run(main())
    finally:
        hs.call(src.stop()), hd.call(dst.stop())
        hs.stop(), hd.stop()
    assert rows(out) == rows(ref)
    (rec,) = router.reroute_log
    assert rec.mode == "migrate" and rec.tokens_recomputed == 0 and src.held_migrations() == 0


def test_metrics_rows_count_each_reroute_once(model):
    from gyre.runtime.outputs import reroute_fields

    async def main():
        (_,), router, _, _ = await drained_run(model)
        first = reroute_fields(router.take_reroutes())
        second = reroute_fields(router.take_reroutes())
        return first, second, router

    first, second, router = asyncio.run(main())
    rec = router.reroute_log[0]
    assert first == {"reroutes_migrated": 1, "reroutes_recomputed": 0, "reroute_tokens_recomputed": 0,
                     "reroute_bytes_moved": rec.bytes_moved, "migration_fallbacks": 0,
                     "reroute_latency_s_migrated": rec.latency_s, "reroute_latency_s_recomputed": None}
    assert second["reroutes_migrated"] == 0 and second["reroute_bytes_moved"] == 0


class _CannotHold(LocalKvTransport):
    def hold(self, key, buf):
        raise MemoryError("no room to stage the KV")


def test_source_failing_to_hold_falls_back_to_recompute(model):
    """The source stops the request but cannot stage its state: the router gets the tokens back
    (as from abort) and recomputes."""

    async def main():
        return await drained_run(model, src=make(model, "c", transport=_CannotHold))

    (out,), router, src, _ = asyncio.run(main())
    (rec,) = router.reroute_log
    assert len(out) == SP.max_tokens and rec.mode == "recompute" and "could not hold" in rec.fallback
    assert rec.tokens_recomputed >= len(PROMPT) + 8 and src.held_migrations() == 0
