"""Issue 20, fair sharing: one execution's huge or numerous calls never stall another's.

Against a real proxy server (port 0, deterministic engine). Findings reproduced: an 8 MB prompt was
decoded and tokenized on the event loop (30.9 s to refuse, other executions waited 11.8 s); no
per-key limits; deeply nested JSON gave a 500; /health listed the engines to anyone.
"""

import threading
import time

import httpx
import openai

from gyre.backends.engines.det_engine import DeterministicEngine
from gyre.proxy import ProxyConfig

from tests.proxy.conftest import make_server  # noqa: F401  (fixture)

SMALL = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}


def _post(url, key, body, timeout=60):
    return httpx.post(url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=timeout)


def _small_latencies(url, key, stop: threading.Event, out: list):
    while not stop.is_set():
        t = time.perf_counter()
        r = _post(url, key, SMALL)
        out.append((time.perf_counter() - t, r.status_code))
        time.sleep(0.01)


def _while_another_calls(url, key, call):
    """Run `call()` while another execution (`key`) makes small calls in a loop: (its result, its
    seconds, the other's (latency, status) list)."""
    lat: list = []
    stop = threading.Event()
    t = threading.Thread(target=_small_latencies, args=(url, key, stop, lat))
    t.start()
    try:
        time.sleep(0.2)
        t0 = time.perf_counter()
        r = call()
        return r, time.perf_counter() - t0, lat
    finally:
        stop.set()
        t.join()


def test_huge_prompt_refused_at_once_while_others_are_served(make_server):
    proxy, h = make_server([(DeterministicEngine("e"), "cell", 0)], ProxyConfig(calls_per_second_per_key=0))
    ka, kb = proxy.issue_key("hostile"), proxy.issue_key("victim")
    big = {**SMALL, "messages": [{"role": "user", "content": "word " * ((8 << 20) // 5)}]}  # 8 MB of text
    r, refused_s, lat = _while_another_calls(h.url, kb, lambda: _post(h.url, ka, big))
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text[:300]
    assert refused_s < 1.0, refused_s
    assert lat and all(s == 200 for _, s in lat)
    assert max(x for x, _ in lat) < 0.5, lat


def test_tokenizing_runs_off_the_event_loop(make_server):
    """A prompt under the text bound but over the context is tokenized (slow) on the render pool:
    another execution's small calls keep completing meanwhile."""
    proxy, h = make_server([(DeterministicEngine("e"), "cell", 0)], ProxyConfig(calls_per_second_per_key=0))
    ka, kb = proxy.issue_key("hostile"), proxy.issue_key("victim")
    n_chars = proxy.config.max_context_tokens * proxy.renderer.max_token_chars - 1000
    text = "".join(f"{i:x} " for i in range(n_chars // 6))[:n_chars]
    r, slow_s, lat = _while_another_calls(h.url, kb, lambda: _post(h.url, ka, {**SMALL, "messages": [{"role": "user", "content": text}]}))
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    during = [x for x, _ in lat]
    assert len(during) >= 3, (slow_s, during)  # the victim kept being served while A was tokenized
    assert max(during) < max(0.5, slow_s / 3), (slow_s, during)


def test_per_key_concurrency_and_rate_limits(make_server):
    cfg = ProxyConfig(max_calls_per_key=2, calls_per_second_per_key=0)
    proxy, h = make_server([(DeterministicEngine("e", token_delay=0.02), "cell", 0)], cfg)
    ka, kb = proxy.issue_key("a"), proxy.issue_key("b")
    ca = openai.OpenAI(base_url=h.url + "/v1", api_key=ka, max_retries=0)
    streams = [ca.chat.completions.create(**{**SMALL, "max_tokens": 100}, stream=True) for _ in range(2)]
    try:
        r = _post(h.url, ka, SMALL)
        assert r.status_code == 429 and r.headers.get("Retry-After"), r.text
        assert r.json()["error"]["code"] == "rate_limit_exceeded"
        assert _post(h.url, kb, SMALL).status_code == 200  # another execution is not affected
        r = httpx.post(h.url + "/v1/messages", json={**SMALL}, headers={"x-api-key": ka})
        assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"
    finally:
        for s in streams:
            s.close()
    # the rate: a burst of 2 x rate passes, then 429 until the bucket refills. 0.5 a second (a burst
    # of 1, one more every 2 s) and 8 calls at once: a loaded machine only gives the bucket more
    # time, so the bound counts the time the calls took instead of assuming they were quick.
    from concurrent.futures import ThreadPoolExecutor

    proxy.config.max_calls_per_key, proxy.config.calls_per_second_per_key = 0, 0.5
    kc = proxy.issue_key("c")
    t0 = time.monotonic()
    with ThreadPoolExecutor(8) as pool:
        codes = list(pool.map(lambda _: _post(h.url, kc, SMALL).status_code, range(8)))
    elapsed = time.monotonic() - t0
    assert set(codes) <= {200, 429} and 1 <= codes.count(200) <= 1 + 0.5 * elapsed, (codes, elapsed)
    assert 429 in codes, (codes, elapsed)
    time.sleep(2.1)  # one more call's worth refilled, whatever the load
    assert _post(h.url, kc, SMALL).status_code == 200


def test_deeply_nested_json_is_a_400(make_server):
    proxy, h = make_server([(DeterministicEngine("e"), "cell", 0)])
    k = proxy.issue_key("a")
    deep = "[" * 10000 + "]" * 10000
    for path, hdr in (("/v1/chat/completions", "Authorization"), ("/v1/messages", "x-api-key")):
        raw = ('{"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "x": ' + deep + "}").encode()
        r = httpx.post(h.url + path, content=raw, headers={hdr: f"Bearer {k}" if hdr == "Authorization" else k, "Content-Type": "application/json"})
        assert r.status_code == 400, (path, r.status_code, r.text[:200])
    # nested inside a tool schema (parses, then recurses while rendering)
    schema = '{"a": ' * 900 + "{}" + "}" * 900
    raw = '{"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {"name": "t", "parameters": ' + schema + "}}]}"
    r = httpx.post(h.url + "/v1/chat/completions", content=raw.encode(), headers={"Authorization": f"Bearer {k}", "Content-Type": "application/json"})
    assert r.status_code in (200, 400), r.text[:200]
    assert _post(h.url, k, SMALL).status_code == 200  # still serving


def test_health_without_auth_says_only_ok(make_server):
    proxy, h = make_server([(DeterministicEngine("secret-engine"), "cell", 0)], ProxyConfig(admin_token="adm"))
    r = httpx.get(h.url + "/health")
    assert r.status_code == 200 and r.json() == {"ok": True}
    assert "secret-engine" not in httpx.get(h.url + "/health", headers={"Authorization": "Bearer wrong"}).text
    k = proxy.issue_key("a")
    assert "secret-engine" in httpx.get(h.url + "/health", headers={"Authorization": f"Bearer {k}"}).json()["engines"]
    assert "secret-engine" in httpx.get(h.url + "/health", headers={"Authorization": "Bearer adm"}).json()["engines"]


def test_a_call_costs_one_more_rate_unit_per_body_bytes_per_call():
    """Admission charges 1 + ⌊bytes / body_bytes_per_call⌋ units of the execution's bucket (2 × rate),
    capped at the bucket, so huge bodies are slowed per execution and never starve the others."""
    import asyncio

    import pytest

    from gyre.proxy import Proxy
    from gyre.proxy.core import ApiError

    proxy = Proxy(ProxyConfig(calls_per_second_per_key=1.0, max_calls_per_key=0, body_bytes_per_call=1000))
    a, b = (proxy.keys.lookup(proxy.issue_key(e)) for e in ("a", "b"))

    async def admit(key, nbytes):
        with proxy.admit(key, nbytes):
            pass

    asyncio.run(admit(a, 999))  # 1 unit of 2
    with pytest.raises(ApiError) as e:
        asyncio.run(admit(a, 1000))  # 2 units, 1 left
    assert e.value.status == 429 and e.value.retry_after >= 1.0
    asyncio.run(admit(b, 10**9))  # another execution: its own bucket; a body past the bucket costs the whole bucket
    with pytest.raises(ApiError):
        asyncio.run(admit(b, 0))
    proxy.executions["b"].allowance.bucket_t -= 2.0  # two seconds later the bucket is full again
    asyncio.run(admit(b, 10**9))
