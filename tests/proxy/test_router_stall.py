"""Gray failures in the router: an engine that stops sending tokens (a frozen rank) costs a call
at most `progress_timeout_s`; the call continues elsewhere from its tokens, the silent engine
gets no new calls until it answers a health check, and then gets them again."""

import asyncio
import time

from gyre.backends.engines.det_engine import DeterministicEngine
from gyre.backends.protocols import SamplingParams
from gyre.proxy.router import RouteInfo, Router

EOS = frozenset([2])


class FreezableEngine:
    """A DeterministicEngine that freezes (as under SIGSTOP) after `freeze_after` tokens of any
    call: its streams and its health check hang until `thaw()`."""

    def __init__(self, name: str, salt: int, freeze_after: int) -> None:
        self.inner = DeterministicEngine(name, salt=salt)
        self.name = name
        self.freeze_after = freeze_after
        self.thawed = asyncio.Event()
        self.health_checks = 0

    def thaw(self) -> None:
        self.thawed.set()

    async def generate(self, request_id, input_ids, sampling):
        n = 0
        async for ev in self.inner.generate(request_id, input_ids, sampling):
            if n >= self.freeze_after:
                await self.thawed.wait()
            n += 1
            yield ev

    async def abort(self, request_id):
        await self.thawed.wait()
        return await self.inner.abort(request_id)

    async def health(self):
        self.health_checks += 1
        await self.thawed.wait()
        return await self.inner.health()

    def load(self) -> int:
        return self.inner.load()


async def _collect(router, key, execution_id, sp, info=None):
    return [ev async for ev in router.generate(key, execution_id, [10, 11, 12], sp, info, EOS)]


def test_a_frozen_engine_loses_its_call_within_the_progress_timeout_and_comes_back_when_healthy():
    async def main():
        r = Router(progress_timeout_s=0.3, health_interval_s=0.1)
        frozen = FreezableEngine("A", salt=1, freeze_after=5)
        r.add_engine(frozen, kind="cell", index=0)
        info = RouteInfo()
        t0 = time.monotonic()
        task = asyncio.create_task(_collect(r, "c0", "ex0", SamplingParams(max_tokens=40), info))
        await asyncio.sleep(0.05)
        r.add_engine(DeterministicEngine("B", salt=2), kind="cell", index=1)  # the call already runs on A
        out = await asyncio.wait_for(task, 5.0)
        took = time.monotonic() - t0
        stalled_after_call = r.slots["A"].stalled
        # A new call (even one with affinity to A) goes to B while A is silent.
        info2 = RouteInfo()
        await _collect(r, "c1", "ex0", SamplingParams(max_tokens=3), info2)
        frozen.thaw()
        for _ in range(100):
            if not r.slots["A"].stalled:
                break
            await asyncio.sleep(0.02)
        return r, frozen, info, info2, out, took, stalled_after_call

    r, frozen, info, info2, out, took, stalled_after_call = asyncio.run(main())
    assert len(out) == 40 and info.engines == ["A", "B"]  # continued on B from A's 5 tokens
    assert took < 0.3 + 1.0, took
    assert r.stalls == 1 and stalled_after_call
    assert info2.engines == ["B"]
    assert frozen.health_checks >= 1 and not r.slots["A"].stalled  # answered a health check: back in service
    assert r.stats()["engine_stalls"] == 1


def test_without_a_progress_limit_the_call_waits_on_the_frozen_engine():
    """The control: the same frozen engine with the limit off (0) holds the call."""
    async def main():
        r = Router()
        r.add_engine(FreezableEngine("A", salt=1, freeze_after=5), kind="cell", index=0)
        r.add_engine(DeterministicEngine("B", salt=2), kind="cell", index=1)
        r.slots["B"].served = 10  # A is picked first
        try:
            await asyncio.wait_for(_collect(r, "c0", "ex0", SamplingParams(max_tokens=40)), 1.0)
        except asyncio.TimeoutError:
            return "hung"
        return "done"

    assert asyncio.run(main()) == "hung"
