"""Flow control and aborts on the engine websocket (gyre/backends/engines/engine_mux.py), a real
server and client on port 0: a stream whose reader never reads holds at most its window (plus one
token line) in the client while another stream on the same connection runs to the end; an abort
stops the engine's tokens for that request (the built-in engines honour it; the server stops
taking tokens from an engine that does not)."""

import asyncio
import time

import pytest

from gyre.backends.engines import engine_mux
from gyre.backends.engines.det_engine import DeterministicEngine
from gyre.backends.engines.engine_http import HttpEngine, serve_engine_async
from gyre.backends.engines.engine_mux import event_text
from gyre.backends.protocols import SamplingParams

PROMPT = [9, 8, 7, 6]
TOP = 20


class CountingEngine(DeterministicEngine):
    """Counts the tokens it has handed out per request, and that count when each abort came."""

    def __init__(self, *a, ignore_abort: bool = False, **kw) -> None:
        super().__init__(*a, **kw)
        self.made: dict[str, int] = {}
        self.at_abort: dict[str, int] = {}
        self.longest_line = 0
        self.ignore_abort = ignore_abort

    async def generate(self, request_id, input_ids, sampling):
        self.made[request_id] = 0
        async for ev in super().generate(request_id, input_ids, sampling):
            self.made[request_id] += 1
            self.longest_line = max(self.longest_line, len(event_text(ev)))
            yield ev

    async def abort(self, request_id):
        self.at_abort.setdefault(request_id, self.made.get(request_id, 0))  # the first abort
        return [] if self.ignore_abort else await super().abort(request_id)


async def _until(pred, what: str, limit_s: float = 300.0) -> None:
    """Wait for an event (a fail-safe limit, not a timing bound)."""
    end = time.monotonic() + limit_s
    while not pred():
        assert time.monotonic() < end, f"never happened: {what}"
        await asyncio.sleep(0.01)


def _ref(n: int) -> list[tuple]:
    async def go():
        return [(e.token_id, e.logprob, e.top) async for e in DeterministicEngine("ref", salt=7).generate(
            "r", PROMPT, SamplingParams(max_tokens=n, top_logprobs=TOP))]
    return asyncio.run(go())


def test_an_unread_stream_holds_at_most_its_window_and_the_other_streams_flow(monkeypatch):
    window, n = 16 << 10, 600  # a top-20 line is ~500 bytes: ~30 lines a window, ~20 windows a call
    monkeypatch.setattr(engine_mux, "WINDOW_BYTES", window)
    want_b = _ref(n)

    async def main():
        eng = CountingEngine("flow", salt=7)
        h = await serve_engine_async(eng)
        client = HttpEngine(h.url, transport="ws")
        sp = SamplingParams(max_tokens=n, top_logprobs=TOP)
        a = client.generate("A", PROMPT, sp)
        await a.__anext__()  # then never read again (the proxy's call whose client stopped reading)
        mux = await client._get_mux()
        peak = 0
        got_b = []
        async for ev in client.generate("B", PROMPT, sp):  # the same connection
            got_b.append((ev.token_id, ev.logprob, ev.top))
            peak = max(peak, mux.buffered["A"])
        line = eng.longest_line
        await _until(lambda: mux.buffered["A"] >= window - line, "A's window filled")
        for _ in range(50):  # many more turns of both ends: the server must still be waiting
            await asyncio.sleep(0)
        peak = max(peak, mux.buffered["A"])
        made_a = eng.made["A"]
        await a.aclose()
        await _until(lambda: eng.load() == 0, "A freed in the engine")
        await client.close()
        await h.astop()
        return got_b, peak, line, made_a

    got_b, peak, line, made_a = asyncio.run(main())
    assert got_b == want_b  # B ran to its end, every token as the engine alone makes it
    assert peak <= window + line  # before: all of A (~300 KB) in the client's queue
    assert made_a <= (window + line) // 100 + 2 < n  # and the engine stopped making A's tokens (a line is > 100 bytes)


@pytest.mark.parametrize("window", [0, 16 << 10])
def test_an_engine_that_ignores_an_abort_is_stopped_by_the_server(monkeypatch, window):
    """After the abort reaches the engine, at most one more of its tokens is taken (the one the
    server's task was taking): with flow control or without."""
    monkeypatch.setattr(engine_mux, "WINDOW_BYTES", window)

    async def main():
        eng = CountingEngine("deaf", salt=7, ignore_abort=True, token_delay=1e-3)  # not done before the abort comes
        h = await serve_engine_async(eng)
        client = HttpEngine(h.url, transport="ws")
        a = client.generate("A", PROMPT, SamplingParams(max_tokens=5000, top_logprobs=TOP))
        for _ in range(3):
            await a.__anext__()
        assert await client.abort("A") == []
        # plenty of turns for both ends while a second call runs to its end
        assert len([ev async for ev in client.generate("B", PROMPT, SamplingParams(max_tokens=300, top_logprobs=TOP))]) == 300
        await _until(lambda: eng.load() == 0, "A's engine stream closed by the server")
        await a.aclose()
        await client.close()
        await h.astop()
        return eng.made["A"] - eng.at_abort["A"]

    assert asyncio.run(main()) <= 1  # before: the server took all 5000 of A's tokens


def test_the_deterministic_engine_makes_no_token_after_an_abort():
    async def main():
        eng = CountingEngine("det", salt=7)
        sp = SamplingParams(max_tokens=10_000, top_logprobs=TOP)
        a, b = eng.generate("A", PROMPT, sp), eng.generate("B", PROMPT, sp)
        for _ in range(5):
            await a.__anext__()
            await b.__anext__()
        await eng.abort("A")
        later = [ev async for ev in a]  # the consumer goes on reading after the abort
        for _ in range(200):
            await b.__anext__()
        await b.aclose()
        return eng.made["A"] - eng.at_abort["A"], later

    further, later = asyncio.run(main())
    assert further == 0 and later == []


def test_the_cpu_engine_makes_no_token_after_an_abort():
    """Another request goes on for 60 decode steps after the abort; the aborted one gets none."""
    from gyre.backends.engines.cpu_engine import CpuEngine
    from tests.backends.helpers import tiny_model

    async def main():
        eng = CpuEngine.from_model(tiny_model(seed=0))
        await eng.start()
        a = eng.generate("A", PROMPT, SamplingParams(max_tokens=500, seed=1))
        b = eng.generate("B", PROMPT, SamplingParams(max_tokens=70, seed=2))
        for _ in range(5):
            await a.__anext__()
            await b.__anext__()
        req = eng._requests["A"]
        partial = await eng.abort("A")  # every token made for A so far
        rest_b = [ev async for ev in b]
        made_after = len(req.out) - len(partial)
        await a.aclose()
        await eng.stop()
        return made_after, len(rest_b)

    made_after, rest_b = asyncio.run(main())
    assert rest_b == 65 and made_after == 0


def test_an_abort_after_the_client_closed_the_stream_sends_no_rows_back(monkeypatch):
    """The proxy's router aborts a call whose client has gone after the stream is closed: the
    engine must not send back (nor the proxy parse) every token made, tens of MB at top 20."""
    monkeypatch.setattr(engine_mux, "WINDOW_BYTES", 16 << 10)

    async def main():
        eng = CountingEngine("gone", salt=7)
        h = await serve_engine_async(eng)
        client = HttpEngine(h.url, transport="ws")
        a = client.generate("A", PROMPT, SamplingParams(max_tokens=5000, top_logprobs=TOP))
        for _ in range(3):
            await a.__anext__()
        await a.aclose()  # the consumer goes: an abort asking no reply
        rows = await client.abort("A")  # the router's, right behind it
        await _until(lambda: eng.load() == 0, "A freed in the engine")
        await client.close()
        await h.astop()
        return rows, eng.at_abort["A"]

    rows, made = asyncio.run(main())
    assert made >= 3 and rows == []  # before: the rows of every token made for A
