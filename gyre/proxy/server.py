"""The proxy's aiohttp server: routes, auth, body limits, and errors in each API's own format.

    handle = serve_proxy(proxy)               # background thread + loop; handle.stop()
    handle = await start_proxy(proxy)         # on the caller's loop;     await handle.astop()

`handle.port`, `handle.url` (base, without /v1), `handle.call(coro)` runs a coroutine on the
server's loop (e.g. `handle.call(proxy.router.drain("cell1"))` from a test thread).
Each call is admitted (`Proxy.admit`, gyre/proxy/admission.py: per-execution concurrency and
rate, 429) before its body is read; its body is parsed and validated off the event loop when large
(gyre/proxy/bodies.py); a client that disconnects aborts its call. `GET /health` answers `{"ok": true}` to
anyone; the router's engines and counts only to the admin token or a valid execution key.
Every failure a request can cause is a 4xx in the API's error body (OpenAI for /v1/chat/...,
/v1/completions, /v1/responses, /v1/models; Anthropic for /v1/messages...); an unexpected exception is logged
and answered 500 in the same format, and the server keeps serving.
"""

from __future__ import annotations

import asyncio
import gc
import hmac
import logging
import sys
import threading
from typing import Awaitable, Callable

from aiohttp import web

from gyre.proxy import anthropic_api, openai_api, responses_api
from gyre.proxy import bodies
from gyre.proxy.bodies import read_body
from gyre.proxy.collector import collect_on_a_clock
from gyre.proxy.core import ApiError, Proxy
from gyre.proxy.pacing import ClientStalled
from gyre.serving import ServerHandle, run_in_thread, start_app

logger = logging.getLogger(__name__)


def _is_anthropic(path: str) -> bool:
    return path.startswith("/v1/messages")


def _error_response(path: str, e: ApiError) -> web.Response:
    headers = {"Retry-After": f"{e.retry_after:g}"} if e.retry_after is not None else None
    if _is_anthropic(path):
        return web.json_response(anthropic_api.error_body(e), status=anthropic_api.error_status(e), headers=headers)
    return web.json_response(openai_api.error_body(e), status=e.status, headers=headers)


def _key_of(request: web.Request) -> str | None:
    auth = request.headers.get("Authorization")
    if auth:
        scheme, _, token = auth.partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            return token.strip()
    return request.headers.get("x-api-key") or request.headers.get("api-key")


# A refused request whose unread body is larger than this closes its connection instead of
# letting the server read the rest of the body to keep the connection alive: a client looping on
# huge refused bodies would otherwise cost the event loop every execution shares a full read each.
_DRAIN_LIMIT = 1 << 20


def _refuse(request: web.Request, e: ApiError) -> web.Response:
    if (request.content_length or 0) > _DRAIN_LIMIT and not request.content.is_eof():
        request.protocol.force_close()  # no lingering read of the rest; the client sees a closed connection
    return _error_response(request.path, e)


def _gone() -> web.Response:
    """What a handler whose client has gone returns: aiohttp's attempt to send it fails quietly."""
    resp = web.Response(status=499, reason="Client Closed Request")
    resp.force_close()
    return resp


@web.middleware
async def _errors(request: web.Request, handler):
    try:
        return await handler(request)
    except ApiError as e:
        return _refuse(request, e)
    except web.HTTPRequestEntityTooLarge as e:
        return _error_response(request.path, ApiError(413, "too_large", f"request body too large: {e.text}"))
    except web.HTTPNotFound:
        return _error_response(request.path, ApiError(404, "not_found", f"no route {request.method} {request.path}"))
    except web.HTTPMethodNotAllowed:
        return _error_response(request.path, ApiError(405, "invalid_request", f"method {request.method} not allowed on {request.path}"))
    except web.HTTPException as e:
        return _error_response(request.path, ApiError(e.status, "invalid_request", e.reason or "bad request"))
    except ClientStalled as e:  # one line, not aiohttp's traceback: a client that stops reading is the client's doing
        logger.warning("proxy: %s/%s: the client took none of its answer for %g s (proxy.client_stall_s): %d bytes unsent, "
                       "connection reset", e.execution_id, e.call_id, e.stall_s, e.unsent)
        return _gone()
    except ConnectionResetError as e:
        t = request.transport
        if t is not None and not t.is_closing():  # not the client's connection: as any other error
            raise
        logger.info("proxy: %s %s: the client went away (%s)", request.method, request.path, e)
        return _gone()
    except ConnectionError:
        raise
    except RecursionError:  # JSON nested past Python's limit, in the body or in tool schemas
        return _error_response(request.path, ApiError(400, "invalid_request", "the JSON body is nested too deeply"))
    except Exception as e:
        logger.exception("proxy: unexpected error on %s %s", request.method, request.path)
        return _error_response(request.path, ApiError(500, "internal", f"internal error: {type(e).__name__}"))


def build_app(proxy: Proxy) -> web.Application:
    cap = proxy.config.max_body_bytes

    def model_of(body: dict) -> str:
        m = body.get("model")
        return m if isinstance(m, str) and m else proxy.config.model_name

    def model_call(api: str, respond) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        """A model route: authenticate, admit (before the body is read), read the body, prepare, respond."""
        async def handler(request: web.Request) -> web.StreamResponse:
            key = proxy.authenticate(_key_of(request))
            with proxy.admit(key, request.content_length or 0):
                parsed = await read_body(proxy, request, key, api)
                call = await proxy.aprepare(key, request.headers, parsed.req)
                return await respond(request, call, model_of(parsed.body))
        return handler

    async def responses(request: web.Request) -> web.StreamResponse:
        key = proxy.authenticate(_key_of(request))
        with proxy.admit(key, request.content_length or 0):
            body = (await read_body(proxy, request, key, "responses")).body
            return await responses_api.create(request, proxy, key, body, model_of(body))

    async def get_response(request: web.Request) -> web.Response:
        key = proxy.authenticate(_key_of(request))
        return web.json_response(responses_api.retrieve(proxy, key, request.match_info["response_id"]))

    async def models(request: web.Request) -> web.Response:
        proxy.authenticate(_key_of(request))
        return web.json_response(openai_api.models_body(proxy.config.model_name))

    async def count_tokens(request: web.Request) -> web.Response:
        key = proxy.authenticate(_key_of(request))
        with proxy.admit(key, request.content_length or 0):
            req = (await read_body(proxy, request, key, "count_tokens")).req
            if proxy.text_chars(req) < proxy.config.inline_render_chars:
                return web.json_response({"input_tokens": proxy.count_tokens(key, req)})
            n = await asyncio.get_running_loop().run_in_executor(proxy.pool, proxy.count_tokens, key, req)
            return web.json_response({"input_tokens": n})

    admin_want = f"Bearer {proxy.config.admin_token}".encode() if proxy.config.admin_token else None

    async def health(request: web.Request) -> web.Response:
        # Liveness for anyone; the engine list and counts only for the operator or a harness of
        # this run (an unauthenticated caller learns nothing about the deployment).
        auth = request.headers.get("Authorization", "").encode()
        trusted = (admin_want is not None and hmac.compare_digest(auth, admin_want)) or proxy.keys.lookup(_key_of(request)) is not None
        return web.json_response({"ok": True, **proxy.router.stats()} if trusted else {"ok": True})

    app = web.Application(middlewares=[_errors], client_max_size=cap)
    app.router.add_post("/v1/chat/completions", model_call("chat", openai_api.respond_chat))
    app.router.add_post("/v1/completions", model_call("completions", openai_api.respond_completion))
    app.router.add_post("/v1/responses", responses)
    app.router.add_get("/v1/responses/{response_id}", get_response)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/messages", model_call("messages", anthropic_api.respond))
    app.router.add_post("/v1/messages/count_tokens", count_tokens)
    app.router.add_get("/health", health)
    if proxy.config.admin_token:
        from gyre.proxy.admin import add_admin_routes

        add_admin_routes(app, proxy, proxy.config.admin_token)
    return app


_frozen = False  # gc_freeze done in this process


def _serving(c, app: web.Application) -> web.Application:
    """What serving asks of the process, whichever way it is served: the GIL switch interval
    (`gil_switch_ms`), the collector's young threshold (`gc_young_objects`), its frozen
    objects (`gc_freeze`, once) and its clock (`gc_every_s`, until the app's cleanup)."""
    global _frozen
    if 0 < c.gil_switch_ms / 1e3 < sys.getswitchinterval():
        sys.setswitchinterval(c.gil_switch_ms / 1e3)
    young, *older = gc.get_threshold()
    if c.gc_young_objects > young:
        gc.set_threshold(c.gc_young_objects, *older)
    if c.gc_freeze and not _frozen:
        _frozen = True
        gc.collect()
        gc.freeze()
    clock = []

    async def on_startup(app: web.Application) -> None:
        clock.append(collect_on_a_clock(c.gc_every_s, c.gc_every_objects))

    async def on_cleanup(app: web.Application) -> None:
        while clock:
            clock.pop()()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    return app


async def start_proxy(proxy: Proxy, host: str | None = None, port: int | None = None) -> ServerHandle:
    c = proxy.config
    return await start_app(_serving(c, build_app(proxy)), host or c.host, c.port if port is None else port)


def serve_proxy(proxy: Proxy, host: str | None = None, port: int | None = None) -> ServerHandle:
    """Serve on a background thread with its own event loop. Engines the proxy routes to must be
    usable from that loop (in-process engines are; `HttpEngine` opens its session there)."""
    c = proxy.config
    # A standalone proxy starts its body parsers now (the run's, in a rank, on its first large body).
    threading.Thread(target=bodies.parse_pool(c.parse_processes).warm, name="gyre-parse-warm", daemon=True).start()
    return run_in_thread(lambda: _serving(c, build_app(proxy)), host or c.host, c.port if port is None else port, name="gyre-proxy")
