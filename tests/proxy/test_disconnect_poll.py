"""A non-streamed call notices its client went away by polling the connection; the poll backs
off (50 ms doubling to 1 s) so that long calls in flight do not keep the proxy's event loop busy
(a fixed 50 ms poll: 20 wake-ups a second per call; benchmarks/scale_bench.py), and a client that
leaves is still noticed within the longest interval."""

import asyncio

import pytest

from gyre.proxy.core import ClientGone, abort_on_disconnect


class _Transport:
    def __init__(self) -> None:
        self.closing = False

    def is_closing(self) -> bool:
        return self.closing


class _Request:
    def __init__(self) -> None:
        self.transport = _Transport()


def test_a_long_call_is_polled_a_handful_of_times_not_twenty_a_second():
    async def main():
        loop = asyncio.get_running_loop()
        req = _Request()
        with abort_on_disconnect(req) as guard:
            waits = []
            for _ in range(40):  # what 40 timer firings schedule next, without waiting for them
                guard.handle.cancel()
                guard._check()
                waits.append(guard.handle.when() - loop.time())
        return waits

    waits = asyncio.run(main())
    assert waits[0] == pytest.approx(0.1, abs=0.02)
    assert all(b >= a - 0.02 for a, b in zip(waits, waits[1:]))  # never shorter
    assert max(waits) == pytest.approx(1.0, abs=0.02) and waits[-1] == pytest.approx(1.0, abs=0.02)
    assert sum(w < 0.9 for w in waits) == 4  # 0.1, 0.2, 0.4, 0.8 s, then once a second


def test_a_client_that_leaves_is_noticed_and_the_call_cancelled():
    async def main():
        req = _Request()
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        with pytest.raises(ClientGone):
            with abort_on_disconnect(req, poll_s=0.01, max_poll_s=0.05):
                loop.call_later(0.2, setattr, req.transport, "closing", True)
                await asyncio.sleep(5)
        return loop.time() - t0

    dt = asyncio.run(main())
    assert 0.2 <= dt < 0.2 + 0.05 + 0.5  # within the longest interval (+ slack for a loaded machine)
