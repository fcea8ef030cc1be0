"""Admin API, so the proxy can live in its own process and be driven by the scheduler / runner.

Enabled when `ProxyConfig.admin_token` is set; every route needs `Authorization: Bearer <token>`
(execution keys are not admin tokens). JSON in, JSON out:

    POST   /admin/keys                 {"execution_id", "role"?}     -> {"key"}
    DELETE /admin/executions/{id}      close: revoke keys, drop state -> stats
    GET    /admin/executions/{id}      -> stats (calls, spliced/unmatched turns, reroutes, roles)
    POST   /admin/engines              {"url", "name", "kind", "index", "secret"} (an HttpEngine) -> {"ok"}
    DELETE /admin/engines/{name}       drain + remove                -> {"moved"}
    POST   /admin/engines/{name}/drain                                -> {"moved"}
    POST   /admin/engines/{name}/resume                               -> {"ok"}
    POST   /admin/policy_version       {"version"}                    -> {"ok"}
    GET    /admin/router               -> router stats (engines, states, loads, reroutes)

`AdminClient(url, token)` is a small synchronous client (stdlib only) for these routes.
"""

from __future__ import annotations

import dataclasses
import hmac
import json
import logging
import urllib.error
import urllib.request
from typing import Any

from aiohttp import web

from gyre.proxy.core import ApiError, Proxy
from gyre.backends.engines.engine_http import HttpEngine

logger = logging.getLogger(__name__)


def add_admin_routes(app: web.Application, proxy: Proxy, token: str) -> None:
    want = f"Bearer {token}".encode()

    def check(request: web.Request) -> None:
        got = request.headers.get("Authorization", "").encode()
        if not hmac.compare_digest(got, want):
            raise ApiError(401, "authentication", "admin token required")

    async def body(request: web.Request) -> dict:
        try:
            data = await request.json()
        except ValueError as e:
            raise ApiError(400, "invalid_request", f"malformed JSON body: {e}") from None
        if not isinstance(data, dict):
            raise ApiError(400, "invalid_request", "the JSON body must be an object")
        return data

    def field(d: dict, name: str, kind: type, default: Any = ...) -> Any:
        v = d.get(name, default)
        if v is ...:
            raise ApiError(400, "invalid_request", f"{name}: is required", param=name)
        if v is not None and (not isinstance(v, kind) or isinstance(v, bool) and kind is int):
            raise ApiError(400, "invalid_request", f"{name}: must be {kind.__name__}", param=name)
        return v

    def slot_name(request: web.Request) -> str:
        name = request.match_info["name"]
        if name not in proxy.router.slots:
            raise ApiError(404, "not_found", f"no engine named {name!r}")
        return name

    async def issue(request: web.Request) -> web.Response:
        check(request)
        d = await body(request)
        try:
            key = proxy.issue_key(field(d, "execution_id", str), field(d, "role", str, None))
        except ValueError as e:
            raise ApiError(400, "invalid_request", str(e)) from None
        return web.json_response({"key": key})

    async def stats(request: web.Request) -> web.Response:
        check(request)
        return web.json_response(dataclasses.asdict(proxy.execution_stats(request.match_info["eid"])))

    async def close(request: web.Request) -> web.Response:
        check(request)
        return web.json_response(dataclasses.asdict(await proxy.aclose_execution(request.match_info["eid"])))

    async def add_engine(request: web.Request) -> web.Response:
        check(request)
        d = await body(request)
        kind = field(d, "kind", str, "cell")
        try:
            engine = HttpEngine(field(d, "url", str), name=field(d, "name", str), secret=field(d, "secret", str, None))
            proxy.router.add_engine(engine, kind=kind, index=field(d, "index", int, 0))
        except ValueError as e:
            raise ApiError(400, "invalid_request", str(e)) from None
        return web.json_response({"ok": True})

    async def remove_engine(request: web.Request) -> web.Response:
        check(request)
        return web.json_response({"moved": await proxy.router.remove_engine(slot_name(request))})

    async def drain(request: web.Request) -> web.Response:
        check(request)
        return web.json_response({"moved": await proxy.router.drain(slot_name(request))})

    async def resume(request: web.Request) -> web.Response:
        check(request)
        try:
            proxy.router.resume(slot_name(request))
        except RuntimeError as e:
            raise ApiError(409, "invalid_request", str(e)) from None
        return web.json_response({"ok": True})

    async def policy_version(request: web.Request) -> web.Response:
        check(request)
        proxy.policy_version = field(await body(request), "version", int)
        return web.json_response({"ok": True})

    async def router_stats(request: web.Request) -> web.Response:
        check(request)
        return web.json_response(proxy.router.stats())

    app.router.add_post("/admin/keys", issue)
    app.router.add_get("/admin/executions/{eid}", stats)
    app.router.add_delete("/admin/executions/{eid}", close)
    app.router.add_post("/admin/engines", add_engine)
    app.router.add_delete("/admin/engines/{name}", remove_engine)
    app.router.add_post("/admin/engines/{name}/drain", drain)
    app.router.add_post("/admin/engines/{name}/resume", resume)
    app.router.add_post("/admin/policy_version", policy_version)
    app.router.add_get("/admin/router", router_stats)


class AdminError(RuntimeError):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"proxy admin: HTTP {status}: {message}")
        self.status = status


class AdminClient:
    """Synchronous client for the admin routes (stdlib urllib; any thread, no event loop)."""

    def __init__(self, url: str, token: str, timeout: float = 600.0) -> None:
        self.url = url.rstrip("/")
        self.token = token
        self.timeout = timeout

    def _do(self, method: str, path: str, payload: dict | None = None) -> Any:
        data = json.dumps(payload).encode() if payload is not None else None
        req = urllib.request.Request(self.url + path, data=data, method=method, headers={"Authorization": f"Bearer {self.token}", "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise AdminError(e.code, e.read().decode(errors="replace")) from None

    def issue_key(self, execution_id: str, role: str | None = None) -> str:
        return self._do("POST", "/admin/keys", {"execution_id": execution_id, "role": role})["key"]

    def execution_stats(self, execution_id: str) -> dict:
        return self._do("GET", f"/admin/executions/{execution_id}")

    def close_execution(self, execution_id: str) -> dict:
        return self._do("DELETE", f"/admin/executions/{execution_id}")

    def add_engine(self, url: str, name: str, kind: str = "cell", index: int = 0, secret: str | None = None) -> None:
        """`secret`: the engine server's (`serve_engine`'s `handle.secret`)."""
        d = {"url": url, "name": name, "kind": kind, "index": index}
        if secret is not None:
            d["secret"] = secret
        self._do("POST", "/admin/engines", d)

    def remove_engine(self, name: str) -> int:
        return self._do("DELETE", f"/admin/engines/{name}")["moved"]

    def drain(self, name: str) -> int:
        return self._do("POST", f"/admin/engines/{name}/drain")["moved"]

    def resume(self, name: str) -> None:
        self._do("POST", f"/admin/engines/{name}/resume")

    def set_policy_version(self, version: int) -> None:
        self._do("POST", "/admin/policy_version", {"version": version})

    def router_stats(self) -> dict:
        return self._do("GET", "/admin/router")
