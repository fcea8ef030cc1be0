"""The controller's side of the execution plane (`gyre.runtime.execution_plane`): attach through
`<run_dir>/execution_plane.json` and use the plane with the surface of the in-process data plane.

    client = await PlaneClient.attach(run_dir, on_event=..., on_error=..., ledger=...)  # a DataPlane
    await client.add_engine(url, name="cell0", kind="cell", index=0, secret=...)

One poll loop reads the plane's events from the client's cursor (by default where the previous
controller stopped: the plane keeps the cursor every poll acknowledges) and delivers each in order:
an execution event to `on_event` (a `finished` one first gives its close stats to `ledger.closed`
and to `totals()`, as `GyreProxyAccess` does), a failed write to `on_error`, reroute records
to `take_reroutes()`; an execution's end completes the future `dispatch_group` (or
`adopt`, for one an earlier controller dispatched) gave for it. What the controller reads
synchronously (router stats, reroutes, sink errors, worst unmatched) is the latest poll's.
Requests that change the plane (dispatches, resumes) go out in the order they were made.

When the plane's process is gone, every call and every pending future raises `PlaneGone`, and
`on_error` hears it once.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import defaultdict
from pathlib import Path
from typing import Any, Awaitable, Callable

import aiohttp

from gyre.executions.runner import EventKind, ExecutionEvent, ExecutionResult
from gyre.executions.tasks import Group
from gyre.proxy.router import RerouteRecord
from gyre.runtime import peers
from gyre.runtime.plane_wire import (PLANE_FILE, PlaneGone, error_from_json, event_from_json, group_to_json,
                                     read_plane_file)

logger = logging.getLogger(__name__)


class PlaneError(RuntimeError):
    """The plane refused a request (4xx): the message names the field."""

    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"execution plane: HTTP {status}: {body}")
        self.status = status


def plane_alive(info: dict[str, Any]) -> bool:
    """The plane named by `info` (its file) still runs (on another host: assumed so)."""
    return not peers.dead([{"rank": 0, "host": info.get("host"), "pid": info["pid"], "start": info.get("start")}])


async def wait_for_plane(run_dir: str | Path, proc: Any) -> dict[str, Any]:
    """The file of the plane `proc` (`spawn_plane`) wrote once serving; RuntimeError with its log's
    tail if it exits first."""
    while True:
        try:
            info = read_plane_file(run_dir)
            if info["pid"] == proc.pid:
                return info
        except (PlaneGone, ValueError):
            pass
        if proc.poll() is not None:
            log = Path(run_dir) / "execution_plane" / "plane.log"
            tail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
            raise RuntimeError(f"the execution plane exited with status {proc.returncode} before serving:\n{tail}")
        await asyncio.sleep(0.05)


def since(now: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    """`now`'s counts less `base`'s: every top-level or nested integer (the per-engine table is a
    description, not counts: as it is now)."""
    out: dict[str, Any] = {}
    for k, v in now.items():
        b = base.get(k)
        if k == "engines" or b is None:
            out[k] = v
        elif isinstance(v, dict) and isinstance(b, dict):
            out[k] = since(v, b)
        elif isinstance(v, int) and not isinstance(v, bool) and isinstance(b, int):
            out[k] = v - b
        else:
            out[k] = v
    return out


class PlaneClient:
    def __init__(self, run_dir: Path, info: dict[str, Any], *, on_event: Callable[[ExecutionEvent], None] | None,
                 on_error: Callable[..., None] | None, ledger: Any, cursor: int, poll_wait_s: float) -> None:
        self.run_dir, self.info = run_dir, info
        self.on_event, self.on_error, self.ledger = on_event, on_error, ledger
        self.cursor, self.poll_wait_s = cursor, poll_wait_s
        self.gone: PlaneGone | None = None
        self._totals: dict[str, int] = defaultdict(int)
        self.state: dict[str, Any] = {}
        self._in_flight: set[str] = set()
        self._futures: dict[str, asyncio.Future] = {}
        self._results: dict[str, ExecutionResult] = {}
        self._closed: dict[str, dict[str, Any]] = {}
        self._base: dict[str, Any] = {}  # close stats by execution (replayed ones before adoption)
        self._reroutes: list[RerouteRecord] = []
        self._unmatched_seen = 0
        self._session = aiohttp.ClientSession(headers={"Authorization": f"Bearer {info['token']}"},
                                              timeout=aiohttp.ClientTimeout(total=None))
        self._sends: asyncio.Queue = asyncio.Queue()
        self._tasks: list[asyncio.Task] = []

    @classmethod
    async def attach(cls, run_dir: str | Path, *, on_event: Callable[[ExecutionEvent], None] | None = None,
                     on_error: Callable[..., None] | None = None, ledger: Any = None, cursor: int | None = None,
                     poll_wait_s: float = 0.5) -> "PlaneClient":
        """Attach to the run's plane; replay from `cursor` (default: the last one a controller
        acknowledged). PlaneGone when there is none or its process has ended."""
        info = read_plane_file(run_dir)
        if not plane_alive(info):
            raise PlaneGone(f"the execution plane of {run_dir} (pid {info['pid']}) has ended")
        client = cls(Path(run_dir), info, on_event=on_event, on_error=on_error, ledger=ledger, cursor=0,
                     poll_wait_s=poll_wait_s)
        try:
            beat = await client._call("POST", "/plane/heartbeat")
            client.cursor = beat["acked"] if cursor is None else cursor
            first = await client._call("GET", "/plane/events", params={"since": client.cursor, "wait": 0})
        except BaseException:
            await client._session.close()
            raise
        client._in_flight = set(first["state"]["in_flight"])
        client._base = first["state"]  # the plane's router counts from earlier attempts: not this one's
        client._take(first)
        loop = asyncio.get_running_loop()
        client._tasks = [loop.create_task(client._poll(), name="plane-poll"),
                         loop.create_task(client._send_loop(), name="plane-send")]
        return client

    # ------------------------------------------------------------------ transport
    async def _call(self, method: str, path: str, base: str | None = None, **kw: Any) -> Any:
        if self.gone is not None:
            raise self.gone
        for attempt in range(50):
            try:
                async with self._session.request(method, (base or self.info["url"]) + path, **kw) as r:
                    text = await r.text()
                    if r.status >= 400:
                        raise PlaneError(r.status, text)
                    return json.loads(text)
            except aiohttp.ClientConnectionError as e:
                if not plane_alive(self.info) or attempt == 49:
                    raise self._lost(PlaneGone(f"the execution plane (pid {self.info['pid']}) is gone: {e}")) from None
                await asyncio.sleep(0.1)

    def _lost(self, e: PlaneGone) -> PlaneGone:
        if self.gone is None:
            self.gone = e
            logger.error("%s", e)
            for fut in self._futures.values():
                if not fut.done():
                    fut.set_exception(e)
            self._in_flight.clear()
            if self.on_error is not None:
                self.on_error(e, "the execution plane", self.run_dir / PLANE_FILE)
        return self.gone

    async def _send_loop(self) -> None:
        while True:
            make, fut = await self._sends.get()
            try:
                result = await make()
            except Exception as e:  # noqa: BLE001 - the caller's future carries it
                if not fut.done():
                    fut.set_exception(e)
            else:
                if not fut.done():
                    fut.set_result(result)

    def _send(self, make: Callable[[], Awaitable[Any]]) -> asyncio.Future:
        fut = asyncio.get_running_loop().create_future()
        self._sends.put_nowait((make, fut))
        return fut

    # ------------------------------------------------------------------ events
    async def _poll(self) -> None:
        while self.gone is None:
            try:
                got = await self._call("GET", "/plane/events", params={"since": self.cursor, "wait": self.poll_wait_s})
            except PlaneGone:
                return
            except PlaneError as e:
                logger.error("execution plane: polling its events failed: %s", e)
                await asyncio.sleep(self.poll_wait_s)
                continue
            self._take(got)

    def _take(self, got: dict[str, Any]) -> None:
        self.state = got["state"]
        for entry in got["events"]:
            if entry["seq"] < self.cursor:
                continue
            self.cursor = entry["seq"] + 1
            try:
                self._deliver(entry)
            except Exception:  # noqa: BLE001 - a broken observer must not stop the events
                logger.exception("delivering execution plane event %s failed", entry.get("seq"))

    def _deliver(self, entry: dict[str, Any]) -> None:
        kind = entry["type"]
        if kind == "execution":
            ev = event_from_json(entry)
            eid = ev.execution_id
            if ev.kind is EventKind.DISPATCHED:
                self._in_flight.add(eid)
                self._future(eid)
            elif ev.kind is EventKind.FINISHED:
                self._in_flight.discard(eid)
                if (closed := entry.get("closed")) is not None:
                    self._closed[eid] = closed  # an adopted execution's, for the ledger once it knows it
                    if self.ledger is not None and self.ledger.knows(eid):
                        self.ledger.closed(eid, closed["calls"], closed["sink_errors"])
                    for k, v in closed["counts"].items():
                        self._totals[k] += v
            elif ev.kind is EventKind.EVALUATED and ev.result is not None:
                self._results[eid] = ev.result
            if self.on_event is not None:
                self.on_event(ev)
        elif kind == "done":
            fut = self._future(entry["execution_id"])
            result = self._results.pop(entry["execution_id"], None)
            if fut.done():
                return
            if entry["cancelled"]:
                fut.cancel()
            elif entry["error"] is not None:
                fut.set_exception(error_from_json(entry["error"]))
            else:
                fut.set_result(result)
        elif kind == "error" and self.on_error is not None:
            self.on_error(error_from_json(entry), entry["what"], None if entry["path"] is None else Path(entry["path"]))
        elif kind == "reroutes":
            self._reroutes.extend(RerouteRecord(**r) for r in entry["records"])

    def _future(self, eid: str) -> asyncio.Future:
        if eid not in self._futures:
            self._futures[eid] = asyncio.get_running_loop().create_future()
        return self._futures[eid]

    # ------------------------------------------------------------------ the controller's surface (proxy_access.DataPlane)
    @property
    def executions_dir(self) -> Path:
        return Path(self.info["executions_dir"])

    def router_stats(self) -> dict:
        """The plane's router stats, its counts since this client attached (an attempt's own, as
        in rank 0's router: run.json adds the attempts up)."""
        return since(self.state.get("router", {}), self._base.get("router", {}))

    def reroutes(self) -> int:
        return self.state.get("reroutes", 0) - self._base.get("reroutes", 0)

    def totals(self) -> dict[str, int]:
        """The counts of the executions this client saw end (this attempt's view; the plane's own: /plane/totals)."""
        return self._totals

    def worst_unmatched(self, n: int = 10) -> list:
        return self.state.get("worst_unmatched", [])[:n]

    def sink_errors(self) -> int:
        return self.state.get("sink_errors", 0) - self._base.get("sink_errors", 0)

    async def close(self) -> None:
        """The run ended: end the plane (its router and proxy with it); after `detach`, nothing."""
        if not self._session.closed:
            await self.close_plane()

    def dispatch_group(self, group: Group) -> list[asyncio.Future]:
        """Send the group (in order with every other change); one future per execution, its
        `ExecutionResult` once the plane says it ended (cancelled, or raising, as its task did)."""
        if self.gone is not None:
            raise self.gone
        body = {"group": group_to_json(group)}  # a callable evaluator raises here, in the caller
        futs = [self._future(s.execution_id) for s in group.executions]
        self._in_flight.update(s.execution_id for s in group.executions)
        sent = self._send(lambda: self._call("POST", "/plane/dispatch", json=body))

        def refused(f: asyncio.Future) -> None:
            if not f.cancelled() and f.exception() is not None:
                for s, fut in zip(group.executions, futs):
                    self._in_flight.discard(s.execution_id)
                    if not fut.done():
                        fut.set_exception(f.exception())

        sent.add_done_callback(refused)
        return futs

    survives = True  # outlives rank 0: a stop for a signal leaves its executions running (`detach`)

    def adopt(self, execution_id: str) -> asyncio.Future:
        """The future of an execution an earlier controller dispatched (done already if its end was
        replayed); its close stats, if they came before, go to the ledger now (it knows it now)."""
        if (closed := self._closed.get(execution_id)) is not None and self.ledger is not None:
            self.ledger.closed(execution_id, closed["calls"], closed["sink_errors"])
        self._in_flight.add(execution_id)
        fut = self._future(execution_id)
        fut.add_done_callback(lambda _f: self._in_flight.discard(execution_id))
        return fut

    def in_flight(self) -> list[str]:
        return sorted(self._in_flight)

    async def shutdown(self, evaluate: bool = True, timeout: float | None = None) -> None:
        """Stop every execution in the plane and wait until their ends are delivered here."""
        got = await self._send(lambda: self._call("POST", "/plane/shutdown", json={"evaluate": evaluate, "timeout": timeout}))
        while self.cursor < got["next"] and self.gone is None:
            await asyncio.sleep(0.01)
        if self.gone is not None:
            raise self.gone

    async def add_engine(self, url: str, *, name: str, kind: str = "cell", index: int = 0, secret: str | None = None) -> None:
        """Put an engine behind the plane's router (re-attach: the same name at its new URL)."""
        body = {"url": url, "name": name, "kind": kind, "index": index, **({"secret": secret} if secret else {})}
        await self._send(lambda: self._call("POST", "/admin/engines", base=self.info["proxy_url"], json=body))

    async def drain(self, name: str) -> int:
        return (await self._send(lambda: self._call("POST", f"/admin/engines/{name}/drain", base=self.info["proxy_url"])))["moved"]

    def resume(self, name: str) -> None:
        self._send(lambda: self._call("POST", f"/admin/engines/{name}/resume", base=self.info["proxy_url"]))

    def take_reroutes(self) -> list[RerouteRecord]:
        out, self._reroutes = self._reroutes, []
        return out

    def take_unmatched(self) -> int:
        total = self._totals["unmatched_turns"]
        new, self._unmatched_seen = total - self._unmatched_seen, total
        return new

    async def detach(self) -> None:
        """Stop polling and close the connection; the plane runs on (until its orphan bound)."""
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._session.close()

    async def close_plane(self) -> None:
        """End the plane (in order: `execution_plane.Plane.stop`) and close the connection."""
        for t in self._tasks:  # no poll sees the plane go and calls it lost
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        try:
            await self._call("POST", "/plane/exit")
        finally:
            await self._session.close()
