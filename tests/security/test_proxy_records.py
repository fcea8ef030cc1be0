"""Issue 20, record integrity: what the TITO record says is what happened.

Findings reproduced: a non-streamed call kept generating after its client left and was recorded
complete; a call in flight at close_execution was appended after the close (descriptor leaked);
a re-issued execution id restarted call ids at 0; an engine stream that ended early without a
finish reason was recorded `stop`; a dead engine took 17 reroutes, no backoff.
"""

import os
import socket
import threading
import time

import httpx
import openai
import pytest

from gyre.backends.engines.det_engine import DeterministicEngine
from gyre.backends.protocols import TokenEvent
from gyre.proxy import ProxyConfig, StoreSink
from gyre.trajectory.store import TitoStore, is_sealed

from tests.proxy.conftest import make_server  # noqa: F401  (fixture)

SMALL = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}


class SpyEngine(DeterministicEngine):
    """Remembers which requests it was asked to abort, and counts the tokens it sent."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.aborted: list[str] = []
        self.sent = 0

    async def generate(self, request_id, input_ids, sampling):
        async for ev in super().generate(request_id, input_ids, sampling):
            self.sent += 1
            yield ev

    async def abort(self, request_id):
        self.aborted.append(request_id)
        return await super().abort(request_id)


class EarlyEndEngine(DeterministicEngine):
    """Ends its stream after 3 tokens, with no finish reason (a crashed or buggy engine)."""

    async def generate(self, request_id, input_ids, sampling):
        for i in range(3):
            yield TokenEvent(token_id=100 + i, logprob=-1.0, version=0)


class DeadEngine(DeterministicEngine):
    async def generate(self, request_id, input_ids, sampling):
        self.generate_calls += 1
        raise ConnectionError("engine process died")
        yield  # pragma: no cover


def _wait(pred, timeout=5.0):
    end = time.time() + timeout
    while time.time() < end:
        if pred():
            return True
        time.sleep(0.02)
    return pred()


def _open(path) -> int:
    """How many of this process's descriptors point at `path` (a count of all descriptors would
    also see sockets and files that other threads open and close meanwhile)."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}") == str(path)
        except OSError:
            pass
    return n


def test_client_disconnect_aborts_a_non_streamed_call(make_server):
    eng = SpyEngine("e", token_delay=0.01)
    proxy, h = make_server([(eng, "cell", 0)])
    k = proxy.issue_key("x")
    body = b'{"model": "m", "max_tokens": 2000, "messages": [{"role": "user", "content": "hi"}]}'
    s = socket.create_connection(("127.0.0.1", h.port))
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + k.encode()
              + b"\r\nContent-Type: application/json\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    # The call is under way (a loaded machine can take longer than any fixed sleep to get there;
    # a client gone before its call starts leaves nothing to record).
    assert _wait(lambda: eng.sent >= 5, 10.0), eng.sent
    s.close()
    assert _wait(lambda: proxy.sink.records, 10.0), "no record"  # the call alone would run 10 s more
    rec = proxy.sink.records[0]
    assert rec.finish_reason == "abort", rec.finish_reason
    assert len(rec.output_ids) < 1000  # stopped long before max_tokens (2000 x 10 ms)
    assert _wait(lambda: eng.aborted, 2.0), "the engine request was not aborted"
    assert proxy.execution_stats("x").aborted_calls == 1


def _stream_in_thread(url, key, out):
    def run():
        c = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)
        try:
            for ch in c.chat.completions.create(**{**SMALL, "max_tokens": 2000}, stream=True):
                out.append(ch)
        except Exception as e:  # the close cuts the stream
            out.append(e)
    t = threading.Thread(target=run)
    t.start()
    return t


@pytest.mark.parametrize("how", ["close", "aclose"])
def test_call_in_flight_at_close_is_not_appended_after_it(make_server, tmp_path, how):
    store = TitoStore(tmp_path)
    proxy, h = make_server([(DeterministicEngine("e", token_delay=0.005), "cell", 0)], sink=StoreSink(store))
    k = proxy.issue_key("ex1")
    assert httpx.post(h.url + "/v1/chat/completions", json=SMALL, headers={"Authorization": f"Bearer {k}"}).status_code == 200
    time.sleep(0.1)
    assert _open(store.path_for("ex1")) == 1  # the execution's file is open now
    chunks: list = []
    t = _stream_in_thread(h.url, k, chunks)
    assert _wait(lambda: len(chunks) > 5), chunks
    if how == "close":
        stats = h.call_fn(proxy.close_execution, "ex1")
    else:
        stats = h.call(proxy.aclose_execution("ex1", wait_s=0.1))
    t.join(10)
    if how == "close":  # the aborted call ends on the server a moment after the client sees its stream end
        assert _wait(lambda: proxy.late_records == 1, 10), proxy.late_records
    path = store.path_for("ex1")
    size = os.path.getsize(path)
    time.sleep(0.3)
    assert os.path.getsize(path) == size  # nothing appended after the close
    recs = store.load("ex1")
    assert stats.calls == len(recs), (stats, len(recs))
    if how == "aclose":  # waited, aborted, recorded, then sealed
        assert [r.finish_reason for r in recs] == ["length", "abort"]
    else:  # aborted at once: not recorded, reported in flight
        assert len(recs) == 1 and stats.inflight == 1
    assert is_sealed(path)
    assert _open(path) == 0  # the file's descriptor closed, none reopened
    assert proxy.late_records == (1 if how == "close" else 0)


def test_reissued_execution_id_is_refused(make_server):
    proxy, h = make_server([(DeterministicEngine("e"), "cell", 0)], ProxyConfig(admin_token="adm"))
    k = proxy.issue_key("again")
    httpx.post(h.url + "/v1/chat/completions", json=SMALL, headers={"Authorization": f"Bearer {k}"})
    h.call_fn(proxy.close_execution, "again")
    with pytest.raises(ValueError, match="closed"):
        proxy.issue_key("again")
    r = httpx.post(h.url + "/admin/keys", json={"execution_id": "again"}, headers={"Authorization": "Bearer adm"})
    assert r.status_code == 400


def test_early_ended_stream_is_not_recorded_as_stop(make_server):
    proxy, h = make_server([(EarlyEndEngine("e"), "cell", 0)])
    k = proxy.issue_key("x")
    r = httpx.post(h.url + "/v1/chat/completions", json={**SMALL, "max_tokens": 50}, headers={"Authorization": f"Bearer {k}"})
    assert r.status_code == 500 and "ended this call early" in r.json()["error"]["message"]  # the client is told too (issue 34)
    rec = proxy.sink.records[0]
    assert len(rec.output_ids) == 3 and rec.finish_reason == "error", rec.finish_reason


def test_dead_engine_bounded_reroutes_with_backoff(make_server):
    dead = DeadEngine("dead")
    proxy, h = make_server([(dead, "cell", 0)], ProxyConfig(max_reroutes=2))
    k = proxy.issue_key("x")
    c = openai.OpenAI(base_url=h.url + "/v1", api_key=k, max_retries=0)
    t0 = time.perf_counter()
    with pytest.raises(openai.APIStatusError) as ei:
        c.chat.completions.create(**SMALL)
    took = time.perf_counter() - t0
    assert ei.value.status_code == 503
    # A connection error is a death (gyre/proxy/failover.py): not retried call by call, only after the
    # engine answers a health check again, and at most max_reroutes times (in a restart every engine dies).
    assert dead.generate_calls <= proxy.router.max_reroutes + 1, dead.generate_calls
    assert took >= 0.05 + 0.1  # not a hot loop
    recs = proxy.sink.records
    assert len(recs) == 1 and recs[0].finish_reason == "error" and len(recs[0].output_ids) == 0
    # with a live engine beside it, the dead one is passed over while it cools down
    live = DeterministicEngine("live")
    h.call_fn(proxy.router.add_engine, live, kind="cell", index=1)
    before = dead.generate_calls
    for _ in range(5):
        assert c.chat.completions.create(**SMALL).choices[0].finish_reason == "length"
    assert dead.generate_calls - before <= 1
    assert len([r for r in proxy.sink.records if not len(r.output_ids)]) == 1  # no more empty records
