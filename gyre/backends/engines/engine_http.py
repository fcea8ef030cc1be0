"""Any in-process `RolloutEngine` over HTTP, and the client that speaks to it.

Engines of other cells live in other processes (docs/design.md §1); the proxy reaches them through
`HttpEngine(url)`, which implements `RolloutEngine`. Wire format (loopback by default):

    POST /generate       {"request_id", "input_ids", "sampling": {...SamplingParams}}
                         -> 200, body streamed line by line: "<token_id> <logprob> <version>
                            [finish_reason] [top=<id>:<lp>,...]\\n" (`engine_mux.event_text`;
                            logprob as Python repr: exact float round trip; top only when asked);
                            a line "error <message>" reports a failure mid-stream.
    POST /abort          {"request_id"} -> {"tokens": [[id, logprob, version, finish_reason(, top)], ...]}
    POST /update_weights?version=V   body: safetensors bytes -> {"ok": true}
    POST /release_memory, /resume, /start -> {"ok": true}
    GET  /health         -> EngineHealth as JSON;  GET /info -> {"name": ...}
    GET  /ws             websocket carrying many generate/abort streams (`engine_mux`)

A client that goes away mid-stream makes the server abort the engine request.

Every route, the websocket upgrade included, needs `Authorization: Bearer <secret>` (401
otherwise, compared in constant time). The secret is per run, drawn by rank 0 and broadcast over
the job's gloo group (`engine_host.share_secret`), never written to torchrun's store, the
environment, argv or a file (docs/security.md). `serve_engine(engine)` draws one when none is
given (`handle.secret`); an `HttpEngine` in the server's process finds it by URL, any other client
must be given it (`python -m gyre.proxy` reads GYRE_ENGINE_SECRET; the admin API takes "secret").
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import secrets
from typing import Any, AsyncIterator, Literal

from aiohttp import ClientPayloadError, ClientSession, ClientTimeout, ServerDisconnectedError, TCPConnector, web

from gyre.backends.engines.engine_mux import MuxClient, parse_events, add_mux_route, event_row, event_text, parse_event, sampling_to_json
from gyre.backends.protocols import EngineHealth, RolloutEngine, SamplingParams, TokenEvent
from gyre.serving import ServerHandle, run_in_thread, start_app

logger = logging.getLogger(__name__)


def _sampling_from_json(d: dict[str, Any]) -> SamplingParams:
    names = {f.name for f in dataclasses.fields(SamplingParams)}
    unknown = set(d) - names
    if unknown:
        raise ValueError(f"sampling: unknown fields {sorted(unknown)}")
    return SamplingParams(**d)


def new_secret() -> str:
    """A fresh engine secret: 256 random bits, URL-safe text."""
    return secrets.token_urlsafe(32)


# url -> secret of the engine servers started in this process: a client in the same process
# finds the secret itself (it could read it from memory anyway); other processes must be given it.
_served_here: dict[str, str] = {}


def _auth(secret: str):
    """Middleware: every route (the websocket upgrade included) needs `Authorization: Bearer <secret>`."""
    want = f"Bearer {secret}".encode()

    @web.middleware
    async def check(request: web.Request, handler):
        got = request.headers.get("Authorization", "").encode("utf-8", "replace")
        if not hmac.compare_digest(got, want):
            return web.json_response({"error": "engine: missing or wrong secret"}, status=401,
                                     headers={"WWW-Authenticate": "Bearer"})
        return await handler(request)

    return check


def _engine_app(engine: RolloutEngine, secret: str) -> web.Application:
    async def generate(request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
            rid = str(body["request_id"])
            input_ids = [int(t) for t in body["input_ids"]]
            sampling = _sampling_from_json(body.get("sampling", {}))
        except (ValueError, KeyError, TypeError) as e:
            return web.json_response({"error": f"bad generate request: {e}"}, status=400)
        resp = web.StreamResponse(headers={"Content-Type": "text/plain; charset=utf-8"})
        await resp.prepare(request)
        # A producer task drains the engine's stream into a buffer; the handler writes whatever
        # has accumulated whenever it wakes, so tokens produced back to back go out in one write.
        buf: list[str] = []
        wake = asyncio.Event()
        box: dict = {"done": False, "error": None}

        async def produce() -> None:
            stream = engine.generate(rid, input_ids, sampling)
            try:
                async for ev in stream:
                    buf.append(event_text(ev) + "\n")
                    wake.set()
            except Exception as e:
                box["error"] = e
            finally:
                box["done"] = True
                wake.set()
                await stream.aclose()

        task = asyncio.create_task(produce())
        finished = False
        try:
            while True:
                await wake.wait()
                wake.clear()
                if buf:
                    data = "".join(buf)
                    buf.clear()
                    await resp.write(data.encode())
                if box["done"] and not buf:
                    break
            if box["error"] is not None:
                e = box["error"]
                logger.warning("engine %s: generate %s failed: %r", engine.name, rid, e)
                await resp.write(f"error {type(e).__name__}: {e}".replace("\n", " ").encode() + b"\n")
            finished = True
        finally:
            if not finished:  # client went away: free the engine
                try:
                    await engine.abort(rid)
                except Exception:
                    pass
                task.cancel()
        await resp.write_eof()
        return resp

    async def abort(request: web.Request) -> web.Response:
        body = await request.json()
        tokens = await engine.abort(str(body["request_id"]))
        return web.json_response({"tokens": [event_row(e) for e in tokens]})

    async def update_weights(request: web.Request) -> web.Response:
        from safetensors.torch import load as st_load

        version = int(request.query["version"])
        state = st_load(await request.read())
        await engine.update_weights(state, version)
        return web.json_response({"ok": True})

    async def migration(request: web.Request) -> web.Response:
        """The KV-migration control messages (`gyre.backends.transfer.migration`): small JSON both ways;
        the KV itself moves over the engines' KV transport, never here. 409: refused."""
        from gyre.backends.transfer.migration import MigrationRefused
        from gyre.backends.protocols import can_migrate

        op = request.match_info["op"]
        if not can_migrate(engine):
            return web.json_response({"error": f"engine {engine.name}: no KV migration"}, status=409)
        try:
            if op == "migration_info":
                return web.json_response(await engine.migration_info())
            body = await request.json()
            if op == "migrate_out":
                events, handle = await engine.migrate_out(str(body["request_id"]))
                return web.json_response({"tokens": [event_row(e) for e in events], "handle": handle})
            if op == "migrate_in":
                return web.json_response({"bytes": await engine.migrate_in(str(body["request_id"]), body["handle"])})
            if op == "migrate_release":
                return web.json_response({"released": await engine.migrate_release(str(body["key"]))})
        except (MigrationRefused, NotImplementedError) as e:
            return web.json_response({"error": f"{type(e).__name__}: {e}"}, status=409)
        except KeyError as e:
            return web.json_response({"error": f"KeyError: {e}"}, status=404)
        except Exception as e:  # a transport failure: the router falls back to recompute
            logger.warning("engine %s: %s failed: %r", engine.name, op, e)
            return web.json_response({"error": f"{type(e).__name__}: {e}"}, status=502)
        return web.json_response({"error": f"unknown migration op {op!r}"}, status=404)

    def simple(method: str):
        async def handler(request: web.Request) -> web.Response:
            await getattr(engine, method)()
            return web.json_response({"ok": True})

        return handler

    async def health(request: web.Request) -> web.Response:
        return web.json_response(dataclasses.asdict(await engine.health()))

    async def info(request: web.Request) -> web.Response:
        return web.json_response({"name": engine.name, "load": engine.load()})

    if not secret:
        raise ValueError("engine server: an empty secret would let anyone in")
    app = web.Application(client_max_size=1 << 34, middlewares=[_auth(secret)])
    add_mux_route(app, engine, _sampling_from_json)
    app.router.add_post("/generate", generate)
    app.router.add_post("/abort", abort)
    app.router.add_post("/update_weights", update_weights)
    for m in ("release_memory", "resume", "start"):
        app.router.add_post(f"/{m}", simple(m))
    for op in ("migrate_out", "migrate_in", "migrate_release"):
        app.router.add_post("/{op:" + op + "}", migration)
    app.router.add_get("/{op:migration_info}", migration)
    app.router.add_get("/health", health)
    app.router.add_get("/info", info)
    return app


async def serve_engine_async(engine: RolloutEngine, host: str = "127.0.0.1", port: int = 0, *,
                             secret: str | None = None) -> ServerHandle:
    """Serve `engine` on the running loop (stop with `await handle.astop()`); a secret is drawn
    when none is given (`handle.secret`)."""
    secret = secret or new_secret()
    handle = await start_app(_engine_app(engine, secret), host, port)
    return _register(handle, secret)


def serve_engine(engine: RolloutEngine, host: str = "127.0.0.1", port: int = 0, *, secret: str | None = None) -> ServerHandle:
    """Serve `engine` over HTTP from a background thread with its own loop; `handle.stop()` ends it.

    The engine's coroutines then run on that thread's loop (use `handle.call(coro)` to reach it).
    Clients must send `secret` (drawn when none is given; `handle.secret`).
    """
    secret = secret or new_secret()
    handle = run_in_thread(lambda: _engine_app(engine, secret), host, port, name=f"gyre-engine-{engine.name}")
    return _register(handle, secret)


def _register(handle: ServerHandle, secret: str) -> ServerHandle:
    handle.secret = secret
    _served_here[handle.url] = secret
    return handle


class HttpEngine:
    """`RolloutEngine` client for an engine served by `serve_engine` (one aiohttp session per loop).

    transport="ws" (default): generate/abort multiplexed over one websocket (`engine_mux`);
    transport="http": one streamed POST /generate per call. Other methods are plain HTTP.
    `secret`: the server's (see the module docstring); by default that of a server at `url` in
    this process, if any - otherwise every call gets 401.
    """

    def __init__(self, url: str, name: str | None = None, *, secret: str | None = None, connect_timeout: float = 10.0,
                 transport: Literal["ws", "http"] = "ws") -> None:
        if transport not in ("ws", "http"):
            raise ValueError(f"HttpEngine: transport must be 'ws' or 'http', got {transport!r}")
        self.url = url.rstrip("/")
        self.name = name or self.url
        secret = secret or _served_here.get(self.url)
        self._headers = {"Authorization": f"Bearer {secret}"} if secret else {}
        self.transport = transport
        self._session: ClientSession | None = None
        self._session_loop: asyncio.AbstractEventLoop | None = None
        self._mux: MuxClient | None = None
        self._mux_loop: asyncio.AbstractEventLoop | None = None
        self._mux_lock: asyncio.Lock | None = None
        self._inflight = 0
        self._timeout = ClientTimeout(total=None, sock_connect=connect_timeout)

    async def _get_mux(self) -> MuxClient:
        loop = asyncio.get_running_loop()
        if self._mux is not None and not self._mux.closed and self._mux_loop is loop:
            return self._mux
        if self._mux_lock is None or self._mux_loop is not loop:
            self._mux_lock = asyncio.Lock()
            self._mux_loop = loop
            self._mux = None
        async with self._mux_lock:
            if self._mux is None or self._mux.closed:
                # heartbeat: a silent peer (host gone, network cut) is noticed within ~90 s and
                # its calls rerouted; generous so a busy engine loop is not mistaken for a dead one.
                ws = await self._sess().ws_connect(self.url + "/ws", max_msg_size=0, autoping=True, heartbeat=60.0)
                self._mux = MuxClient(ws, self.name)
            return self._mux

    def _sess(self) -> ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is None or self._session_loop is not loop or self._session.closed:
            self._session = ClientSession(connector=TCPConnector(limit=0, force_close=False), timeout=self._timeout,
                                          headers=self._headers)
            self._session_loop = loop
        return self._session

    async def close(self) -> None:
        if self._mux is not None and not self._mux.closed:
            await self._mux.close()
        if self._session is not None and not self._session.closed:
            await self._session.close()

    async def start(self) -> None:
        async with self._sess().post(self.url + "/start") as r:
            r.raise_for_status()
        if self.name == self.url:
            async with self._sess().get(self.url + "/info") as r:
                self.name = (await r.json())["name"]

    async def generate(self, request_id: str, input_ids: list[int], sampling: SamplingParams) -> AsyncIterator[TokenEvent]:
        self._inflight += 1
        try:
            if self.transport == "ws":
                stream = (await self._get_mux()).generate(request_id, input_ids, sampling)
                try:
                    async for ev in stream:
                        yield ev
                finally:
                    await stream.aclose()
                return
            payload = {"request_id": request_id, "input_ids": list(input_ids), "sampling": sampling_to_json(sampling)}
            try:
                async with self._sess().post(self.url + "/generate", data=json.dumps(payload), headers={"Content-Type": "application/json"}) as resp:
                    if resp.status != 200:
                        raise RuntimeError(f"engine {self.name}: generate -> HTTP {resp.status}: {await resp.text()}")
                    pending = b""
                    async for chunk in resp.content.iter_any():
                        pending += chunk
                        *lines, pending = pending.split(b"\n")
                        for line in lines:
                            if line.startswith(b"error "):
                                msg = line[6:].decode(errors="replace").strip()
                                raise (ValueError if msg.startswith("ValueError:") else RuntimeError)(f"engine {self.name}: {msg}")
                            yield parse_event(line.decode().split())
            except (ClientPayloadError, ServerDisconnectedError) as e:  # a connection or body cut short: the server died
                raise ConnectionError(f"engine {self.name}: {e!r}") from e
        finally:
            self._inflight -= 1

    async def abort(self, request_id: str) -> list[TokenEvent]:
        if self.transport == "ws":
            return await (await self._get_mux()).abort(request_id)
        async with self._sess().post(self.url + "/abort", json={"request_id": request_id}) as r:
            r.raise_for_status()
            data = await r.json()
        return parse_events(data["tokens"])

    async def update_weights(self, state_dict, version: int) -> None:
        from safetensors.torch import save as st_save

        body = st_save({k: v.contiguous() for k, v in state_dict.items()})
        async with self._sess().post(self.url + "/update_weights", params={"version": str(version)}, data=body) as r:
            r.raise_for_status()

    async def _post(self, path: str) -> None:
        async with self._sess().post(self.url + path) as r:
            if r.status != 200:
                raise RuntimeError(f"engine {self.name}: {path} -> HTTP {r.status}: {await r.text()}")

    async def release_memory(self) -> None:
        await self._post("/release_memory")

    async def resume(self) -> None:
        await self._post("/resume")

    # KV migration (optional `MigratableEngine`): the served engine decides; 409 is its refusal.
    supports_migration = True

    async def _migration(self, op: str, body: dict | None = None) -> dict:
        from gyre.backends.transfer.migration import MigrationRefused

        call = self._sess().get(self.url + "/" + op) if body is None else self._sess().post(self.url + "/" + op, json=body)
        async with call as r:
            data = await r.json(content_type=None)
            if r.status == 409:
                raise MigrationRefused(f"engine {self.name}: {data.get('error')}")
            if r.status == 404:
                raise KeyError(f"engine {self.name}: {data.get('error')}")
            if r.status != 200:
                raise RuntimeError(f"engine {self.name}: {op} -> HTTP {r.status}: {data.get('error')}")
            return data

    async def migration_info(self) -> dict:
        return await self._migration("migration_info")

    async def migrate_out(self, request_id: str) -> tuple[list[TokenEvent], dict | None]:
        data = await self._migration("migrate_out", {"request_id": request_id})
        return parse_events(data["tokens"]), data["handle"]

    async def migrate_in(self, request_id: str, handle: dict) -> int:
        return int((await self._migration("migrate_in", {"request_id": request_id, "handle": handle}))["bytes"])

    async def migrate_release(self, key: str) -> bool:
        return bool((await self._migration("migrate_release", {"key": key}))["released"])

    async def health(self) -> EngineHealth:
        async with self._sess().get(self.url + "/health") as r:
            r.raise_for_status()
            return EngineHealth(**await r.json())

    def load(self) -> int:
        return self._inflight
