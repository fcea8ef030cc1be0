"""Atomic checkpoints: a checkpoint directory is either complete or not there at all.

    checkpoints/
      step_000008/            complete: COMPLETE lists every file with its size
        config.json  model.safetensors  optimizer.pt  gyre_actor.json  COMPLETE
      .step_000016.tmp/       being written (or left by a crash): never resumed from, removed
                              by the next write

`write(root, version, save)` has the actor save into `.step_VVVVVV.tmp/`, fsyncs every file,
writes `COMPLETE` (the version and each file's size) last, fsyncs, renames the directory to
`step_VVVVVV/` and fsyncs `root`: a crash at any point leaves either the previous set of
complete checkpoints or the new one, never a half-written `step_*` (the rename is atomic on
POSIX file systems). `newest_complete(root)` is what a resume reads: the newest `step_*` whose
marker is there and whose files still have the sizes the marker recorded (a truncated or
deleted file makes it incomplete), with each newer one it skipped and why.

Weights-only checkpoints (no optimizer state: the Megatron actor today) record it in the
marker; resuming from one needs `--train.resume-weights-only` (`select`).

A write that fails (a full disk) raises `WriteFailed` naming the path and errno; `WRITING`
says which version this process is writing and since when (a forced exit names it: the stop
budget cut it), `last_write_s` how long the last one took (the stop budget is checked against
it, `gyre.runtime.stop.budget_note`). Test-only: `GYRE_TEST_SLOW_CHECKPOINT_S` sleeps that many
seconds between the files and the marker, to widen the window a fault test stops the run in.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from gyre.errors import failure

logger = logging.getLogger(__name__)

MARKER = "COMPLETE"
MODEL, OPTIMIZER, META = "model.safetensors", "optimizer.pt", "gyre_actor.json"
_STEP = re.compile(r"^step_(\d{6,})$")
SLOW_ENV = "GYRE_TEST_SLOW_CHECKPOINT_S"  # test-only (tests/faults/test_stop_edges.py)

WRITING: dict[str, float] = {}  # {"version", "since" (monotonic)} while this process writes one
last_write_s: float | None = None  # seconds the last complete write took in this process


class CheckpointError(RuntimeError):
    """No checkpoint can be resumed from; the message says what was found and the flag that helps."""


def step_name(version: int) -> str:
    return f"step_{version:06d}"


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write(root: str | Path, version: int, save: Callable[[str], None], *, finalize: bool = True) -> Path:
    """Write checkpoint `version` under `root` atomically; returns its final path.

    `save(tmp_dir)` writes the files (the actor's `save_checkpoint`). `finalize=False` is for
    the other ranks of a sharded actor's cell: they take part in `save` (it is collective) and
    leave marking and renaming to the cell's first rank, which writes the files. An OSError
    (ENOSPC, EDQUOT, EIO) is raised as `WriteFailed` naming the path and errno; the previous
    complete checkpoints stay.
    """
    global last_write_s
    t0 = time.monotonic()
    WRITING.update(version=version, since=t0)
    try:
        final = _write(Path(root), version, save, finalize)
    except OSError as e:
        raise failure(e, f"checkpoint {step_name(version)}", Path(root) / f".{step_name(version)}.tmp") from e
    finally:
        WRITING.clear()
    last_write_s = time.monotonic() - t0
    return final


def cut_note() -> str | None:
    """What a forced exit now would cut: the checkpoint this process is writing (None: none)."""
    if not WRITING:
        return None
    took = time.monotonic() - WRITING["since"]
    return (f"the checkpoint of version {int(WRITING['version'])} was being written ({took:.0f}s so far"
            + (f"; the last one took {last_write_s:.0f}s" if last_write_s is not None else "")
            + "): it is cut, and a resume uses the previous complete one. Give the stop longer: "
            "--train.shutdown-timeout-s, and Slurm's KillWait (30 s by default) or --signal=B:TERM@N with it")


def _write(root: Path, version: int, save: Callable[[str], None], finalize: bool) -> Path:
    final, tmp = root / step_name(version), root / f".{step_name(version)}.tmp"
    if finalize:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():  # left by a crash in an earlier attempt
            shutil.rmtree(tmp)
        tmp.mkdir()
    save(str(tmp))
    if os.environ.get(SLOW_ENV):  # test-only: a slow file system, so a signal lands inside the write
        time.sleep(float(os.environ[SLOW_ENV]))
    if not finalize:
        return final
    files = {}
    for p in sorted(tmp.iterdir()):
        if p.is_file():
            _fsync(p)
            files[p.name] = p.stat().st_size
    marker = {"version": version, "files": files, "weights_only": OPTIMIZER not in files}
    with open(tmp / MARKER, "w") as f:
        json.dump(marker, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    _fsync(tmp)
    if final.exists():  # the same version written again (the end of a run right after a periodic one)
        old = root / f".{step_name(version)}.old"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    _fsync(root)
    for stale in root.glob(".step_*.tmp"):  # other versions' leftovers: never resumable
        shutil.rmtree(stale, ignore_errors=True)
    return final


def check(path: Path) -> str | None:
    """Why `path` is not a complete checkpoint, or None when it is."""
    marker = path / MARKER
    if not marker.is_file():
        return f"no {MARKER} marker (interrupted while written, or written before atomic checkpoints)"
    try:
        meta = json.loads(marker.read_text())
        files = dict(meta["files"])
    except (ValueError, KeyError, TypeError) as e:
        return f"unreadable {MARKER} marker ({e})"
    for name in (MODEL, META):
        if name not in files:
            return f"{name} was never written"
    for name, size in files.items():
        p = path / name
        if not p.is_file():
            return f"{name} is missing"
        if p.stat().st_size != size:
            return f"{name} is {p.stat().st_size} bytes, {size} when written (truncated or changed)"
    return None


@dataclass
class Found:
    """The newest complete checkpoint (None: none) and the newer directories skipped, with why."""

    path: Path | None
    skipped: list[tuple[Path, str]] = field(default_factory=list)

    @property
    def weights_only(self) -> bool:
        return self.path is not None and not (self.path / OPTIMIZER).is_file()

    def describe_skipped(self) -> str:
        return "; ".join(f"{p.name}: {why}" for p, why in self.skipped)


def candidates(root: Path) -> list[Path]:
    """`step_*` directories under `root`, newest version first."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _STEP.match(p.name))]
    return [p for _, p in sorted(found, reverse=True)]


def newest_complete(root: str | Path) -> Found:
    """The newest complete checkpoint under `root`, and every newer one skipped with its reason."""
    skipped = []
    for path in candidates(Path(root)):
        why = check(path)
        if why is None:
            return Found(path, skipped)
        skipped.append((path, why))
    return Found(None, skipped)


def select(root: str | Path, *, weights_only: bool = False) -> Found:
    """What `--train.resume` resumes from: the newest complete checkpoint, or with
    `weights_only` (`--train.resume-weights-only`) the newest with readable weights.

    Raises CheckpointError naming every directory looked at and why it was not used. Each
    skipped directory is logged as a warning.
    """
    root = Path(root)
    found = newest_complete(root)
    if found.path is not None and found.weights_only and not weights_only:
        raise CheckpointError(
            f"--train.resume: the newest complete checkpoint {found.path} has no optimizer state ({OPTIMIZER}); "
            f"resuming from it would start a fresh optimizer. Pass --train.resume-weights-only to accept that")
    if found.path is None and weights_only:  # no marker needed: readable weights are enough
        for i, (path, _) in enumerate(found.skipped):
            if _weights_intact(path):
                found = Found(path, found.skipped[:i])
                break
    for path, why in found.skipped:
        logger.warning("checkpoint %s skipped: %s", path, why)
    if found.path is None:
        looked = found.describe_skipped() or "no step_* directories"
        readable = not weights_only and any(_weights_intact(p) for p, _ in found.skipped)
        raise CheckpointError(f"--train.resume: no complete checkpoint under {root} ({looked})"
                              + ("; --train.resume-weights-only accepts a checkpoint without optimizer state or "
                                 "marker" if readable else ""))
    return found


def _weights_intact(path: Path) -> bool:
    """The weights are there (and, when a marker exists, have the sizes it recorded)."""
    try:
        sizes = json.loads((path / MARKER).read_text())["files"]
    except (OSError, ValueError, KeyError):
        sizes = {}
    return all((path / n).is_file() and (n not in sizes or (path / n).stat().st_size == sizes[n])
               for n in (MODEL, "config.json"))


def version_of(path: Path) -> int:
    """The version a checkpoint holds: its marker's, else its gyre_actor.json's, else its name's."""
    for name, key in ((MARKER, "version"), (META, "version")):
        try:
            return int(json.loads((path / name).read_text())[key])
        except (OSError, ValueError, KeyError):
            continue
    m = _STEP.match(path.name)
    if m is None:
        raise CheckpointError(f"{path}: cannot tell its version (no {MARKER}, no {META}, not named step_NNNNNN)")
    return int(m.group(1))
