"""One job at a time in a run directory: `run_dir/run.lock`, locked by rank 0 for the job's life.

Two jobs writing one directory (two `--train.resume` of it at once, a relaunch while the old job
is still stopping) would both cut `metrics.jsonl` back, both append rows for the same steps, both
write the same checkpoints and both add their counts to the run's totals. So rank 0 takes an
exclusive `flock` on `run.lock` before it writes anything in the directory, and holds it on an
open file descriptor: the kernel drops it when the process ends however it ends (SIGKILL, the OOM
killer, a node reboot), so a lock is never left behind by a dead job and nothing has to clean it
up. The file itself stays (unlinking a lock file races with the next locker); it names the
holder (host, pid, start time, command line) so the refusal can say who has the directory.

The descriptor is close-on-exec (Python's default), so harnesses, evaluators and engine
subprocesses never inherit the lock and cannot keep it after the job.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

LOCK = "run.lock"


class RunLocked(Exception):
    """Another live process holds the run directory's lock; the message names it."""


class RunLock:
    """The lock on one run directory (`acquire`); released by `release()` or when the process ends."""

    def __init__(self) -> None:
        self.path: Path | None = None
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self, run_dir: Path, *, wait_s: float = 0.0) -> None:
        """Lock `run_dir/run.lock` (created if missing) and write who holds it; raise RunLocked
        naming the holder if another process keeps it for longer than `wait_s` (a restarted job
        waits a moment for its previous attempt's rank 0 to be gone)."""
        path = Path(run_dir) / LOCK
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    os.close(fd)
                    raise RunLocked(f"run directory {Path(run_dir)} is in use by another Gyre job "
                                    f"({describe_holder(path)}); two jobs writing one directory would duplicate its "
                                    f"metrics rows and checkpoints. Wait for that job to end (or stop it), or give "
                                    f"this one another --run-dir") from None
                time.sleep(0.2)
        holder = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                  "argv": sys.argv}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)
        self.path, self._fd = path, fd

    def release(self) -> None:
        """Unlock (closing the descriptor drops the flock); the file stays for the next job."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __del__(self) -> None:  # an in-process caller that drops its RunDir drops the lock too
        self.release()


def describe_holder(path: Path) -> str:
    """'pid 123 on host h since <time>: <argv>' from the lock file (what its holder wrote), or
    what is known when the holder has not written it yet."""
    for _ in range(10):  # the holder writes its line right after locking: give it a moment
        try:
            holder = json.loads(path.read_text())
            return (f"pid {holder['pid']} on host {holder['host']} since {holder['started']}: "
                    f"{' '.join(map(str, holder.get('argv') or []))}")
        except (OSError, ValueError, KeyError, TypeError):
            time.sleep(0.05)
    return f"holder not recorded in {path}"
