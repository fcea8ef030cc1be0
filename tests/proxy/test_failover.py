"""An engine server SIGKILLed mid-call: the call continues on a live engine, or waits for the
restarted one, and the client sees a slow call, never an error. Real processes throughout: each
engine server is its own process (tests/proxy/engine_proc.py, a DeterministicEngine whose tokens
are a hash of the context, so a continuation recomputed elsewhere must equal one uninterrupted
generation), the proxy serves HTTP on its own thread, the client is the `openai` SDK.

The first engine hangs after HANG tokens of a call (it never finishes it), so the kill lands while
the call is surely mid-generation with exactly HANG tokens sampled. The engine that continues it
serves policy version 1, the killed one version 0: the record's per-token versions show the split.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import openai
import pytest

from gyre.backends.engines.det_engine import DeterministicEngine
from gyre.backends.engines.engine_http import HttpEngine, serve_engine
from gyre.backends.models.tokenizer import load_tokenizer
from gyre.proxy import ProxyConfig
from gyre.backends.protocols import SamplingParams
from gyre.proxy.admin import AdminClient
from gyre.proxy.router import RouteInfo, Router

from .conftest import reference_tokens

ROOT = Path(__file__).resolve().parents[2]
MAX, HANG, SALT = 60, 5, 1


class _Server:
    """One engine server process."""

    def __init__(self, name: str, *, version: int, hang_after: int = 0) -> None:
        args = [sys.executable, "-m", "tests.proxy.engine_proc", name, "--salt", str(SALT), "--version", str(version),
                "--delay", "0.002", "--hang-after", str(hang_after)]
        self.proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        assert line, f"engine server {name} did not start (rc {self.proc.wait()})"
        d = json.loads(line)
        self.url, self.secret = d["url"], d["secret"]

    def kill(self) -> None:
        self.proc.kill()  # SIGKILL: no goodbye on any connection
        self.proc.wait()


class _Seen(HttpEngine):
    """An HttpEngine that counts the tokens it has handed to the router and the health checks it
    answered (the tests wait on them)."""

    seen = answers = 0

    async def generate(self, request_id, input_ids, sampling):
        async for ev in super().generate(request_id, input_ids, sampling):
            self.seen += 1
            yield ev

    async def health(self):
        h = await super().health()
        self.answers += 1
        return h


def _wait(cond) -> None:
    while not cond():
        time.sleep(0.01)


@pytest.fixture
def servers():
    started: list[_Server] = []

    def start(name, **kw) -> _Server:
        s = _Server(name, **kw)
        started.append(s)
        return s

    yield start
    for s in started:
        s.kill()


def _proxy(make_server, first: _Server, engine_wait_s: float = 600.0, transport: str = "ws"):
    seen = _Seen(first.url, name="cell0", secret=first.secret, transport=transport)
    proxy, h = make_server([(seen, "cell", 0)], config=ProxyConfig(admin_token="adm", engine_wait_s=engine_wait_s))
    proxy.router.failure_cooldown_s = 0.0  # a failed engine is not passed over for its cooldown: only death keeps it out
    return proxy, h, seen, AdminClient(h.url, "adm")


def _call(h, proxy, execution_id: str, stream: bool, during=None) -> dict:
    """One chat call by the SDK; `during()` runs once the proxy has HANG tokens of it (for a streamed
    call: once the client has them). Returns what the client saw."""
    c = openai.OpenAI(base_url=h.url + "/v1", api_key=proxy.issue_key(execution_id), max_retries=0)
    args = dict(model="m", messages=[{"role": "user", "content": "write a lot"}], max_tokens=MAX, logprobs=True)
    if not stream:
        box: dict = {}

        def run():
            try:
                r = c.chat.completions.create(**args)
                box.update(text=r.choices[0].message.content, finish=r.choices[0].finish_reason,
                           lps=[e.logprob for e in r.choices[0].logprobs.content])
            except Exception as e:  # noqa: BLE001 - the test asserts on it
                box["error"] = e

        t = threading.Thread(target=run)
        t.start()
        if during is not None:
            during()
        t.join()
        return box
    out = {"text": "", "lps": [], "finish": None}
    try:
        for ch in c.chat.completions.create(**args, stream=True):
            if not ch.choices:
                continue
            out["text"] += ch.choices[0].delta.content or ""
            if ch.choices[0].logprobs and ch.choices[0].logprobs.content:
                out["lps"] += [e.logprob for e in ch.choices[0].logprobs.content]
            out["finish"] = ch.choices[0].finish_reason or out["finish"]
            if during is not None and len(out["lps"]) >= HANG:
                during, run = None, during
                run()
    except Exception as e:  # noqa: BLE001
        out["error"] = e
    return out


def _check_exact(proxy, execution_id: str, seen: dict, source: str, target: str) -> None:
    """One record: HANG tokens of version 0 from before the death, the rest of version 1 from the
    engine that continued it; tokens and log-probs those of one uninterrupted generation."""
    assert "error" not in seen, seen.get("error")
    (rec,) = proxy.sink.for_execution(execution_id)
    out, prompt = rec.output_ids.tolist(), rec.input_ids.tolist()
    ref = reference_tokens(SALT, prompt, MAX)
    assert out == [e.token_id for e in ref] and rec.finish_reason == "length" and seen["finish"] == "length"
    assert rec.output_logprobs.tolist() == np.asarray([e.logprob for e in ref], dtype=np.float32).tolist()
    assert rec.output_versions.tolist() == [0] * HANG + [1] * (MAX - HANG)
    assert seen["text"] == load_tokenizer().decode(out) and len(seen["lps"]) == MAX
    assert rec.payload_ref["engines"] == [source, target] and rec.payload_ref["reroutes"] == 1
    (rr,) = proxy.router.take_reroutes()
    assert (rr.source, rr.target, rr.mode, rr.tokens_recomputed) == (source, target, "recompute", len(prompt) + HANG)


@pytest.mark.parametrize("stream, transport", [(False, "ws"), (True, "ws"), (False, "http")])
def test_a_killed_engines_call_continues_on_the_other_and_the_dead_one_gets_no_new_calls(make_server, servers, stream, transport):
    """Over "http" the killed engine's call is one streamed POST: its body is cut short."""
    a = servers("cell0", version=0, hang_after=HANG)
    b = servers("cell1", version=1)
    proxy, h, first, admin = _proxy(make_server, a, transport=transport)
    admin.add_engine(b.url, name="cell1", kind="cell", index=1, secret=b.secret)  # the first call goes to cell0 (name order)
    seen = _call(h, proxy, "ex-a", stream, during=lambda: (_wait(lambda: first.seen == HANG), a.kill()))
    _check_exact(proxy, "ex-a", seen, "cell0", "cell1")
    assert admin.router_stats()["engines"]["cell0"]["dead"] is True
    # Later calls go to the live engine only, with no failure cooldown to keep cell0 out: it is dead.
    for i in range(3):
        assert "error" not in _call(h, proxy, f"ex-a{i}", stream)
        (rec,) = proxy.sink.for_execution(f"ex-a{i}")
        assert rec.payload_ref["engines"] == ["cell1"]
    assert proxy.router.engine_failures == 1


@pytest.mark.parametrize("stream", [False, True])
def test_a_call_waits_for_the_restarted_engine_and_completes_on_it(make_server, servers, stream):
    a = servers("cell0", version=0, hang_after=HANG)
    proxy, h, first, admin = _proxy(make_server, a)

    def kill_and_restart():
        _wait(lambda: first.seen == HANG)
        a.kill()
        _wait(lambda: admin.router_stats()["engine_failures"] >= 1)  # the router saw it die; the call now waits
        b = servers("cell0", version=1)  # the restarted rank's engine, at a new URL
        admin.add_engine(b.url, name="cell0", kind="cell", index=0, secret=b.secret)

    seen = _call(h, proxy, "ex-b", stream, during=kill_and_restart)
    _check_exact(proxy, "ex-b", seen, "cell0", "cell0")
    assert proxy.router.engine_failures == 1
    engines = admin.router_stats()["engines"]
    assert list(engines) == ["cell0"] and engines["cell0"]["dead"] is False and engines["cell0"]["index"] == 0


@pytest.mark.parametrize("stream", [False, True])
def test_no_engine_ever_returns_the_call_fails_after_the_wait_recorded_once(make_server, servers, stream):
    a = servers("cell0", version=0, hang_after=HANG)
    wait_s = 0.5
    proxy, h, first, admin = _proxy(make_server, a, engine_wait_s=wait_s)
    box = {}

    def kill():
        _wait(lambda: first.seen == HANG)
        box["t"] = time.monotonic()  # before the kill: the router's wait starts after it
        a.kill()

    seen = _call(h, proxy, "ex-c", stream, during=kill)
    waited = time.monotonic() - box["t"]
    err = seen.get("error")
    assert isinstance(err, openai.APIError) and "no rollout engine" in str(err), err
    if not stream:
        assert isinstance(err, openai.APIStatusError) and err.status_code == 503
    assert waited >= wait_s  # it waited for an engine (a lower bound: no flake under load)
    assert proxy.router.engine_failures == 1  # marked dead once, never retried
    (rec,) = proxy.sink.for_execution("ex-c")  # recorded once, with the tokens it had
    assert rec.finish_reason == "error" and len(rec.output_ids) == HANG
    assert rec.output_ids.tolist() == [e.token_id for e in reference_tokens(SALT, rec.input_ids.tolist(), HANG)]


# ---- in one process: the slot rules ---------------------------------------------------------------


async def _collect(router, key, prompt, n):
    return [ev async for ev in router.generate(key, "ex", prompt, SamplingParams(max_tokens=n), None, frozenset([2]))]


def test_a_restart_keeps_its_kind_and_index_and_retires_the_old_one_even_if_not_known_dead():
    async def main():
        r = Router()
        old = r.add_engine(DeterministicEngine("cell0", salt=SALT), kind="cell", index=0)
        with pytest.raises(ValueError, match=r"kind='cell' index=0; its restart must keep them, got kind='cell' index=1"):
            r.add_engine(DeterministicEngine("cell0", salt=SALT), kind="cell", index=1)
        assert r.slots["cell0"] is old and not old.dead and r.stats()["engine_deaths"] == 0
        new = r.add_engine(DeterministicEngine("cell0", salt=SALT, version=1), kind="cell", index=0)
        assert old.dead and r.slots["cell0"] is new and not new.dead and r.stats()["engine_deaths"] == 1
        return await _collect(r, "k", [4, 5, 6], 8), old, new

    out, old, new = asyncio.run(main())
    assert [e.token_id for e in out] == [e.token_id for e in reference_tokens(SALT, [4, 5, 6], 8)]
    assert [e.version for e in out] == [1] * 8 and old.served == 0 and new.served == 1


def test_a_dropped_connection_to_a_live_engine_marks_it_dead_until_it_answers_a_health_check():
    """The connection closes under a running call (the server lives on): the call continues on B
    exactly; A gets no call while dead, and is routed to again once its health check answers."""
    ha = serve_engine(DeterministicEngine("A", salt=SALT, token_delay=0.002))
    hb = serve_engine(DeterministicEngine("B", salt=SALT))
    try:
        async def main():
            r = Router(health_interval_s=0.01, failure_cooldown_s=0.0)
            a, b = _Seen(ha.url, name="A"), HttpEngine(hb.url, name="B")
            r.add_engine(a, kind="cell", index=0)
            r.add_engine(b, kind="cell", index=1)
            info = RouteInfo()
            call = asyncio.ensure_future(_collect_info(r, info))
            while a.seen < HANG:
                await asyncio.sleep(0.001)
            await a._mux.ws.close()  # from this side: the server is fine
            out = await call
            assert info.engines == ["A", "B"] and r.stats()["engine_deaths"] == 1
            while a.answers == 0 or r.slots["A"].dead and a.answers == 1:  # an answer, and what the watch made of it
                await asyncio.sleep(0.001)
            assert not r.slots["A"].dead and a.answers == 1  # back in rollout at the first answer
            r.slots["B"].inflight["busy"] = r.slots["B"].inflight["busy2"] = object()  # A is the least loaded
            again = RouteInfo()
            await _collect_info(r, again, n=4, ex="ex2")
            assert again.engines == ["A"]
            await a.close()
            await b.close()
            return out

        out = asyncio.run(main())
        assert [e.token_id for e in out] == [e.token_id for e in reference_tokens(SALT, [4, 5, 6], MAX)]
    finally:
        ha.stop()
        hb.stop()


async def _collect_info(r, info, n=MAX, ex="ex"):
    return [ev async for ev in r.generate("k", ex, [4, 5, 6], SamplingParams(max_tokens=n), info, frozenset([2]))]
