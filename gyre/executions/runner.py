"""Harness runner: one black-box harness process per execution (docs/design.md §1, §3, §4).

For each dispatched execution the runner
  1. prepares `<run_dir>/<execution_id>/workspace` from the task, writes the instruction to
     `<execution_id>/instruction.md` and asks the proxy for the execution's own API key;
  2. waits for a slot (`max_concurrency`), then starts the harness as the leader of a new
     session in the workspace, stdout/stderr drained into `<execution_id>/{stdout,stderr}.log`
     (capped, `gyre.executions.logcap`), with an environment that points it at the proxy (below)
     and withholds the controller's own variables except `env_passthrough`, inside the
     configured sandbox (`gyre.executions.sandbox`);
  3. enforces the hard wall-clock limit (SIGTERM → grace → SIGKILL to the whole process tree,
     `gyre.executions.procs`); after any ending, stragglers of the tree are killed too;
  4. revokes the key, records the outcome, runs the evaluator on the preserved workspace and
     writes `<execution_id>/result.json`. A harness killed from outside before its first model
     call is EXCLUDED, not evaluated (no trajectory: a 0.0 would only drag its group's baseline).

Harness environment (the only way the key reaches the harness: never on a command line):
    OPENAI_BASE_URL=<proxy>/v1      OPENAI_API_KEY=<execution key>
    ANTHROPIC_BASE_URL=<proxy>      ANTHROPIC_API_KEY=<execution key>
    GYRE_MODEL / OPENAI_MODEL / ANTHROPIC_MODEL=<model name>
    GYRE_EXECUTION_ID, GYRE_GROUP_ID, GYRE_TASK_ID, GYRE_WORKSPACE, GYRE_INSTRUCTION_FILE,
    GYRE_TIMEOUT_S, GYRE_PROXY_URL, GYRE_API_KEY
(In a sandbox the URLs point at a relay to the proxy on loopback; HOME is `<execution_id>/home`.)

Counters for the scheduler (docs/design.md §3): d(t) on `dispatch`, p(t) once the process exists,
f(t) at any end (launch failures included; evaluation comes after), each an `ExecutionEvent` to
`on_event` and `events`. Lifecycle (`ExecutionPhase`): DISPATCHED → STARTED → ENDED → EVALUATED, or
DISPATCHED → ENDED (launch failed, cancelled before start); anything else raises. With
`sandbox_hosts` the harness runs remotely (docs/security.md, "Remote sandbox hosts").
"""

from __future__ import annotations

import asyncio
import enum
import json
import logging
import os
import secrets
import shutil
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

from gyre.executions import logcap, remote, sandbox
from gyre.executions.config import RunnerConfig
from gyre.executions.evaluator import Evaluator, Outcome, RewardResult, RewardStatus
from gyre.executions.procs import kill_tree, tree_pids
from gyre.executions.tasks import ExecutionSpec, Group

logger = logging.getLogger(__name__)

# Exit statuses of a harness killed by a signal the runner did not send (its own kills end as
# TIMED_OUT / CANCELLED): not a harness failure (docs/design.md §5). SIGSEGV, SIGABRT stay crashes.
_EXTERNAL_KILLS = (-signal.SIGKILL, -signal.SIGTERM)


class ProxyAccess(Protocol):
    """What the runner needs from the proxy: its base URL and per-execution keys."""

    @property
    def url(self) -> str: ...

    def open_execution(self, execution_id: str, group_id: str) -> str:
        """Register an execution; return its API key."""
        ...

    def close_execution(self, execution_id: str) -> None:
        """Revoke the execution's key: later calls with it are rejected."""
        ...

    def calls_made(self, execution_id: str) -> int | None:
        """Model calls of a closed execution (None: unknown here). Optional."""
        ...


class LocalKeys:
    """A `ProxyAccess` with no proxy behind it (runner tests, dry runs): random keys."""

    def __init__(self, url: str = "http://127.0.0.1:9") -> None:
        self.url = url
        self.keys: dict[str, str] = {}

    def open_execution(self, execution_id: str, group_id: str) -> str:
        self.keys[execution_id] = "gyre-" + secrets.token_hex(16)
        return self.keys[execution_id]

    def close_execution(self, execution_id: str) -> None:
        self.keys.pop(execution_id, None)

    def calls_made(self, execution_id: str) -> int | None:
        return None  # no proxy: unknown


class ExecutionPhase(enum.Enum):
    DISPATCHED = "dispatched"
    STARTED = "started"
    ENDED = "ended"
    EVALUATED = "evaluated"


_TRANSITIONS = {
    ExecutionPhase.DISPATCHED: {ExecutionPhase.STARTED, ExecutionPhase.ENDED},
    ExecutionPhase.STARTED: {ExecutionPhase.ENDED},
    ExecutionPhase.ENDED: {ExecutionPhase.EVALUATED},
    ExecutionPhase.EVALUATED: set(),
}


class EventKind(enum.Enum):
    DISPATCHED = "dispatched"
    STARTED = "started"
    FINISHED = "finished"
    EVALUATED = "evaluated"


@dataclass
class Counters:
    """Cumulative d(t), p(t), f(t) (docs/design.md §3; the scheduler keeps the water level)."""

    dispatched: int = 0
    started: int = 0
    finished: int = 0

    def snapshot(self) -> tuple[int, int, int]:
        return self.dispatched, self.started, self.finished


@dataclass
class ExecutionResult:
    execution_id: str
    group_id: str
    task_id: str
    index: int
    dispatch_version: int
    outcome: Outcome
    exit_code: int | None  # None when not launched; negative = killed by that signal
    start_time: float | None  # time.time() when the harness started
    end_time: float
    exec_dir: Path
    workspace: Path
    host: str = "local"
    error: str = ""
    reward: RewardResult | None = None

    @property
    def wall_s(self) -> float:
        return 0.0 if self.start_time is None else self.end_time - self.start_time

    def to_json(self) -> dict[str, Any]:
        return {
            "execution_id": self.execution_id, "group_id": self.group_id, "task_id": self.task_id,
            "index": self.index, "dispatch_version": self.dispatch_version, "outcome": self.outcome.value,
            "exit_code": self.exit_code, "start_time": self.start_time, "end_time": self.end_time,
            "wall_s": self.wall_s, "host": self.host, "error": self.error,
            "reward": None if self.reward is None else self.reward.to_json(),
        }


@dataclass
class ExecutionEvent:
    kind: EventKind
    execution_id: str
    group_id: str
    time: float
    counters: tuple[int, int, int]  # (d, p, f) right after this event
    result: ExecutionResult | None = None  # on FINISHED and EVALUATED


@dataclass
class _Live:
    spec: ExecutionSpec
    state: ExecutionPhase = ExecutionPhase.DISPATCHED
    pid: int | None = None
    host: str = "local"
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    key_closed: bool = False  # closed at the proxy before its harness was killed (time up, run stopping)

    def move(self, to: ExecutionPhase) -> None:
        if to not in _TRANSITIONS[self.state]:
            raise RuntimeError(f"execution {self.spec.execution_id}: illegal transition {self.state.name} → {to.name}")
        self.state = to


class HarnessRunner:
    """Launches, limits, kills and evaluates harness executions. Use from one asyncio loop."""

    def __init__(self, cfg: RunnerConfig, evaluator: Evaluator | None = None, proxy: ProxyAccess | None = None,
                 on_event: Callable[[ExecutionEvent], None] | None = None) -> None:
        if cfg.max_concurrency < 1:
            raise ValueError(f"runner.max_concurrency must be >= 1, got {cfg.max_concurrency}")
        if not cfg.timeout_s > 0:
            raise ValueError(f"runner.timeout_s must be > 0, got {cfg.timeout_s}")
        if cfg.log_cap_bytes < 1024:
            raise ValueError(f"runner.log_cap_bytes must be >= 1024, got {cfg.log_cap_bytes}")
        self.cfg = cfg
        self.evaluator = evaluator
        self.proxy: ProxyAccess = proxy if proxy is not None else LocalKeys()
        self.on_event = on_event
        self.counters = Counters()
        self.events: asyncio.Queue[ExecutionEvent] = asyncio.Queue()
        self.run_dir = Path(cfg.run_dir).resolve()
        self._sem: asyncio.Semaphore | None = None
        self._live: dict[str, _Live] = {}
        self._tasks: dict[str, asyncio.Task] = {}
        self._host_load = {h: 0 for h in cfg.sandbox_hosts}
        self._evaluate_cancelled = True
        self._sandbox: str | None = None  # resolved backend, decided at the first launch

    # ------------------------------------------------------------------ public API
    def dispatch(self, spec: ExecutionSpec) -> asyncio.Task:
        """Count the execution as dispatched (d += 1) and schedule it; returns an asyncio task
        resolving to its `ExecutionResult`. Must be called from the running loop."""
        eid = spec.execution_id
        if eid in self._live or eid in self._tasks:
            raise ValueError(f"execution id {eid!r} was already dispatched")
        if self._sem is None:
            self._sem = asyncio.Semaphore(self.cfg.max_concurrency)
        self._live[eid] = _Live(spec)
        self.counters.dispatched += 1
        self._emit(EventKind.DISPATCHED, spec)
        task = asyncio.get_running_loop().create_task(self._run(self._live[eid]), name=f"execution-{eid}")
        self._tasks[eid] = task
        return task

    def dispatch_group(self, group: Group) -> list[asyncio.Task]:
        return [self.dispatch(s) for s in group.executions]

    def in_flight(self) -> list[str]:
        return [eid for eid, live in self._live.items() if live.state in (ExecutionPhase.DISPATCHED, ExecutionPhase.STARTED)]

    async def shutdown(self, evaluate: bool = True, timeout: float | None = None) -> None:
        """Stop every in-flight execution (outcome CANCELLED) and wait for all of them. Their
        workspaces are still evaluated unless `evaluate` is False (a run stopping on an error).
        With `timeout` (an interrupted run), what has not ended by then (evaluations in flight)
        is cancelled: evaluator processes killed, their temporary directories removed."""
        self._evaluate_cancelled = evaluate
        for live in self._live.values():
            live.stop.set()
        pending = [t for t in self._tasks.values() if not t.done()]
        if not pending:
            return
        _, rest = await asyncio.wait(pending, timeout=timeout)
        if rest:
            logger.warning("executions: %d did not end within %.0fs (evaluations in flight); cancelling them",
                           len(rest), timeout)
            for t in rest:
                t.cancel()
            await asyncio.wait(rest, timeout=max(5.0, 2 * self.cfg.kill_grace_s))

    # ------------------------------------------------------------------ internals
    def _emit(self, kind: EventKind, spec: ExecutionSpec, result: ExecutionResult | None = None) -> None:
        ev = ExecutionEvent(kind, spec.execution_id, spec.group_id, time.time(), self.counters.snapshot(), result)
        self.events.put_nowait(ev)
        if self.on_event is not None:
            try:
                self.on_event(ev)
            except Exception:  # noqa: BLE001 - a broken observer must not kill executions
                logger.exception("on_event callback failed on %s %s", kind.value, spec.execution_id)

    def _prepare(self, spec: ExecutionSpec, exec_dir: Path) -> Path:
        if exec_dir.exists():
            raise FileExistsError(f"execution directory {exec_dir} already exists (execution ids must be unique per run_dir)")
        exec_dir.mkdir(parents=True)
        ws = exec_dir / "workspace"
        task = spec.task
        if task.workspace:
            src = Path(task.workspace)
            if not src.is_dir():
                raise FileNotFoundError(f"task {task.task_id}: workspace template {src} is not a directory")
            shutil.copytree(src, ws, symlinks=True)
        else:
            ws.mkdir()
        for rel, content in task.files.items():
            p = ws / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(content)
        (exec_dir / "instruction.md").write_text(task.instruction)
        if self.cfg.home == "per_execution":
            (exec_dir / "home").mkdir()
        return ws

    def _env(self, spec: ExecutionSpec, exec_dir: Path, ws: Path, key: str, timeout: float) -> dict[str, str]:
        env = {k: os.environ[k] for k in self.cfg.env_passthrough if k in os.environ}
        url = (self.cfg.proxy_url_for_harness or self.proxy.url).rstrip("/")
        model = self.cfg.model_name
        env.update(
            OPENAI_BASE_URL=f"{url}/v1", OPENAI_API_KEY=key, ANTHROPIC_BASE_URL=url, ANTHROPIC_API_KEY=key,
            GYRE_MODEL=model, OPENAI_MODEL=model, ANTHROPIC_MODEL=model, GYRE_PROXY_URL=url, GYRE_API_KEY=key,
            GYRE_EXECUTION_ID=spec.execution_id, GYRE_GROUP_ID=spec.group_id, GYRE_TASK_ID=spec.task.task_id,
            GYRE_WORKSPACE=str(ws), GYRE_INSTRUCTION_FILE=str(exec_dir / "instruction.md"), GYRE_TIMEOUT_S=str(timeout),
        )
        ctx = getattr(self.proxy, "context_tokens", None)  # the proxy's context: harnesses that size their own window read it
        if ctx:
            env["GYRE_MAX_CONTEXT_TOKENS"] = str(ctx)
        if self.cfg.home == "per_execution":
            env["HOME"] = str(exec_dir / "home")
        env.update(self.cfg.env)
        return env

    def _argv(self, spec: ExecutionSpec, exec_dir: Path, ws: Path) -> list[str]:
        argv = spec.task.harness or self.cfg.harness_command
        if not argv:
            raise ValueError(f"task {spec.task.task_id}: no harness command (set runner.harness_command or the task's 'harness')")
        python = self.cfg.container_python if self.sandbox_kind() == "container" else sys.executable
        subst = {"{python}": python, "{workspace}": str(ws), "{instruction_file}": str(exec_dir / "instruction.md")}
        out = []
        for a in argv:
            for k, v in subst.items():
                a = a.replace(k, v)
            out.append(a)
        return out

    def sandbox_kind(self) -> str:
        """The sandbox backend harnesses run in here (`none` in remote mode: isolate the hosts)."""
        if self._sandbox is None:
            self._sandbox = "none" if self.cfg.sandbox_hosts else sandbox.resolve(self.cfg.sandbox)
            if self._sandbox == "none" and not self.cfg.sandbox_hosts:
                logger.warning("executions: harness not isolated (--executions.runner.sandbox none): harnesses run "
                               "as this user with this filesystem, network and process table")
            else:
                logger.info("executions: harnesses run in sandbox %s", "ssh hosts" if self.cfg.sandbox_hosts else self._sandbox)
        return self._sandbox

    async def _run(self, live: _Live) -> ExecutionResult:
        spec = live.spec
        exec_dir = self.run_dir / spec.execution_id
        ws = exec_dir / "workspace"
        timeout = spec.task.timeout_s or self.cfg.timeout_s
        outcome, exit_code, start, error = Outcome.LAUNCH_FAILED, None, None, ""
        key_opened = False
        launch: sandbox.Launch | None = None
        logs: list[logcap.Drain] = []
        assert self._sem is not None
        try:
            async with self._sem:
                if live.stop.is_set():
                    outcome, error = Outcome.CANCELLED, "stopped before start"
                else:
                    try:
                        ws = await asyncio.to_thread(self._prepare, spec, exec_dir)  # copying a repo blocks
                        key = self.proxy.open_execution(spec.execution_id, spec.group_id)
                        key_opened = True
                        env = self._env(spec, exec_dir, ws, key, timeout)
                        argv = self._argv(spec, exec_dir, ws)
                        live.host = self._pick_host()
                        if live.host != "local":
                            argv, env = await remote.push_and_wrap(self.cfg, spec, live.host, ws, argv, env, timeout)
                            launch = sandbox.Launch(argv, env, str(exec_dir))
                        else:
                            launch = await sandbox.prepare(self.sandbox_kind(), cfg=self.cfg, execution_id=spec.execution_id,
                                                           exec_dir=exec_dir, ws=ws, argv=argv, env=env)
                        proc = await self._start(launch, exec_dir, spec.execution_id, logs)
                    except Exception as e:  # noqa: BLE001 - any launch problem is this execution's failure
                        error = f"{type(e).__name__}: {e}"
                        logger.warning("execution %s failed to launch: %s", spec.execution_id, error)
                    else:
                        start = time.time()
                        live.pid = proc.pid
                        live.move(ExecutionPhase.STARTED)
                        self.counters.started += 1
                        self._emit(EventKind.STARTED, spec)
                        outcome, exit_code = await self._supervise(live, proc, timeout)
                        exit_code = launch.exit_code(exit_code)
                        for log in logs:
                            await log.finish(timeout=5.0)
                        if outcome is Outcome.CRASHED and exit_code in _EXTERNAL_KILLS:
                            outcome = Outcome.KILLED  # the runner sent nothing: the OOM killer, an operator
                            logger.warning("execution %s: harness killed from outside (signal %d); its workspace is "
                                           "evaluated, as after a timeout", spec.execution_id, -exit_code)
                        if live.host != "local":
                            await remote.pull(self.cfg, spec, live.host, ws)
        except asyncio.CancelledError:
            # Hard cancellation of the asyncio task: the tree is already killed (_supervise);
            # keep the counters right, skip evaluation, propagate.
            self._end(live, key_opened, Outcome.CANCELLED, None, start, exec_dir, ws, "asyncio task cancelled")
            raise
        finally:
            for log in logs:
                log.close()  # done already, unless the launch failed or the task was cancelled
            if live.host != "local":
                self._host_load[live.host] -= 1
            if launch is not None:
                await asyncio.shield(launch.cleanup())
        log_errors = [log.log.error for log in logs if log.log.error]
        if log_errors:
            error = "; ".join(filter(None, [error, *log_errors]))
        result = self._end(live, key_opened, outcome, exit_code, start, exec_dir, ws, error)
        skip = outcome is Outcome.CANCELLED and not self._evaluate_cancelled
        idle = self._killed_before_any_call(result)
        if idle is not None:
            result.reward = RewardResult(spec.execution_id, RewardStatus.EXCLUDED, None, detail={"excluded": idle})
            result.error = "; ".join(filter(None, [result.error, idle]))
            logger.warning("execution %s: %s", spec.execution_id, idle)
        elif self.evaluator is not None and _own_dir(exec_dir) and not skip:
            result.reward = await self.evaluator.evaluate(spec.execution_id, spec.task, ws, outcome)
        live.move(ExecutionPhase.EVALUATED)
        if _own_dir(exec_dir):
            _write_new(exec_dir / "result.json", json.dumps(result.to_json(), indent=1))
        elif os.path.lexists(exec_dir):
            logger.warning("execution %s: its directory %s was replaced by a link; result.json not written "
                           "there (the result is in the run's events)", spec.execution_id, exec_dir)
        self._emit(EventKind.EVALUATED, spec, result)
        return result

    async def _start(self, launch: sandbox.Launch, exec_dir: Path, eid: str,
                     logs: list[logcap.Drain]) -> asyncio.subprocess.Process:
        """Start the launch as the leader of a new session, its stdout/stderr drained into capped
        logs (appended to `logs` as they are made, so the caller closes them whatever happens)."""
        ends: list[int] = []
        try:
            for name in ("stdout", "stderr"):
                log = logcap.CappedLog(exec_dir / f"{name}.log", self.cfg.log_cap_bytes, f"execution {eid} {name}.log")
                try:
                    r, w = os.pipe()
                except OSError:
                    log.close()
                    raise
                ends.append(w)
                logs.append(await logcap.drain(r, log))
            return await asyncio.create_subprocess_exec(
                *launch.argv, cwd=launch.cwd, env=launch.env,
                stdin=asyncio.subprocess.DEVNULL, stdout=ends[0], stderr=ends[1], start_new_session=True,
                preexec_fn=sandbox.die_with_runner(),  # killed with this rank, however it ends
            )
        finally:
            for w in ends:  # the child has its copies; ours would keep the pipes from ever ending
                os.close(w)

    def _killed_before_any_call(self, result: ExecutionResult) -> str | None:
        """Why an execution is no sample at all, or None: killed from outside (the OOM killer, an
        operator) before its first model call, its workspace says nothing about the policy."""
        if result.outcome is not Outcome.KILLED:
            return None
        calls_made = getattr(self.proxy, "calls_made", None)
        if calls_made is None or calls_made(result.execution_id) != 0:
            return None
        return "killed before its first model call: excluded from its group (not a 0 reward), not evaluated"

    def _end(self, live: _Live, key_opened: bool, outcome: Outcome, exit_code: int | None, start: float | None,
             exec_dir: Path, ws: Path, error: str) -> ExecutionResult:
        spec = live.spec
        if key_opened and not live.key_closed:
            self.proxy.close_execution(spec.execution_id)
        live.move(ExecutionPhase.ENDED)
        self.counters.finished += 1
        result = ExecutionResult(
            spec.execution_id, spec.group_id, spec.task.task_id, spec.index, spec.dispatch_version, outcome,
            exit_code, start, time.time(), exec_dir, ws, live.host, error,
        )
        self._emit(EventKind.FINISHED, spec, result)
        return result

    async def _supervise(self, live: _Live, proc: asyncio.subprocess.Process, timeout: float) -> tuple[Outcome, int | None]:
        """Wait for the harness, the time limit, or a stop request; leave no process behind."""
        waiter = asyncio.ensure_future(proc.wait())
        stopper = asyncio.ensure_future(live.stop.wait())
        try:
            done, _ = await asyncio.wait({waiter, stopper}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            await kill_tree(proc.pid, self.cfg.kill_grace_s, proc)
            raise
        finally:
            stopper.cancel()
        if waiter in done:
            # The leader exited (a CONTAIN shim empties its tree first); anything it left running in
            # its session is killed now.
            if tree_pids(proc.pid, include_leader=False):
                logger.info("execution %s: harness exited leaving processes behind; killing them", live.spec.execution_id)
                await kill_tree(proc.pid, min(self.cfg.kill_grace_s, 1.0))
            rc = proc.returncode
            return (Outcome.COMPLETED if rc == 0 else Outcome.CRASHED), rc
        waiter.cancel()
        outcome = Outcome.CANCELLED if stopper in done else Outcome.TIMED_OUT
        why = "cancelled (the run is stopping)" if outcome is Outcome.CANCELLED else f"timed out after {timeout:.1f}s"
        logger.info("execution %s: %s, killing its process tree", live.spec.execution_id, why)
        # Closed at the proxy first: a model call in flight ends with its execution (not recorded,
        # counted `inflight`), never as a call whose client vanished mid-answer when the killed
        # harness's socket closes (that would count as an aborted call).
        live.key_closed = True
        self.proxy.close_execution(live.spec.execution_id)
        # A little longer than the grace: a CONTAIN shim SIGKILLs its own tree at the grace and
        # should exit before the runner's SIGKILL reaches it (a backstop here).
        await kill_tree(proc.pid, self.cfg.kill_grace_s + 1.0, proc)
        return outcome, proc.returncode

    # ------------------------------------------------------------------ remote mode
    def _pick_host(self) -> str:
        if not self._host_load:
            return "local"
        host = min(self._host_load, key=lambda h: self._host_load[h])
        self._host_load[host] += 1
        return host


def _own_dir(path: Path) -> bool:
    """`path` is a directory and not a link to one (under `none` a harness could swap its execution
    directory for a link; Gyre then neither evaluates nor writes through it)."""
    return path.is_dir() and not path.is_symlink()


def _write_new(path: Path, text: str) -> None:
    """Write `path` in a directory the harness could write (its execution directory under a
    sandbox): whatever it left there, a symlink included, is replaced, never followed."""
    try:
        path.unlink()
    except FileNotFoundError:
        pass
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
    except OSError as e:  # a full disk: the controller states it with the path (gyre.runtime.writes)
        raise OSError(e.errno, e.strerror, str(path)) from e
