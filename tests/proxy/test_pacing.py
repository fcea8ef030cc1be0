"""Streams that cannot stall the proxy (gyre/proxy/pacing.py), through a real server on port 0:
log-probs in bounded frames (the official openai SDK), the event loop given a turn every few
tokens even when the engine has thousands ready, a frame's log-probs charged to the execution's
rate budget, and a client that never reads (a raw socket) has its call ended as `abort`."""

import asyncio
import logging
import re
import socket
import threading
import time
from types import SimpleNamespace

import httpx
import json
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from aiohttp import web

from gyre.backends.engines.det_engine import DeterministicEngine
from gyre.backends.engines.engine_http import HttpEngine, serve_engine
from gyre.backends.models.tokenizer import load_tokenizer, token_bytes
from gyre.proxy import ProxyConfig
from gyre.proxy.errors import ApiError
from gyre.proxy.pacing import FRAME_TURNS, PacedResponse, frame_tokens
from tests.proxy.test_openai_api import calls, reference

TABLE = token_bytes(load_tokenizer())
TOP = 20
PER_FRAME = frame_tokens(TOP, True)


def _wait_for(pred, what: str, limit_s: float = 300.0):
    """Wait for an event (a fail-safe, not a timing bound: the machine may be loaded)."""
    end = time.monotonic() + limit_s
    while not pred():
        assert time.monotonic() < end, f"never happened: {what}"
        time.sleep(0.05)


@pytest.fixture
def engine_over_ws():
    """A fast engine in its own server: its websocket frames hold many tokens at once (`more`)."""
    h = serve_engine(DeterministicEngine("fast", salt=3))
    yield HttpEngine(h.url, name="fast")
    h.stop()


def test_streamed_top_logprobs_come_in_bounded_frames_and_add_up(make_server, engine_over_ws):
    proxy, h = make_server([(engine_over_ws, "cell", 0)], ProxyConfig(calls_per_second_per_key=0))
    c = openai.OpenAI(base_url=h.url + "/v1", api_key=proxy.issue_key("ex-frames"), max_retries=0)
    n = 600
    chunks = list(c.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=n, stream=True,
                                            logprobs=True, top_logprobs=TOP, stream_options={"include_usage": True}))
    per = [len(ch.choices[0].logprobs.content) for ch in chunks if ch.choices and ch.choices[0].logprobs]
    entries = [e for ch in chunks if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert max(per) <= PER_FRAME  # before: one frame per engine delivery, hundreds of tokens x 21 entries
    rec = proxy.sink.records[-1]
    ids = rec.output_ids.tolist()
    assert len(ids) == n == chunks[-1].usage.completion_tokens == len(entries)  # every token once, none dropped
    assert [bytes(e.bytes) for e in entries] == [TABLE[t] for t in ids]
    assert all(len(e.top_logprobs) == TOP for e in entries)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == b"".join(TABLE[t] for t in ids).decode("utf-8", "replace")


class CountingEngine(DeterministicEngine):
    """Counts the tokens it has handed out (instant: it never awaits between tokens)."""

    sent = 0

    async def generate(self, request_id, input_ids, sampling):
        async for ev in super().generate(request_id, input_ids, sampling):
            self.sent += 1
            yield ev


@pytest.mark.parametrize("stream", [True, False])
def test_the_loop_gets_a_turn_every_frame_of_tokens(make_server, stream):
    eng = CountingEngine("instant", salt=1)
    proxy, h = make_server([(eng, "cell", 0)], ProxyConfig(calls_per_second_per_key=0))
    n = 3000
    gaps: list[int] = []

    async def ticker(done: threading.Event) -> None:  # runs once per pass of the proxy's loop
        last = eng.sent
        while not done.is_set():
            gaps.append(eng.sent - last)
            last = eng.sent
            await asyncio.sleep(0)

    done = threading.Event()
    fut = asyncio.run_coroutine_threadsafe(ticker(done), h.loop)
    c = openai.OpenAI(base_url=h.url + "/v1", api_key=proxy.issue_key("ex-turns"), max_retries=0)
    kw = dict(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=n, logprobs=True, top_logprobs=TOP)
    if stream:
        assert sum(1 for _ in c.chat.completions.create(stream=True, **kw)) > 1
    else:
        c.chat.completions.create(**kw)
    done.set()
    fut.result(60)
    assert eng.sent == n
    assert max(gaps) <= PER_FRAME  # before: the whole call (3000 tokens) between two turns of the loop


def test_a_non_streamed_answer_is_built_and_written_a_frame_at_a_time(make_server, monkeypatch):
    """The body of a non-streamed top-20 answer: between two passes of the proxy's loop, at most
    one frame's log-prob entries are built (and written), and the body is what `json.dumps` writes."""
    from gyre.proxy import openai_api

    built = [0]

    def counted(call, n, real=openai_api.charge_entries):
        built[0] += n
        real(call, n)

    monkeypatch.setattr(openai_api, "charge_entries", counted)
    proxy, h = make_server([(DeterministicEngine("instant", salt=1), "cell", 0)], ProxyConfig(calls_per_second_per_key=0))
    gaps: list[int] = []

    async def ticker(done: threading.Event) -> None:  # runs once per pass of the proxy's loop
        last = built[0]
        while not done.is_set():
            gaps.append(built[0] - last)
            last = built[0]
            await asyncio.sleep(0)

    done = threading.Event()
    fut = asyncio.run_coroutine_threadsafe(ticker(done), h.loop)
    n = 3000
    raw = httpx.post(h.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {proxy.issue_key('ex-body')}"}, timeout=300,
                     json=dict(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=n, logprobs=True, top_logprobs=TOP))
    done.set()
    fut.result(60)
    assert raw.status_code == 200
    assert max(gaps) <= PER_FRAME * (1 + TOP)  # before: all 63,000 entries in one step (then one json.dumps of ~8 MB)
    body = raw.json()
    assert raw.content == json.dumps(body, ensure_ascii=False).encode()
    entries = body["choices"][0]["logprobs"]["content"]
    ids = proxy.sink.records[-1].output_ids.tolist()
    assert len(entries) == len(ids) == n and [bytes(e["bytes"]) for e in entries] == [TABLE[t] for t in ids]
    assert all(len(e["top_logprobs"]) == TOP for e in entries)
    assert built[0] == n * (1 + TOP)  # every entry charged once, as a stream's


@settings(max_examples=100, deadline=None)
@given(calls(), st.text(), st.sampled_from(["stop", "length"]), st.integers(1, 12))
def test_a_non_streamed_body_in_pieces_is_what_json_dumps_writes(c, content, finish, frame_entries):
    """On random token tables and log-probs (test_openai_api's), with frames small enough that
    a call spans several."""
    from gyre.proxy import pacing
    from gyre.proxy.openai_api import lp_body_parts

    call, charged = c
    call.req.logprobs = True
    p, k = call.proxy, call.req.top_logprobs
    want_entries = reference(p.token_table, p.eos_ids, k, call.tokens)
    choice = {"index": 0, "message": {"role": "assistant", "content": content}, "logprobs": None, "finish_reason": finish}
    body = {"id": "chatcmpl-1", "object": "chat.completion", "choices": [choice], "usage": {"completion_tokens": len(call.tokens)}}
    want = json.dumps({**body, "choices": [{**choice, "logprobs": {"content": want_entries}}]}, ensure_ascii=False)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pacing, "FRAME_ENTRIES", frame_entries)
        parts = list(lp_body_parts(call, body, choice))
        per = frame_tokens(k, True)
    assert "".join(parts) == want
    assert len(parts) <= 2 + -(-len(call.tokens) // per)  # head, a piece a frame, tail
    assert sum(charged) == len(want_entries) * (1 + k)


def test_log_probs_are_charged_to_the_execution(make_server):
    proxy, h = make_server([(DeterministicEngine("e", salt=2), "cell", 0)], ProxyConfig(calls_per_second_per_key=2))
    base = dict(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2000, stream=True)
    plain = openai.OpenAI(base_url=h.url + "/v1", api_key=proxy.issue_key("ex-plain"), max_retries=0)
    heavy = openai.OpenAI(base_url=h.url + "/v1", api_key=proxy.issue_key("ex-heavy"), max_retries=0)
    for client, extra in ((plain, {}), (heavy, {"logprobs": True, "top_logprobs": TOP})):
        assert sum(1 for _ in client.chat.completions.create(**base, **extra)) > 1
    small = dict(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    plain.chat.completions.create(**small)  # 4 units of burst, one spent: the text's frames cost next to nothing
    with pytest.raises(openai.RateLimitError):  # 2000 x 21 entries: ~80 units owed (before: nothing)
        heavy.chat.completions.create(**small)


def test_a_client_that_never_reads_has_its_call_aborted_and_recorded(make_server, caplog):
    caplog.set_level(logging.INFO)
    eng = DeterministicEngine("instant", salt=4)
    proxy, h = make_server([(eng, "cell", 0)], ProxyConfig(calls_per_second_per_key=0, client_stall_s=0.5))
    key = proxy.issue_key("ex-unread")
    body = (b'{"model": "m", "max_tokens": 30000, "stream": true, "logprobs": true, "top_logprobs": 20,'
            b' "messages": [{"role": "user", "content": "hi"}]}')
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", h.port))
    s.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\nContent-Type: application/json\r\n"
              f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    try:  # never read: before, the call stayed in flight (and its stream buffered) for as long as the socket was open
        _wait_for(lambda: proxy.sink.for_execution("ex-unread"), "the unread call's record")
        rec = proxy.sink.for_execution("ex-unread")[0]
        assert rec.finish_reason == "abort"
        assert 0 < len(rec.output_ids) < 30000  # stopped where the client stopped taking it
        _wait_for(lambda: eng.load() == 0, "the engine request freed")
        assert proxy.execution_stats("ex-unread").inflight == 0
        _wait_for(lambda: s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0] != 1, "the connection dropped")
        _wait_for(lambda: any("bytes unsent" in r.getMessage() for r in caplog.records), "the stall's warning")
    finally:
        s.close()
    # one warning line naming the execution, the call and what was left unsent; no traceback (before: aiohttp's
    # "Error handling request" with the ClientStalled traceback)
    told = [r for r in caplog.records if "bytes unsent" in r.getMessage()]
    assert len(told) == 1 and told[0].levelno == logging.WARNING
    unsent = int(re.search(r"(\d+) bytes unsent", told[0].getMessage()).group(1))
    assert f"ex-unread/{rec.call_id}:" in told[0].getMessage() and unsent > 0
    assert [r.getMessage() for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR] == []
    ok = openai.OpenAI(base_url=h.url + "/v1", api_key=key, max_retries=0)  # the execution goes on
    assert ok.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=3).usage.completion_tokens == 3



def test_each_frame_gives_the_loop_several_turns(monkeypatch):
    """Another call's reply is a chain of loop steps (read, route, the engine's answer, write):
    each frame hands the loop over FRAME_TURNS times, so that chain waits behind few frames."""
    async def sent(self, data):  # the transport's part: nothing to wait for
        pass

    monkeypatch.setattr(web.StreamResponse, "write", sent)

    async def main():
        passes = 0

        async def other():
            nonlocal passes
            while True:
                passes += 1
                await asyncio.sleep(0)

        task = asyncio.create_task(other())
        await asyncio.sleep(0)  # started
        before = passes
        await PacedResponse(_call(closing=False)).write(b"frame")
        task.cancel()
        return passes - before

    assert asyncio.run(main()) == FRAME_TURNS >= 8  # before: 1


def _call(closing: bool) -> SimpleNamespace:  # what PacedResponse reads of a Call
    return SimpleNamespace(proxy=SimpleNamespace(config=SimpleNamespace(client_stall_s=0)),
                           state=SimpleNamespace(closed=False, closing=closing))


@pytest.mark.parametrize("closing", [True, False])
def test_a_close_landing_between_frames_is_told_as_an_error_not_a_cut(monkeypatch, closing):
    """The execution's close cancels its calls' tasks; one that lands in a frame's turns (not in
    the engine's stream, where `endings.told` answers it) is the same error the client is told,
    so the adapter writes an error event. Any other cancellation stays a cancellation."""
    async def sent(self, data):
        pass

    monkeypatch.setattr(web.StreamResponse, "write", sent)

    async def main():
        task = asyncio.create_task(PacedResponse(_call(closing)).write(b"frame"))
        await asyncio.sleep(0)
        await asyncio.sleep(0)  # the write is in its turns now
        assert not task.done()
        task.cancel()
        try:
            await task
        except ApiError as e:
            return "error: " + e.message
        except asyncio.CancelledError:
            return "cancelled"
        return "finished"

    out = asyncio.run(main())
    if closing:
        assert out.startswith("error: this execution was closed"), out
    else:
        assert out == "cancelled"
