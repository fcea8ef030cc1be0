"""benchmarks/proxy_floor_bench.py compares Gyre's proxy with benchmarks/null_proxy.py: the null
proxy must answer the load generator's calls through a real engine link and time them where
Gyre's records do, and the summary's medians and differences must be the arms' own."""

import asyncio

import aiohttp

from benchmarks.null_proxy import build_app
from benchmarks.proxy_floor_bench import summarize


def test_the_null_proxy_answers_a_harness_call_through_a_real_engine_and_times_it():
    from gyre.backends.engines.det_engine import DeterministicEngine
    from gyre.backends.engines.engine_http import HttpEngine, serve_engine_async
    from gyre.serving import start_app

    async def main():
        eng = await serve_engine_async(DeterministicEngine("e0", token_delay=0.001))
        rows: list = []
        proxy = await start_app(build_app([HttpEngine(eng.url, name="e0", transport="ws", secret=eng.secret)], rows),
                                "127.0.0.1", 0)
        try:
            async with aiohttp.ClientSession() as s:
                async with s.post(proxy.url + "/admin/keys", json={"execution_id": "x1"}) as r:
                    key = (await r.json())["key"]
                body = {"model": "m", "max_tokens": 7, "messages": [{"role": "user", "content": "hi " * 40}]}
                async with s.post(proxy.url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}) as r:
                    assert r.status == 200, await r.text()
                    data = await r.json()
                async with s.post(proxy.url + "/v1/chat/completions", json=body, headers={"Authorization": "Bearer nope"}) as r:
                    assert r.status == 401
        finally:
            await proxy.astop()
            await eng.astop()
        return data, rows

    data, rows = asyncio.run(main())
    assert data["usage"]["completion_tokens"] == 7 and data["choices"][0]["message"]["role"] == "assistant"
    assert len(rows) == 1 and rows[0][0] == "x1" and rows[0][1] < rows[0][2]  # one call, started before it ended


def test_the_summary_is_each_arms_median_and_their_difference():
    def row(arm, n, p50, p99, cpu):
        return {"proxy_impl": arm, "open_executions": n, "proxy_added_ms_p50": p50, "proxy_added_ms_p99": p99,
                "proxy_cpu_ms_per_call": cpu}

    rows = [row("gyre", 64, 4.0, 6.0, 3.0), row("null", 64, 2.0, 3.0, 1.0), row("gyre", 64, 5.0, 9.0, 2.0),
            row("null", 64, 2.5, 6.0, 1.0), row("gyre", 64, 3.0, 7.0, 2.5), row("null", 64, 1.5, 4.0, 0.5)]
    got = summarize(rows, [64])["64"]
    assert got["gyre"]["p99_median"] == 7.0 and got["null"]["p99_median"] == 4.0
    assert got["gyre"]["p50_median"] == 4.0 and got["null"]["cpu_ms_per_call_median"] == 1.0
    assert got["gyre_minus_null_p99_ms"] == 3.0 and got["gyre_over_null_p99"] == 1.75
    assert got["gyre_over_null_cpu"] == 2.5 and got["null_p99_over_goal_5ms"] is False
