"""The floor under Gyre's proxy on a given machine: an aiohttp server with the proxy's HTTP surface
that does none of its work, for `scale_bench.py --proxy-impl null` (and `proxy_floor_bench.py`).

Per call it reads and parses the JSON body, takes the execution from the bearer key, sends the
engine a prompt of one id per 4 body bytes (about what the proxy's render would send) over the
same websocket transport (`HttpEngine`, `hold_s` as the proxy's `engine_hold_s`), waits for the
last token and answers with an OpenAI-shaped body. No template, tokenizer, router, TITO record,
admission, role rules or collector clock. What a call's latency still holds is what any Python
proxy on this machine pays: the client's and the engine's hops, aiohttp on both sides, and the
event loop's queueing at that load. Each call's (start, end) on the wall clock, taken where the
proxy's record takes them (body parsed, output complete), goes to `<store>/null_times.jsonl`
when the process is terminated, so the benchmark's legs and lost-record count read it as they
read Gyre's TITO records.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

from aiohttp import web

from gyre.backends.protocols import SamplingParams

HOLD_S = 1.0  # ProxyConfig.engine_hold_s's default: the non-streamed calls' frames as Gyre's


def build_app(engines: list, rows: list) -> web.Application:
    keys: dict[str, str] = {}
    serial = [0]

    async def admin_key(request: web.Request) -> web.Response:
        eid = (await request.json())["execution_id"]
        keys[f"k-{eid}"] = eid
        return web.json_response({"key": f"k-{eid}", "execution_id": eid})

    async def admin_close(request: web.Request) -> web.Response:
        eid = request.match_info["eid"]
        keys.pop(f"k-{eid}", None)
        return web.json_response({"execution_id": eid})

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def chat(request: web.Request) -> web.Response:
        body = await request.read()
        req = json.loads(body)
        eid = keys.get(request.headers.get("Authorization", "").removeprefix("Bearer "))
        if eid is None:
            return web.json_response({"error": {"message": "invalid key"}}, status=401)
        start = time.time()
        serial[0] += 1
        engine = engines[hash(eid) % len(engines)]
        sampling = SamplingParams(max_tokens=req.get("max_tokens") or 16, hold_s=HOLD_S)
        n = 0
        async for _ in engine.generate(f"{eid}/{serial[0]}", [0] * max(1, len(body) // 4), sampling):
            n += 1
        rows.append((eid, start, time.time()))
        return web.json_response({"id": f"null-{serial[0]}", "object": "chat.completion", "model": req.get("model"),
                                  "choices": [{"index": 0, "finish_reason": "length",
                                               "message": {"role": "assistant", "content": "ok " * n}}],
                                  "usage": {"prompt_tokens": len(body) // 4, "completion_tokens": n}})

    app = web.Application(client_max_size=64 << 20)
    app.router.add_post("/admin/keys", admin_key)
    app.router.add_delete("/admin/executions/{eid}", admin_close)
    app.router.add_get("/health", health)
    app.router.add_post("/v1/chat/completions", chat)
    return app


def serve(q, endpoints: list[tuple[str, str]], store_dir: str) -> None:
    """The null proxy's process: `endpoints` [(url, secret)] of engine servers; puts its port on `q`."""
    from gyre.backends.engines.engine_http import HttpEngine
    from gyre.serving import start_app

    rows: list = []

    def dump(*_) -> None:
        Path(store_dir, "null_times.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        os._exit(0)

    signal.signal(signal.SIGTERM, dump)

    async def main() -> None:
        engines = [HttpEngine(url, name=f"e{i}", transport="ws", secret=secret) for i, (url, secret) in enumerate(endpoints)]
        handle = await start_app(build_app(engines, rows), "127.0.0.1", 0)
        q.put(handle.port)
        await asyncio.Event().wait()

    asyncio.run(main())


def null_times(store_dir: str) -> dict[str, list[tuple[float, float]]]:
    """{execution: sorted [(start, end)]} of the calls the null proxy answered."""
    out: dict = {}
    p = Path(store_dir, "null_times.jsonl")
    for line in p.read_text().splitlines() if p.exists() else ():
        eid, t0, t1 = json.loads(line)
        out.setdefault(eid, []).append((t0, t1))
    return {k: sorted(v) for k, v in out.items()}
