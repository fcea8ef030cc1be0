"""The router's progress limit costs O(1) timers and tasks per engine stream, not one per token
(benchmarks/scale_bench.py: `asyncio.wait_for` per token was ~20 µs of the proxy's event loop per
token routed); the limit still fires on a silent engine, and a cancel from outside is still a
cancel, not a stall."""

import asyncio

import pytest

from gyre.backends.engines.det_engine import DeterministicEngine
from gyre.backends.protocols import SamplingParams
from gyre.proxy.router import NoEngineError, Router

from tests.proxy.test_router_stall import EOS, FreezableEngine

TOKENS = 500


def _count_tasks(loop: asyncio.AbstractEventLoop) -> list[int]:
    made = [0]

    def factory(loop, coro, **kw):
        made[0] += 1
        return asyncio.Task(coro, loop=loop, **kw)

    loop.set_task_factory(factory)
    return made


def test_a_long_call_makes_no_task_or_timer_per_token():
    async def main():
        loop = asyncio.get_running_loop()
        router = Router(progress_timeout_s=30.0)
        router.add_engine(DeterministicEngine("e"), kind="cell", index=0)
        made = _count_tasks(loop)
        timers = [0]
        call_at = loop.call_at

        def counting_call_at(when, cb, *args, **kw):
            timers[0] += 1
            return call_at(when, cb, *args, **kw)

        loop.call_at = counting_call_at
        try:
            n = 0
            async for _ in router.generate("c0", "x", [10, 11, 12], SamplingParams(max_tokens=TOKENS)):
                n += 1
        finally:
            del loop.call_at
        return n, made[0], timers[0]

    n, tasks, timers = asyncio.run(main())
    assert n == TOKENS
    # One engine stream: a handful of tasks and timers at most, whatever its length (per-token
    # wait_for made >= 500 of each).
    assert tasks <= 5, tasks
    assert timers <= 5, timers


def test_the_limit_still_fires_on_a_silent_engine_and_the_call_continues_elsewhere():
    async def main():
        router = Router(progress_timeout_s=0.2, health_interval_s=0.05)
        frozen = FreezableEngine("frozen", salt=0, freeze_after=3)
        router.add_engine(frozen, kind="cell", index=0)
        router.add_engine(DeterministicEngine("ok", salt=0), kind="cell", index=1)
        router._affinity["x"] = "frozen"
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        evs = [ev async for ev in router.generate("c0", "x", [10, 11, 12], SamplingParams(max_tokens=20), None, EOS)]
        dt = loop.time() - t0
        frozen.thaw()
        return evs, dt, router.stalls

    evs, dt, stalls = asyncio.run(main())
    # Same salt: the continuation on "ok" is the uninterrupted sequence a single engine emits.
    ref = DeterministicEngine("ref", salt=0)
    seq, want = [10, 11, 12], []
    for _ in range(20):
        ev = ref.token_after(seq)
        want.append(ev.token_id)
        seq.append(ev.token_id)
    assert [e.token_id for e in evs] == want
    assert stalls == 1
    assert 0.2 <= dt < 2.0


def test_a_cancel_from_outside_is_a_cancel_not_a_stall():
    async def main():
        router = Router(progress_timeout_s=0.2, health_interval_s=0.05)
        frozen = FreezableEngine("frozen", salt=0, freeze_after=2)
        router.add_engine(frozen, kind="cell", index=0)

        async def consume():
            return [ev async for ev in router.generate("c0", "x", [10, 11, 12], SamplingParams(max_tokens=20), None, EOS)]

        task = asyncio.ensure_future(consume())
        await asyncio.sleep(0.05)  # waiting on the frozen engine, well inside the limit
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.3)  # past the limit: the stream's timer must not fire on the dead call
        frozen.thaw()
        return router.stalls, frozen.inner.load()

    stalls, load = asyncio.run(main())
    assert stalls == 0
    assert load == 0


def test_a_stalled_call_raises_engine_stalled_when_no_engine_is_left():
    async def main():
        router = Router(progress_timeout_s=0.1, health_interval_s=0.05, max_reroutes=0)
        frozen = FreezableEngine("frozen", salt=0, freeze_after=1)
        router.add_engine(frozen, kind="cell", index=0)
        try:
            with pytest.raises(Exception) as ei:
                [ev async for ev in router.generate("c0", "x", [10, 11, 12], SamplingParams(max_tokens=20), None, EOS)]
        finally:
            frozen.thaw()
        return ei.value, router.stalls

    err, stalls = asyncio.run(main())
    assert stalls == 1
    assert isinstance(err, NoEngineError), repr(err)
