"""Issue 34, items 2-3: no body shape from one execution stalls the others' calls.

The event loop's lag is measured with a 1 ms ticker on the server's own loop: while a heavy body
is read, parsed and refused, the loop must keep ticking (its longest gap bounded relative to the
gap measured on the same machine with only small calls). Work charging and the structural limits
(400s naming the limit, through the official SDKs) are checked exactly.
"""

import asyncio
import gc
import json
import time

import anthropic
import httpx
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gyre.backends.engines.det_engine import DeterministicEngine
from gyre.backends.protocols import free_ids
from gyre.proxy import ProxyConfig


class LoopLag:
    """The longest gap between 1 ms ticks of the server's loop while it runs: `lag` in wall time,
    `cpu` in the loop thread's CPU time (work done on the loop between two ticks: what a call
    blocks it with; unlike `lag`, not inflated when a loaded machine deschedules the thread)."""

    def __init__(self, h):
        self.h = h

    async def _start(self):
        self.max, self.cpu_max, self.done = 0.0, 0.0, False
        self.task = asyncio.ensure_future(self._run())

    async def _run(self):
        loop = asyncio.get_running_loop()
        last, last_cpu = loop.time(), time.thread_time()
        while not self.done:
            await asyncio.sleep(0.001)
            now, cpu = loop.time(), time.thread_time()
            self.max = max(self.max, now - last - 0.001)
            self.cpu_max = max(self.cpu_max, cpu - last_cpu)
            last, last_cpu = now, cpu

    async def _stop(self):
        self.done = True
        await self.task
        return self.max, self.cpu_max

    def __enter__(self):
        # The collector is off while measuring: its pauses here walk the test process's heap
        # (pytest, torch, every earlier test), not a proxy's (test_serving_tunes_the_process_either_way).
        gc.disable()
        self.h.call(self._start())
        return self

    def __exit__(self, *exc):
        try:
            self.lag, self.cpu = self.h.call(self._stop())
        finally:
            gc.enable()


def _post(h, key, path, raw):
    return httpx.post(h.url + path, content=raw, timeout=60,
                      headers={"Authorization": f"Bearer {key}", "x-api-key": key, "content-type": "application/json",
                               "anthropic-version": "2023-06-01"})


@pytest.fixture
def srv(make_server):
    proxy, h = make_server([(DeterministicEngine("e"), "cell", 0)], config=ProxyConfig(calls_per_second_per_key=0))
    return proxy, h, proxy.issue_key("ex-heavy"), proxy.issue_key("ex-victim")


SMALL = json.dumps({"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}).encode()


@pytest.mark.parametrize("shape", ["tiny_messages", "anthropic_blocks", "responses_items"])
def test_heavy_body_does_not_stall_the_loop(srv, shape):
    """~8 MiB of tiny items: before, json.loads + validation held the loop 0.18-0.28 s of CPU per body
    (now ~0.02-0.03 s: reading the body and counting its values)."""
    proxy, h, heavy, victim = srv
    n = 250_000
    path, body = {
        "tiny_messages": ("/v1/chat/completions", {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}] * n}),
        "anthropic_blocks": ("/v1/messages", {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "text", "text": "x"}] * n}]}),
        "responses_items": ("/v1/responses", {"model": "m", "input": [{"role": "user", "content": "x"}] * n}),
    }[shape]
    raw = json.dumps(body).encode()
    _post(h, heavy, path, raw)  # the worker pool starts once (spawn); not what is measured
    with LoopLag(h) as quiet:
        t = time.perf_counter()
        while time.perf_counter() - t < 0.3:
            assert _post(h, victim, "/v1/chat/completions", SMALL).status_code == 200
    with LoopLag(h) as loaded:
        r = _post(h, heavy, path, raw)
    assert loaded.cpu < max(0.08, 4 * quiet.cpu), (loaded.cpu, quiet.cpu, loaded.lag, quiet.lag)
    assert r.status_code == 400 and "proxy.max_body_items" in r.text, r.text


def test_work_charging_debits_json_values(make_server):
    """A body's JSON values cost its execution rate units (1 per body_values_per_call), debited
    after the read: at 10 calls/s (bucket 20) a 30k-value, 60 kB body leaves the bucket at
    20 - 1 - 30 = -11, so the next small call is a 429 asking to wait (1 + 11) / 10 = 1.2 s; other
    executions are untouched."""
    proxy, h = make_server([(DeterministicEngine("e"), "cell", 0)],
                           config=ProxyConfig(calls_per_second_per_key=10, body_values_per_call=1000,
                                                              inline_parse_values=1 << 20))  # no worker start-up time to refill the bucket
    a, b = proxy.issue_key("ex-a"), proxy.issue_key("ex-b")
    body = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], "metadata_pad": [0] * 29_995}
    raw = json.dumps(body).encode()
    assert 30_000 <= raw.count(b",") + raw.count(b"{") + raw.count(b"[") < 31_000  # 30 units (29,997 was 29: passed only when slow)
    t0 = time.monotonic()
    assert _post(h, a, "/v1/chat/completions", raw).status_code == 200
    r = _post(h, a, "/v1/chat/completions", SMALL)
    refilled = (time.monotonic() - t0) * 10  # units the bucket regained while the two calls ran
    assert r.status_code == 429, r.text
    assert 1.2 - refilled / 10 - 0.05 <= float(r.headers["Retry-After"]) <= 1.2 + 0.05, refilled
    assert "proxy.body_values_per_call" in r.json()["error"]["message"]
    assert _post(h, b, "/v1/chat/completions", SMALL).status_code == 200


@pytest.fixture(params=["inline", "worker"])
def limited(request, make_server):
    """Small limits; `worker`: every body goes through the parse worker process."""
    cfg = ProxyConfig(max_tools=8, max_body_items=50, max_json_depth=12, inline_parse_values=1 if request.param == "worker" else 8192)
    proxy, h = make_server([(DeterministicEngine("e"), "cell", 0)], config=cfg)
    return h, proxy.issue_key("ex")


def _schema(depth):
    s = {"type": "string"}
    for i in range(depth):
        s = {"type": "object", "properties": {f"p{i}": s}}
    return s


def test_structural_limits_are_400s_naming_the_limit(limited):
    h, key = limited
    oa = openai.OpenAI(base_url=h.url + "/v1", api_key=key, max_retries=0)
    an = anthropic.Anthropic(base_url=h.url, api_key=key, max_retries=0)
    msgs = [{"role": "user", "content": "hi"}]
    tools = [{"type": "function", "function": {"name": f"t{i}", "parameters": {"type": "object"}}} for i in range(9)]
    with pytest.raises(openai.BadRequestError, match=r"tools: 9 tools; this proxy accepts at most 8 \(proxy.max_tools\)") as e:
        oa.chat.completions.create(model="m", messages=msgs, tools=tools, max_tokens=2)
    assert e.value.body["param"] == "tools"
    deep = [{"type": "function", "function": {"name": "t", "parameters": _schema(8)}}]  # body -> tools -> [0] -> function -> ... > 12
    with pytest.raises(openai.BadRequestError, match=r"tools\[0\]\.function\.parameters.*more than 12 levels.*proxy.max_json_depth"):
        oa.chat.completions.create(model="m", messages=msgs, tools=deep, max_tokens=2)
    blocks = [{"type": "text", "text": "x"}] * 50  # 1 message + 50 blocks = 51 items
    with pytest.raises(anthropic.BadRequestError, match=r"messages: 51 items .* at most 50 \(proxy.max_body_items\)"):
        an.messages.create(model="m", max_tokens=2, messages=[{"role": "user", "content": blocks}])
    with pytest.raises(openai.BadRequestError, match=r"input: 51 items .* at most 50 \(proxy.max_body_items\)"):
        oa.responses.create(model="m", input=[{"role": "user", "content": "x"}] * 51)
    # Within the limits, both paths answer (and validate: a bad field is still named).
    assert oa.chat.completions.create(model="m", messages=msgs, tools=tools[:8], max_tokens=2).choices[0].message is not None
    assert an.messages.create(model="m", max_tokens=2, messages=[{"role": "user", "content": blocks[:49]}]).content is not None
    with pytest.raises(openai.BadRequestError, match=r"messages\[0\]\.role"):
        oa.chat.completions.create(model="m", messages=[{"role": "nobody", "content": "x"}], max_tokens=2)


def test_render_time_is_charged_to_its_execution(make_server):
    """A prompt rendered on the thread pool costs its execution one unit per render_ms_per_unit of
    render time: at 1 us per unit any such render costs more than the bucket (20), so the
    execution's next call waits; another execution is untouched. (Before: the next call passed.)"""
    proxy, h = make_server([(DeterministicEngine("e"), "cell", 0)],
                           config=ProxyConfig(calls_per_second_per_key=10, render_ms_per_unit=0.001, inline_render_chars=100))
    a, b = proxy.issue_key("ex-a"), proxy.issue_key("ex-b")
    big = json.dumps({"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "list the files " * 20}]}).encode()
    assert _post(h, a, "/v1/chat/completions", big).status_code == 200
    r = _post(h, a, "/v1/chat/completions", SMALL)
    assert r.status_code == 429 and float(r.headers["Retry-After"]) > 2.0, r.text
    assert _post(h, b, "/v1/chat/completions", SMALL).status_code == 200


def test_chunked_conversions_equal_the_whole():
    """The 64k-chunked digest and wire bytes are exactly the all-at-once ones (random lengths
    around the chunk size)."""
    import hashlib
    import random

    import numpy as np

    from gyre.backends.engines.engine_mux import _ids_bytes
    from gyre.proxy.render import ids_digest

    rng = random.Random(7)
    for n in (0, 1, 5, 1 << 16, (1 << 16) + 1, 3 * (1 << 16) - 1, 200_003):
        ids = [rng.randrange(1 << 31) for _ in range(n)]
        whole = np.asarray(ids, dtype="<i4").tobytes()
        assert asyncio.run(_ids_bytes(ids)) == whole
        assert ids_digest(ids) == hashlib.blake2b(whole, digest_size=16).digest()
        assert ids_digest(ids, chunk=7) == ids_digest(ids)


def _conversation(chars: int) -> list[dict]:
    """A long conversation: turns of 8,000 characters of the tokenizer's corpus (Python source),
    user and assistant in turn, ending on a user turn (~2.9 characters a token)."""
    from pathlib import Path

    from gyre.backends.models.tokenizer import ASSET_DIR, CORPUS_FILE

    corpus = Path(ASSET_DIR, CORPUS_FILE).read_text()
    msgs = [{"role": "system", "content": "You are a coding agent."}]
    for i in range(-(-chars // 8000) | 1):
        pos = (i * 8000) % max(1, len(corpus) - 8000)
        msgs.append({"role": "user" if i % 2 == 0 else "assistant", "content": f"[{i}] " + corpus[pos : pos + 8000]})
    return msgs


def test_long_prompt_holds_the_loop_only_briefly(make_server):
    """Issue 34, item 3: a ~400k-token prompt, answered through an engine behind the websocket
    transport (as in a run), holds the proxy's event loop at most 2x as long at a time as small
    calls do, or 10 ms: its ids are packed on the render thread, reach the router as a
    `TokenIds` (never ~400k Python ints: building and freeing them was ~25 ms of CPU a call; a
    small prompt too, issue 33: its list cost a conversion per use and the collector's time) and
    go out as int32 frames; the record takes the packed array. With the packing planted out the
    loop is held ~30 ms at a time (the record's conversion)."""
    from gyre.backends.engines.engine_http import HttpEngine, serve_engine
    from gyre.backends.protocols import TokenIds

    eh = serve_engine(DeterministicEngine("far"))
    try:
        proxy, h = make_server([(HttpEngine(eh.url, name="far", transport="ws", secret=eh.secret), "cell", 0)],
                               config=ProxyConfig(calls_per_second_per_key=0, max_context_tokens=1 << 20))
        routed = []  # the type of each prompt the router was handed
        generate = proxy.router.generate

        def spy(key, execution_id, input_ids, *args):
            routed.append(type(input_ids))
            return generate(key, execution_id, input_ids, *args)

        proxy.router.generate = spy
        heavy, victim = proxy.issue_key("ex-long"), proxy.issue_key("ex-small")
        raw = json.dumps({"model": "m", "max_tokens": 4, "messages": _conversation(1_200_000)}).encode()
        assert _post(h, heavy, "/v1/chat/completions", raw).status_code == 200  # tokenized once (cached after)
        with LoopLag(h) as quiet:
            t = time.perf_counter()
            while time.perf_counter() - t < 0.3:
                assert _post(h, victim, "/v1/chat/completions", SMALL).status_code == 200
        with LoopLag(h) as loaded:
            for _ in range(2):
                assert _post(h, heavy, "/v1/chat/completions", raw).status_code == 200
        rec = proxy.sink.for_execution("ex-long")[-1]
        assert len(rec.input_ids) > 300_000 and rec.input_ids.dtype.str == "<i4"
        assert loaded.cpu < max(0.010, 2 * quiet.cpu), (loaded.cpu, quiet.cpu, loaded.lag, quiet.lag)
        assert set(routed) == {TokenIds}, routed  # long and small alike: never a list of Python ints
    finally:
        eh.stop()


def test_token_ids_read_as_the_list_they_pack():
    """A `TokenIds` reads as the ids it packs (length, items, negative indices, slices,
    iteration across its chunks, equality with the list), `int32_ids` hands its packed array
    over as is, a slice is a plain list and `ids + more` (a router continuing a call after a
    reroute) is a TokenIds of the concatenation."""
    import random
    from array import array

    import numpy as np

    from gyre.backends.protocols import TokenIds, int32_ids

    rng = random.Random(11)
    for n in (0, 1, TokenIds.CHUNK - 1, TokenIds.CHUNK, 3 * TokenIds.CHUNK + 5):
        ids = [rng.randrange(1 << 31) for _ in range(n)]
        t = TokenIds.from_array(array("i", ids))
        assert t == ids and list(t) == ids and len(t) == n and t.tolist() == ids and t != ids + [1]
        assert int32_ids(t) is t.packed and t.packed.dtype.str == "<i4"
        if n:
            assert (t[0], t[-1], t[n // 2]) == (ids[0], ids[-1], ids[n // 2]) and type(t[-1]) is int
        assert type(t[1:3]) is list and t[1:3] == ids[1:3] and t[-2:] == ids[-2:]
        more = t + [5, 6]
        assert type(more) is TokenIds and more == ids + [5, 6] and t == ids  # t itself unchanged
        assert int32_ids(ids).tobytes() == np.asarray(ids, dtype="<i4").tobytes()
    with pytest.raises(ValueError, match="int32"):
        TokenIds(np.zeros(3, dtype=np.int64))


def test_free_ids_empties_only_an_unshared_list():
    """`free_ids` (the engine host's, for a received long prompt) empties the ids in chunks
    only when the box held the last reference: ids an engine still holds are left whole."""
    ids = list(range(100_003))
    kept = list(ids)
    assert free_ids([kept], chunk=1000) is False and kept == ids  # `kept` is still a name for it
    box = [kept]
    del kept
    assert free_ids(box, chunk=999) is True and box == []

    sizes = []  # what is left before each step: `chunk` ids at a time

    class Watched(list):
        def __delitem__(self, k):
            sizes.append(len(self))
            super().__delitem__(k)

    assert free_ids([Watched(ids)], chunk=40_000) is True
    assert sizes == [100_003, 60_003, 20_003]


COUNT_WINDOW_TEST = 97  # small windows, so that random bodies span several


@given(st.binary(max_size=3 * COUNT_WINDOW_TEST), st.integers(0, 3 * COUNT_WINDOW_TEST))
@settings(max_examples=30, deadline=None)
def test_value_count_by_windows_counts_every_separator(prefix, pad):
    """Counted window by window (`COUNT_WINDOW` bytes), the separators are exactly those of the whole
    body, wherever the windows cut it."""
    from gyre.proxy import admission

    raw = prefix + b",{[" * (pad // 3)
    old = admission.COUNT_WINDOW
    try:
        admission.COUNT_WINDOW = COUNT_WINDOW_TEST
        assert admission.value_count(raw) == raw.count(b",") + raw.count(b"{") + raw.count(b"[")
    finally:
        admission.COUNT_WINDOW = old


_SERVE = """
import asyncio, gc, sys, time
from gyre.proxy import Proxy, ProxyConfig, serve_proxy, start_proxy

def full():
    t = time.perf_counter()
    gc.collect()
    return time.perf_counter() - t

proxy = Proxy(ProxyConfig(gc_freeze={freeze}, gc_young_objects={young}))
young = gc.get_threshold()[0]
before = min(full() for _ in range(3))
if "{how}" == "serve":
    serve_proxy(proxy)
else:
    asyncio.new_event_loop().run_until_complete(start_proxy(proxy))
after = min(full() for _ in range(3))
print(gc.get_freeze_count(), sys.getswitchinterval(), before, after, young, gc.get_threshold()[0])
"""


@pytest.mark.parametrize("how,freeze,young", [("start", True, 10_000), ("serve", False, 0)])
def test_serving_tunes_the_process_either_way(how, freeze, young):
    """However the proxy is served (`serve_proxy`, or `start_proxy` as the run does), the process's
    GIL switch interval drops to `gil_switch_ms`, the collector's young threshold rises to
    `gc_young_objects` (0: Python's own stays) and, with `gc_freeze`, the objects alive then
    leave the collector's reach: a full collection afterwards walks a small fraction of what it
    did (the imported libraries and the tokenizer were most of it)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _SERVE.format(how=how, freeze=freeze, young=young)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    frozen, interval, before, after, python_young, served_young = out.stdout.split()
    assert float(interval) == pytest.approx(ProxyConfig().gil_switch_ms / 1e3)
    assert int(served_young) == max(young, int(python_young)) and int(python_young) < 10_000, out.stdout
    if freeze:
        assert int(frozen) > 50_000 and float(after) < float(before) / 3, out.stdout
    else:
        assert int(frozen) == 0, out.stdout


def test_the_proxy_and_its_parse_workers_import_no_torch():
    """A body-parsing worker imports the proxy (`gyre.proxy.bodies`); torch cost it ~4 s of CPU
    to start beside other executions' calls. Nothing the proxy serves with needs torch."""
    import subprocess
    import sys

    code = "import sys, gyre.proxy.server, gyre.proxy.bodies; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", (out.stdout, out.stderr[-2000:])
