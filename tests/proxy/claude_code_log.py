"""A request log of a real Claude Code run through the proxy, small enough to commit.

`recording(log)` patches `gyre.proxy.server.build_app` so a served proxy appends each request
it answers to `log` (path, status, the headers that describe the client, the JSON body).
`pack` stores that log with each body's `system` and `tools` kept once (Claude Code re-sends
them unchanged) and each body's `messages` as the count of leading messages it shares with the
request before plus the rest; `unpack` rebuilds the bodies exactly (tests/fixtures/
claude_code_compaction.json, replayed by tests/proxy/test_claude_code_replay.py).
"""

from __future__ import annotations

import contextlib
import json
from typing import Any

from aiohttp import web

# What a replay sends besides the body: the rest (key, host, length) belongs to one run.
KEPT_HEADERS = ("anthropic-version", "anthropic-beta", "user-agent", "x-app", "x-stainless-helper-method")


@contextlib.contextmanager
def recording(log: list[dict]):
    import gyre.proxy.server as server

    @web.middleware
    async def record(request: web.Request, handler):
        raw = await request.read()  # aiohttp keeps the body: the handler reads it again
        entry = {"path": request.path, "headers": {h: request.headers[h] for h in KEPT_HEADERS if h in request.headers},
                 "body": json.loads(raw) if raw else None}
        try:
            resp = await handler(request)
        except web.HTTPException as e:
            log.append(entry | {"status": e.status})
            raise
        log.append(entry | {"status": resp.status})
        return resp

    original = server.build_app

    def build_app(proxy):
        app = original(proxy)
        app.middlewares.insert(0, record)  # outermost: it sees the status the client got
        return app

    server.build_app = build_app
    try:
        yield log
    finally:
        server.build_app = original


def pack(log: list[dict]) -> dict[str, Any]:
    """The log with shared parts stored once (see the module docstring); `unpack` inverts it."""
    shared: dict[str, Any] = {}
    calls, prev = [], []
    for e in log:
        body = dict(e["body"] or {})
        for k in ("system", "tools"):
            if k in body:
                shared.setdefault(k, body[k])
                if body[k] == shared[k]:
                    body[k] = "$shared"
        msgs = body.pop("messages", [])
        keep = 0
        while keep < min(len(msgs), len(prev)) and msgs[keep] == prev[keep]:
            keep += 1
        calls.append({k: v for k, v in e.items() if k != "body"} | {"body": body, "keep_messages": keep, "messages": msgs[keep:]})
        prev = msgs
    return {"shared": shared, "calls": calls}


def unpack(packed: dict[str, Any]) -> list[dict]:
    out, prev = [], []
    for c in packed["calls"]:
        body = {k: packed["shared"][k] if v == "$shared" else v for k, v in c["body"].items()}
        prev = prev[: c["keep_messages"]] + c["messages"]
        out.append({k: v for k, v in c.items() if k not in ("body", "keep_messages", "messages")} | {"body": body | {"messages": prev}})
    return out
