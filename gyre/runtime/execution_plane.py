"""The execution plane as a process of its own: the proxy over the run's TITO store, the harness
runner and the runner's proxy access, outliving the rank 0 that started it (docs/design.md §1,
"What lives where").

    python -m gyre.runtime.execution_plane --run-dir RUN [--orphan-s S --proxy.* --executions.*]
    proc = spawn_plane(PlaneConfig(...))          # rank 0: its own session, out of torchrun's killpg

The plane is the parent of every harness (their PR_SET_PDEATHSIG is its death, not a rank's). It
writes `<run_dir>/execution_plane.json` (`gyre.runtime.plane_wire`: pid, URLs, the admin token;
0600) once serving; the next attempt's rank 0 attaches through it (`gyre.runtime.plane_client`).
Engines come and go through the proxy's admin API (`gyre.proxy.admin`, same token). Its own
routes (`gyre.runtime.plane_routes`) dispatch groups, serve the runner's events from a cursor
(kept in memory and appended to `execution_plane/events.jsonl`) and stop the executions.

It ends in one order (stop the harnesses with their grace, unevaluated; close the router, the
proxy and the TITO files; remove its file; log why; exit 0) on `POST /plane/exit`, on SIGTERM or
SIGINT, or when no controller has called for `orphan_s` (a job that never comes back).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gyre.executions.config import ExecutionsConfig
from gyre.executions.procs import alive
from gyre.executions.runner import EventKind, ExecutionEvent
from gyre.executions.tasks import Group
from gyre.proxy.config import ProxyConfig
from gyre.runtime import peers
from gyre.runtime.plane_wire import PLANE_DIR, PLANE_FILE, error_to_json, event_to_json, reroute_to_json, write_private
from gyre.runtime.proxy_access import GyreProxyAccess, serve_data_plane

logger = logging.getLogger(__name__)

TOKEN_ENV = "GYRE_PLANE_TOKEN"  # how spawn_plane hands the token over (never on a command line)


@dataclass(kw_only=True)
class PlaneConfig:
    """The execution plane (proxy, harness runner, TITO writer) as its own process."""

    run_dir: str
    """The run directory: TITO records go to <run_dir>/tito, executions to <run_dir>/executions."""
    orphan_s: float = 1800.0
    """Seconds without a call from any controller after which the plane stops its harnesses (with
    their grace), seals their records and exits: a job that never comes back leaves nothing running.
    Longer than a restart takes (rank 0 re-attaches within it)."""
    parent_pid: int | None = None
    """A process whose end means no controller can come back (rank 0's torchrun agent): the plane
    stops at once when it is gone. None: only the orphan bound."""
    checkpoint: str | None = None
    """The run's --model.checkpoint: the proxy's tokenizer (unless --proxy.tokenizer-path)."""
    proxy: ProxyConfig = field(default_factory=ProxyConfig)
    executions: ExecutionsConfig = field(default_factory=ExecutionsConfig)

    def __post_init__(self) -> None:
        if not self.orphan_s > 0:
            raise ValueError(f"--orphan-s must be > 0, got {self.orphan_s}")


class PlaneAccess(GyreProxyAccess):
    """The runner's proxy access in the plane: each closed execution's stats are kept for its
    `finished` event (the controller's ledger takes them from there) and for `calls_made`."""

    def __init__(self, proxy: Any, url: str, ledger: Any = None) -> None:
        super().__init__(proxy, url, None)
        self.closed: dict[str, Any] = {}

    def close_execution(self, execution_id: str) -> None:
        stats = self.proxy.close_execution(execution_id)
        self.closed[execution_id] = stats
        for k, v in stats.counts().items():
            self.totals[k] += v

    def calls_made(self, execution_id: str) -> int | None:
        stats = self.closed.get(execution_id)
        return None if stats is None else stats.calls


class Plane:
    """The process's state: the data plane, the event log, the last controller call."""

    def __init__(self, cfg: PlaneConfig, token: str) -> None:
        self.cfg, self.token = cfg, token
        self.run_dir = Path(cfg.run_dir).resolve()
        self.dir = self.run_dir / PLANE_DIR
        self.dir.mkdir(parents=True, exist_ok=True)
        self.events: list[dict[str, Any]] = []  # seq >= self.base, in memory; older ones only in events.jsonl
        self.base = 0
        self.acked = 0  # events every controller so far has handled (the next one's default cursor)
        self._seq = 0
        self._lock = threading.Lock()  # the TITO sink reports its errors off the loop
        self._log = (self.dir / "events.jsonl").open("a")
        self.tasks: dict[str, asyncio.Task] = {}
        self.last_seen = time.monotonic()
        self.active = 0  # controller requests being served (a long shutdown is not silence)
        self.stopping: str | None = None
        self.done = asyncio.Event()

    # ------------------------------------------------------------------ start
    async def start(self) -> None:
        from gyre.runtime.plane_routes import control_app
        from gyre.serving import start_app
        from gyre.trajectory.store import TitoStore

        self.loop = asyncio.get_running_loop()
        self._new = asyncio.Event()
        proxy_cfg = dataclasses.replace(self.cfg.proxy, admin_token=self.token)
        self.proxy, self.proxy_handle, self.access, self.runner = await serve_data_plane(
            self.cfg.checkpoint, proxy_cfg, self.cfg.executions, self.run_dir, None, TitoStore(self.run_dir / "tito"),
            self.on_error, self.on_event, access_cls=PlaneAccess)
        self.handle = await start_app(control_app(self), proxy_cfg.host, 0)
        me = peers.identity(0)
        write_private(self.run_dir / PLANE_FILE, {
            "pid": me["pid"], "start": me["start"], "host": me["host"], "url": self.handle.url,
            "proxy_url": self.proxy_handle.url, "token": self.token, "executions_dir": str(self.runner.run_dir)})
        logger.info("execution plane serving at %s (proxy %s), pid %d", self.handle.url, self.proxy_handle.url, me["pid"])

    # ------------------------------------------------------------------ events
    def record(self, entry: dict[str, Any]) -> None:
        """Append one event (any thread): sequence number, memory, events.jsonl; wake the pollers."""
        with self._lock:
            entry["seq"] = self._seq
            self._seq += 1
            self.events.append(entry)
            try:
                self._log.write(json.dumps(entry) + "\n")
                self._log.flush()
            except (OSError, ValueError) as e:  # the log is for replay after the plane; memory still serves
                logger.warning("execution plane: could not append to events.jsonl: %s", e)
        try:
            on_loop = asyncio.get_running_loop() is self.loop
        except RuntimeError:
            on_loop = False
        if on_loop:
            self._wake()
        else:
            self.loop.call_soon_threadsafe(self._wake)

    def _wake(self) -> None:
        self._new.set()
        self._new = asyncio.Event()

    @property
    def next_seq(self) -> int:
        return self._seq

    def since(self, seq: int, limit: int = 1000) -> list[dict[str, Any]]:
        with self._lock:
            if seq >= self.base:
                return self.events[seq - self.base:seq - self.base + limit]
        old = []  # trimmed from memory: read back from the log
        with (self.dir / "events.jsonl").open() as f:
            for line in f:
                e = json.loads(line)
                if e["seq"] >= seq:
                    old.append(e)
                    if len(old) == limit:
                        break
        return old

    def ack(self, seq: int) -> None:
        """Every event before `seq` was handled by a controller: the next one starts there."""
        with self._lock:
            self.acked = max(self.acked, min(seq, self._seq))
            drop = self.acked - self.base
            if drop > 0:
                del self.events[:drop]
                self.base = self.acked

    async def wait_new(self, timeout: float) -> None:
        try:
            await asyncio.wait_for(self._new.wait(), timeout)
        except asyncio.TimeoutError:
            pass

    def on_event(self, ev: ExecutionEvent) -> None:
        entry = event_to_json(ev)
        if ev.kind is EventKind.FINISHED and (st := self.access.closed.get(ev.execution_id)) is not None:
            entry["closed"] = {"calls": st.calls, "sink_errors": st.sink_errors, "counts": st.counts()}
        self.record(entry)

    def on_error(self, exc: BaseException, what: str, path: Any = None) -> None:
        self.record({"type": "error", "what": what, "path": None if path is None else str(path), **error_to_json(exc)})

    def take_reroutes(self) -> None:
        if recs := self.proxy.router.take_reroutes():
            self.record({"type": "reroutes", "records": [reroute_to_json(r) for r in recs]})

    # ------------------------------------------------------------------ executions
    def dispatch(self, group: Group) -> list[str]:
        if self.stopping:
            raise RuntimeError(f"the execution plane is stopping ({self.stopping})")
        ids = [s.execution_id for s in group.executions]
        if dup := [e for e in ids if e in self.tasks]:
            raise KeyError(f"execution ids already dispatched: {dup}")
        for spec, task in zip(group.executions, self.runner.dispatch_group(group)):
            self.tasks[spec.execution_id] = task
            task.add_done_callback(lambda t, eid=spec.execution_id: self._task_done(eid, t))
        return ids

    def _task_done(self, eid: str, task: asyncio.Task) -> None:
        err = None if task.cancelled() or task.exception() is None else error_to_json(task.exception())
        self.record({"type": "done", "execution_id": eid, "cancelled": task.cancelled(), "error": err})

    def state(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "in_flight": self.runner.in_flight(), "sink_errors": self.proxy.sink_errors,
                "reroutes": self.proxy.router.reroutes, "router": self.proxy.router.stats(),
                "worst_unmatched": self.proxy.worst_unmatched(10), "stopping": self.stopping}

    # ------------------------------------------------------------------ the end
    async def watch_orphan(self) -> None:
        # The agent's end is looked for often (a killed torchrun takes its harnesses at once, as rank
        # 0's own would: one kill(pid, 0) a tick); the orphan bound needs no such care.
        period = min(max(self.cfg.orphan_s / 10, 0.05), 0.2 if self.cfg.parent_pid is not None else 5.0)
        while not self.stopping:
            await asyncio.sleep(period)
            if self.active == 0 and time.monotonic() - self.last_seen > self.cfg.orphan_s:
                await self.stop(f"no controller called for {self.cfg.orphan_s:g}s (--orphan-s)")
            elif (parent := self.cfg.parent_pid) is not None and not alive(parent):
                await self.stop(f"process {parent} that started the job (torchrun's agent) is gone: no controller can come back")

    async def stop(self, why: str) -> None:
        """Stop in order: harnesses (grace, unevaluated), router, proxy, TITO files, our file; exit."""
        if self.stopping:
            return
        self.stopping = why
        n = len(self.runner.in_flight())
        logger.warning("execution plane stopping: %s; %d executions in flight are stopped", why, n)
        grace = self.cfg.executions.runner.kill_grace_s
        try:
            await self.runner.shutdown(evaluate=False, timeout=2 * grace + 5.0)
            await self.proxy.router.close()
            await self.proxy_handle.astop()
            self.proxy.sink.close()
        finally:
            plane_file = self.run_dir / PLANE_FILE
            try:
                if json.loads(plane_file.read_text()).get("pid") == os.getpid():
                    plane_file.unlink()
            except (OSError, ValueError):
                pass
            self.record({"type": "stopped", "why": why})
            self._log.close()
            self.done.set()


async def run_plane(cfg: PlaneConfig, token: str) -> None:
    plane = Plane(cfg, token)
    await plane.start()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda s=sig: loop.create_task(plane.stop(f"{signal.Signals(s).name} received")))
    watcher = loop.create_task(plane.watch_orphan())
    await plane.done.wait()
    watcher.cancel()
    await plane.handle.astop()


def config_from_json(cls: type, obj: dict[str, Any], where: str = "config") -> Any:
    """A config dataclass from `dataclasses.asdict`'s JSON (nested sections, tuples back as tuples)."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    if unknown := set(obj) - names:
        raise ValueError(f"{where}: unknown fields {sorted(unknown)}")
    return cls(**{k: _value(hints[k], v, f"{where}.{k}") for k, v in obj.items()})


def _value(t: Any, v: Any, where: str) -> Any:
    if dataclasses.is_dataclass(t) and isinstance(v, dict):
        return config_from_json(t, v, where)
    origin = typing.get_origin(t)
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(t):
            if (dataclasses.is_dataclass(arg) and isinstance(v, dict)) or (typing.get_origin(arg) is tuple and isinstance(v, list)):
                return _value(arg, v, where)
    if origin is tuple and isinstance(v, list):
        return tuple(v)
    return v


def spawn_plane(cfg: PlaneConfig) -> subprocess.Popen:
    """Start the plane in a session of its own (torchrun's killpg of a worker's group never reaches
    it, nor its harnesses); its output goes to `<run_dir>/execution_plane/plane.log`. Wait for it
    with `plane_client.wait_for_plane`."""
    d = Path(cfg.run_dir) / PLANE_DIR
    d.mkdir(parents=True, exist_ok=True)
    write_private(d / "config.json", dataclasses.asdict(cfg))
    env = {**os.environ, TOKEN_ENV: secrets.token_urlsafe(32)}
    with (d / "plane.log").open("ab") as log:  # its log lines go to rank 0's stderr (the job's log) too
        return subprocess.Popen([sys.executable, "-m", "gyre.runtime.execution_plane", "--config-file", str(d / "config.json"),
                                 "--log-file", str(d / "plane.log")],
                                stdin=subprocess.DEVNULL, stdout=log, env=env, start_new_session=True)


def main(argv: list[str] | None = None) -> None:
    import tyro

    argv = list(sys.argv[1:] if argv is None else argv)
    default = None
    if "--config-file" in argv:  # what spawn_plane wrote; flags after it still override
        i = argv.index("--config-file")
        path = argv[i + 1] if i + 1 < len(argv) else ""
        del argv[i:i + 2]
        try:
            default = config_from_json(PlaneConfig, json.loads(Path(path).read_text()))
        except (OSError, ValueError) as e:
            raise SystemExit(f"--config-file {path!r}: {e}") from None
    log_file = None
    if "--log-file" in argv:  # spawn_plane's: the plane's own log, beside its lines in the job's log
        i = argv.index("--log-file")
        log_file = argv[i + 1] if i + 1 < len(argv) else None
        del argv[i:i + 2]
    cfg = tyro.cli(PlaneConfig, args=argv, default=default)
    fmt = logging.Formatter("[%(asctime)s plane %(name)s %(levelname)s] %(message)s", "%H:%M:%S")
    handlers: list[logging.Handler] = [logging.StreamHandler()]
    if log_file:
        handlers.append(logging.FileHandler(log_file))
    for h in handlers:
        h.setFormatter(fmt)
    logging.basicConfig(level=logging.INFO, handlers=handlers, force=True)
    token = os.environ.pop(TOKEN_ENV, None) or secrets.token_urlsafe(32)
    try:
        asyncio.run(run_plane(cfg, token))
    except Exception:
        logging.getLogger(__name__).exception("the execution plane failed")  # in plane.log too (wait_for_plane shows it)
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
