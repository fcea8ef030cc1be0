"""Write errors of a run: every failed write is one error the controller sees, states once and
stops on (docs/operations.md, "When a run stops early"). Every write the run depends on reports
to one place, the controller's `write_failed`, so no failed write ends a task nobody awaits:

    execution results   `watch_execution(task, ...)`: a done callback on each execution task
                        (an exception there is never a silent task death)
    TITO records        `WatchedSink`: the proxy's sink; the record is missing from the file, so
                        its execution is excluded (`Controller._records` counts them), and the
                        run stops
    metrics, journal    `Guarded(obj, what, path, ...)`: every call's OSError is reported
    checkpoints         `gyre.checkpoint.write` raises `WriteFailed`; the core's worker
                        reports it as its `Failed` (the controller states it)

The first error becomes the run's error (`WriteFailed`, a `RunFailed`: logged once at the end
by the controller, without traceback); the run then takes its stop path, which writes what it
still can (summary, events, `ended` record) and names what it could not.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any, Callable

from gyre.errors import RunFailed, WriteFailed, describe, failure  # noqa: F401  (WriteFailed importable from here)

logger = logging.getLogger(__name__)


class Guarded:
    """`obj` with every method's OSError reported to `on_error(exc, what, path)` first (then
    re-raised, so the caller does not carry on as if the write happened)."""

    def __init__(self, obj: Any, what: str, path: str | Path, on_error: Callable[[BaseException, str, Any], None]):
        self._obj, self._what, self._path, self._on_error = obj, what, path, on_error

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._obj, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kw: Any) -> Any:
            try:
                return attr(*args, **kw)
            except (OSError, ValueError) as e:  # ValueError: a closed file (written after its close)
                self._on_error(e, self._what, self._path)
                raise
        return call


class WatchedSink:
    """The proxy's TITO sink: an OSError writing a record is reported (`on_error`), marked
    `reported` and raised on: the proxy counts it against its execution (`sink_errors`, so the
    execution is excluded from training) without a traceback per record (a full disk fails every
    one of them); the controller states the error once."""

    def __init__(self, inner: Any, path_for: Callable[[str], Path], on_error: Callable[[BaseException, str, Any], None]):
        self.inner, self._path_for, self._on_error = inner, path_for, on_error

    def on_record(self, record: Any) -> None:
        try:
            self.inner.on_record(record)
        except OSError as e:
            self._on_error(e, f"the TITO record of execution {record.execution_id}", self._path_for(record.execution_id))
            e.reported = True  # type: ignore[attr-defined]
            raise

    def __getattr__(self, name: str) -> Any:  # close_execution, close, ...
        return getattr(self.inner, name)


def watch_execution(task: Any, execution_id: str, exec_dir: Path,
                    on_error: Callable[[BaseException, str, Any], None]) -> None:
    """A done callback on an execution's asyncio task: an exception in it (its result.json, its
    evaluation's files) goes to `on_error`; cancellation (the run's own stop) is not one."""
    def done(t: Any) -> None:
        if t.cancelled() or t.exception() is None:
            return
        on_error(t.exception(), f"execution {execution_id}'s result", exec_dir / "result.json")

    task.add_done_callback(done)


class FirstError:
    """The first write error of the run (thread-safe: the proxy's sink writes off the loop)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.error: RunFailed | None = None
        self.later = 0  # further failed writes (stated in the summary, not one by one)

    def note(self, exc: BaseException, what: str, path: Any = None) -> RunFailed | None:
        """The run's error if this is the first write error, else None (counted)."""
        with self._lock:
            if self.error is None:
                if isinstance(exc, RunFailed):
                    self.error = exc
                elif isinstance(exc, OSError):
                    self.error = failure(exc, what, path)
                else:  # not a write error: a bug in what ran there; its traceback once, here
                    logger.error("%s raised", what, exc_info=exc)
                    self.error = RunFailed(f"{what}: {type(exc).__name__}: {exc} (traceback above); the run stopped")
                return self.error
            self.later += 1
            logger.debug("a further write error after the first: %s", describe(exc, what, path))
            return None
