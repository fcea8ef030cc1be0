"""The controller's loop closes in bounded time even when a task refuses to be cancelled
(a run must exit after writing its summary, not hang in asyncio's clean-up)."""

import asyncio
import logging
import time

from gyre.runtime.stop import close_loop


def test_close_loop_cancels_and_abandons_a_stubborn_task(caplog):
    loop = asyncio.new_event_loop()
    cancelled = []

    async def polite():
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.append("polite")
            raise

    async def stubborn():
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                cancelled.append("stubborn")  # swallowed: keeps running

    async def start():
        loop.create_task(polite(), name="polite")
        loop.create_task(stubborn(), name="stubborn")
        await asyncio.sleep(0)

    loop.run_until_complete(start())
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="gyre.runtime.controller"):
        close_loop(loop, timeout=0.5)
    assert time.monotonic() - t0 < 5.0
    assert loop.is_closed()
    assert sorted(cancelled) == ["polite", "stubborn"]
    assert "1 tasks did not stop" in caplog.text and "stubborn" in caplog.text and "polite" not in caplog.text.split("abandoned:")[1]
