"""The plumbing of Gyre's HTTP servers (the proxy, every engine), generic on purpose: an aiohttp
app started in the caller's loop (`start_app`) or on a thread of its own (`run_in_thread`), the
`ServerHandle` to call into it and stop it, and which address of this host a peer reaches.

    handle = run_in_thread(lambda: build_app(...), "127.0.0.1", 0, name="gyre-proxy")
    handle.call(coro, timeout=5)     # run on the server's loop, from another thread
    handle.stop()
    route_address("10.0.0.1")        # this host's address on the interface that routes there
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import threading
from dataclasses import dataclass
from typing import Any

from aiohttp import web


def is_loopback(host: str) -> bool:
    """`host` names this machine's loopback (localhost, 127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def route_address(peer: str) -> str:
    """This host's address on the interface that routes to `peer` (a UDP connect sends nothing)."""
    family, _, _, _, addr = socket.getaddrinfo(peer, 9, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(addr)
        return s.getsockname()[0]


@dataclass
class ServerHandle:
    """A running aiohttp server: bound `host`/`port`, `url`, and `stop()` (sync or `astop()`);
    `secret` for an engine server (what its clients must send)."""

    host: str
    port: int
    runner: web.AppRunner
    loop: asyncio.AbstractEventLoop
    thread: threading.Thread | None = None
    secret: str | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def astop(self) -> None:
        await self.runner.cleanup()

    def stop(self) -> None:
        """Stop the server (and its thread, if it has one). Call from outside its loop."""
        if self.thread is None:
            raise RuntimeError("stop(): server runs in the caller's loop; await handle.astop() instead")
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(timeout=30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=30)

    def call(self, coro, timeout: float | None = None):
        """Run a coroutine on the server's loop from another thread and wait for it."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=timeout)

    def call_fn(self, fn, *args, timeout: float | None = None, **kwargs):
        """Run a plain function on the server's loop thread (e.g. `proxy.close_execution`, which
        must not race with calls being served) and return its result."""

        async def run():
            return fn(*args, **kwargs)

        return self.call(run(), timeout=timeout)


async def start_app(app: web.Application, host: str, port: int) -> ServerHandle:
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    # shutdown_timeout: how long stop() lets in-flight responses finish before closing them.
    site = web.TCPSite(runner, host, port, backlog=4096, reuse_address=True, shutdown_timeout=2.0)
    try:
        await site.start()
    except BaseException:  # the port is taken: what the app's startup began ends here
        await runner.cleanup()
        raise
    bound = runner.addresses[0][1]
    return ServerHandle(host=host, port=bound, runner=runner, loop=asyncio.get_running_loop())


def run_in_thread(make_app, host: str, port: int, name: str = "gyre-http") -> ServerHandle:
    """Start `make_app()` (called inside the new loop) on a background thread; returns the handle."""
    box: dict[str, Any] = {}
    started = threading.Event()

    def main() -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            handle = loop.run_until_complete(start_app(make_app(), host, port))
            box["handle"] = handle
        except BaseException as e:  # surfaced to the caller below
            box["error"] = e
            started.set()
            return
        started.set()
        loop.run_forever()
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()

    thread = threading.Thread(target=main, name=name, daemon=True)
    thread.start()
    started.wait()
    if "error" in box:
        raise box["error"]
    handle: ServerHandle = box["handle"]
    handle.thread = thread
    return handle
