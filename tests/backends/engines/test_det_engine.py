"""The deterministic engine's token rate (issue 33): the proxy's added latency is measured as
call latency − tokens × token_delay, so the engine must hold its rate. Each asyncio sleep wakes
up late (timer granularity ~1 ms, a busy loop); if every token's sleep starts after the previous
wake-up, 16 tokens drift ~16 ms and the drift is billed to the proxy."""

from __future__ import annotations

import asyncio

import gyre.backends.engines.det_engine as det
from gyre.backends.protocols import SamplingParams


def test_late_wakeups_do_not_accumulate(monkeypatch):
    clock = [100.0]
    late, delay, n = 0.003, 0.02, 16
    real_sleep = asyncio.sleep

    async def sleep_late(d):  # every sleep overshoots by `late`, as a loaded loop's do
        clock[0] += d + late
        await real_sleep(0)

    monkeypatch.setattr(det, "_now", lambda: clock[0], raising=False)
    monkeypatch.setattr(asyncio, "sleep", sleep_late)
    eng = det.DeterministicEngine("e0", token_delay=delay)

    async def run():
        t0, at = clock[0], []
        async for _ in eng.generate("r1", [5, 6, 7], SamplingParams(max_tokens=n)):
            at.append(clock[0] - t0)
        return at

    at = asyncio.run(run())
    assert len(at) == n
    # token k is due delay × (k + 1); a late wake-up shows once, never summed (16 × 3 ms = 48 ms)
    for k, t in enumerate(at):
        assert delay * (k + 1) <= t <= delay * (k + 1) + late + 1e-9, (k, t)
