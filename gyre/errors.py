"""How a run ends early, as `gyre.run` tells torchrun (docs/design.md §1); the errors every layer
raises, kept here at the bottom so that any module may raise them without importing upward.

    ConfigError   a setting that cannot work; the message names the field (gyre.run exits 2).
                  Re-exported by `gyre.config`.
    RunFailed     the run stopped early; the message is written for the user and has already
                  been logged once, by the controller (rank 0 exits 1)
    RunStopped    on another rank: the controller stopped the run after a failure it reported
                  (the rank exits 0, so torchrun's report names rank 0 alone)
    WorkerFailed  this rank raised while handling a command; it logged the traceback and told
                  the controller (the rank exits 1)
    WriteFailed   a write the run depends on failed (a full disk); `failure(exc, what, path)`
                  builds it, `describe` is its sentence (`gyre.runtime.writes` reports them)
    EngineDied    an engine process of this rank died and SIGQUIT it (SGLang's scheduler
                  and watchdog do); raised on the main thread by `engine_host.SigquitWatch`,
                  reported like any handler's failure (the rank exits 1 with WorkerFailed)
"""

from __future__ import annotations

import errno
from pathlib import Path


class ConfigError(ValueError):
    """A setting that cannot work; the message names the field."""


class RunFailed(RuntimeError):
    """The run stopped early; the message says what to look at."""


class RunStopped(RunFailed):
    """Another rank's failure stopped this rank; rank 0 reports why."""


class WorkerFailed(RunFailed):
    """This rank raised while handling a command; its traceback is in its log."""


class EngineDied(RuntimeError):
    """An engine process of this rank died (SIGQUIT from it); names the engine and its last log lines."""


class WriteFailed(RunFailed):
    """A write of the run failed; the message names what, the path and the errno."""


def describe(exc: BaseException, what: str, path: str | Path | None = None) -> str:
    """One sentence for a failed write: what, where, the errno by name and number, the fix.

    >>> describe(OSError(28, "No space left on device"), "metrics.jsonl", "/r/metrics.jsonl")
    'could not write metrics.jsonl (/r/metrics.jsonl): ENOSPC (errno 28) No space left on device'
    """
    where = getattr(exc, "filename", None) or path
    code = getattr(exc, "errno", None)
    if code is not None:
        why = f"{errno.errorcode.get(code, '?')} (errno {code}) {getattr(exc, 'strerror', '') or exc}"
    else:
        why = f"{type(exc).__name__}: {exc}"
    return f"could not write {what}" + (f" ({where})" if where else "") + f": {why}"


def failure(exc: BaseException, what: str, path: str | Path | None = None) -> WriteFailed:
    """The run's error for a failed write (the stop is what follows, and how to go on)."""
    fix = (" — free space on that file system, then resume with --train.resume"
           if getattr(exc, "errno", None) in (errno.ENOSPC, errno.EDQUOT) else "")
    return WriteFailed(f"{describe(exc, what, path)}; the run stopped{fix}")
