"""Temporary directories that do not outlive their process, however it ends.

A graceful stop removes what it made (an evaluator's `gyre-eval-*` directory, a sandbox relay's
`sb-*` socket directory); SIGKILL, the OOM killer or a forced stop after the shutdown bound do
not. So every such directory goes under one root per process,

    $TMPDIR/gyre-scratch-<pid>-XXXXXXXX/.lock    flock'ed (exclusive) for the process's life

removed when the process exits normally, and otherwise by the next `gyre.run` on the node (local
rank 0, at start; a restarted job too), which removes each root whose lock is free: its process
is gone, whichever way it went. A lock dies with its process,
so a reused pid keeps nothing alive and a live process loses nothing. The lock's descriptor is
close-on-exec: harnesses and evaluators do not hold it.
"""

from __future__ import annotations

import atexit
import fcntl
import logging
import os
import shutil
import tempfile
import threading
from pathlib import Path

logger = logging.getLogger(__name__)

PREFIX = "gyre-scratch-"
LOCK = ".lock"

_lock = threading.Lock()
_root: tuple[int, Path, int] | None = None  # (pid, root, the lock's fd): a forked child makes its own


def root() -> Path:
    """This process's scratch root, made (and locked) on first use."""
    global _root
    with _lock:
        if _root is None or _root[0] != os.getpid() or not _root[1].is_dir():
            # Locked under another name, then renamed: a sweep never sees a root without its lock held.
            new = Path(tempfile.mkdtemp(prefix=f".{PREFIX}{os.getpid()}-"))
            fd = os.open(new / LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # new and ours: never contended
            path = new.with_name(new.name[1:])
            os.rename(new, path)
            _root = (os.getpid(), path, fd)
            atexit.register(_remove, os.getpid(), path)  # a normal exit; a killed process's goes at the next sweep
        return _root[1]


def _remove(pid: int, path: Path) -> None:
    if os.getpid() == pid:  # not in a forked child that exits
        shutil.rmtree(path, ignore_errors=True)


def mkdtemp(prefix: str) -> str:
    """`tempfile.mkdtemp` under this process's scratch root."""
    return tempfile.mkdtemp(prefix=prefix, dir=root())


def temporary_directory(prefix: str) -> tempfile.TemporaryDirectory:
    """`tempfile.TemporaryDirectory` under this process's scratch root."""
    return tempfile.TemporaryDirectory(prefix=prefix, dir=root())


def _claim(path: Path) -> int | None:
    """The root's lock, taken (an open descriptor: the caller closes it) when its owner is gone;
    None while the owner lives. OSError when `path` holds no lock file."""
    fd = os.open(path / LOCK, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # held: its process lives
        os.close(fd)
        return None
    return fd


def alive(path: str | Path) -> bool:
    """Whether the process that owns scratch root `path` still lives (its lock is held; this
    process's own root counts). A missing root or lock file: not alive."""
    try:
        fd = _claim(Path(path))
    except OSError:
        return False
    if fd is None:
        return True
    os.close(fd)  # releases the lock taken here
    return False


def sweep(tmp: str | Path | None = None) -> list[Path]:
    """Remove the scratch roots under `tmp` (default: the temporary directory) whose process is
    gone; returns them. Roots of live processes, this one's included, are left alone, and so is
    anything that is not a scratch root (another user's, a directory without the lock file)."""
    removed = []
    base = Path(tmp if tmp is not None else tempfile.gettempdir())
    try:
        candidates = [p for p in base.iterdir() if p.name.startswith(PREFIX)]
    except OSError:
        return []
    for path in candidates:
        try:
            if path.is_symlink() or not path.is_dir() or path.stat().st_uid != os.getuid():
                continue
            fd = _claim(path)
        except OSError:
            continue
        if fd is None:
            continue
        try:
            shutil.rmtree(path, ignore_errors=True)  # removed while we hold its lock: nobody else sweeps it twice
        finally:
            os.close(fd)
        if not path.exists():
            removed.append(path)
    if removed:
        logger.info("removed %d temporary directories left by processes that are gone (%s)", len(removed),
                    ", ".join(p.name for p in removed[:5]) + (" ..." if len(removed) > 5 else ""))
    return removed
