"""The execution plane's own routes, beside the proxy's admin API (`gyre.proxy.admin`, which keeps
engines, keys and the policy version). Every route needs `Authorization: Bearer <admin token>`;
every call is a controller's sign of life (the plane's orphan bound). JSON in, JSON out; a bad
request is a 4xx `{"error", "field"}` naming the field.

    POST /plane/dispatch        {"group"} (`plane_wire.group_to_json`)      -> {"execution_ids"}
    GET  /plane/events          ?since=SEQ&wait=S: events from SEQ (acks those before it), waiting
                                up to S seconds for one   -> {"events", "next", "acked", "state"}
    GET  /plane/in_flight       -> {"in_flight"}
    POST /plane/shutdown        {"evaluate"?, "timeout"?}: stop every execution, wait -> {"next"}
    POST /plane/exit            stop the plane in order (after answering)    -> {"ok"}
    POST /plane/heartbeat       -> {"pid", "next", "acked"}
    GET  /plane/closed/{id}     a closed execution's stats (calls, sink_errors, counts)
    GET  /plane/totals          the plane's summed close counts
    GET  /plane/worst_unmatched ?n=N
"""

from __future__ import annotations

import hmac
import time
from typing import Any

from aiohttp import web

from gyre.runtime.plane_wire import group_from_json


class BadRequest(Exception):
    def __init__(self, status: int, field: str | None, message: str) -> None:
        super().__init__(message)
        self.status, self.field = status, field


def _number(request: web.Request, name: str, kind: type, default: Any) -> Any:
    raw = request.query.get(name)
    if raw is None:
        return default
    try:
        v = kind(raw)
    except ValueError:
        raise BadRequest(400, name, f"{name}: must be {kind.__name__}, got {raw!r}") from None
    if v < 0:
        raise BadRequest(400, name, f"{name}: must be >= 0, got {raw!r}")
    return v


async def _body(request: web.Request) -> dict:
    if not request.can_read_body:
        return {}
    try:
        data = await request.json()
    except ValueError as e:
        raise BadRequest(400, None, f"malformed JSON body: {e}") from None
    if not isinstance(data, dict):
        raise BadRequest(400, None, "the JSON body must be an object")
    return data


def control_app(plane: Any) -> web.Application:
    want = f"Bearer {plane.token}".encode()

    @web.middleware
    async def guard(request: web.Request, handler):
        if not hmac.compare_digest(request.headers.get("Authorization", "").encode(), want):
            return web.json_response({"error": "admin token required", "field": None}, status=401)
        plane.active += 1
        plane.last_seen = time.monotonic()
        try:
            return await handler(request)
        except BadRequest as e:
            return web.json_response({"error": str(e), "field": e.field}, status=e.status)
        finally:
            plane.active -= 1
            plane.last_seen = time.monotonic()

    async def dispatch(request: web.Request) -> web.Response:
        d = await _body(request)
        try:
            group = group_from_json(d.get("group"))
        except ValueError as e:
            msg = str(e)
            raise BadRequest(400, msg.split(":", 1)[0], msg) from None
        try:
            return web.json_response({"execution_ids": plane.dispatch(group)})
        except KeyError as e:
            raise BadRequest(409, "group.executions", str(e.args[0])) from None
        except RuntimeError as e:
            raise BadRequest(409, None, str(e)) from None

    async def events(request: web.Request) -> web.Response:
        since = _number(request, "since", int, plane.acked)
        wait = min(_number(request, "wait", float, 0.0), 30.0)
        plane.ack(since)
        plane.take_reroutes()
        if wait > 0 and since >= plane.next_seq and not plane.stopping:
            await plane.wait_new(wait)
            plane.take_reroutes()
        out = plane.since(since)
        return web.json_response({"events": out, "next": out[-1]["seq"] + 1 if out else since, "acked": plane.acked,
                                  "state": plane.state()})

    async def in_flight(request: web.Request) -> web.Response:
        return web.json_response({"in_flight": plane.runner.in_flight()})

    async def shutdown(request: web.Request) -> web.Response:
        d = await _body(request)
        evaluate, timeout = d.get("evaluate", True), d.get("timeout")
        if not isinstance(evaluate, bool):
            raise BadRequest(400, "evaluate", "evaluate: must be a boolean")
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout < 0):
            raise BadRequest(400, "timeout", "timeout: must be a number >= 0 or null")
        await plane.runner.shutdown(evaluate=evaluate, timeout=timeout)
        return web.json_response({"next": plane.next_seq})

    async def exit_(request: web.Request) -> web.Response:
        plane.loop.create_task(plane.stop("the controller closed it"))
        return web.json_response({"ok": True})

    async def heartbeat(request: web.Request) -> web.Response:
        return web.json_response({"pid": plane.state()["pid"], "next": plane.next_seq, "acked": plane.acked})

    async def closed(request: web.Request) -> web.Response:
        eid = request.match_info["eid"]
        st = plane.access.closed.get(eid)
        if st is None:
            raise BadRequest(404, "execution_id", f"execution_id: {eid!r} was not closed in this plane")
        return web.json_response({"calls": st.calls, "sink_errors": st.sink_errors, "counts": st.counts()})

    async def totals(request: web.Request) -> web.Response:
        return web.json_response(dict(plane.access.totals))

    async def worst(request: web.Request) -> web.Response:
        return web.json_response(plane.proxy.worst_unmatched(_number(request, "n", int, 10)))

    app = web.Application(middlewares=[guard])
    app.router.add_post("/plane/dispatch", dispatch)
    app.router.add_get("/plane/events", events)
    app.router.add_get("/plane/in_flight", in_flight)
    app.router.add_post("/plane/shutdown", shutdown)
    app.router.add_post("/plane/exit", exit_)
    app.router.add_post("/plane/heartbeat", heartbeat)
    app.router.add_get("/plane/closed/{eid}", closed)
    app.router.add_get("/plane/totals", totals)
    app.router.add_get("/plane/worst_unmatched", worst)
    return app
