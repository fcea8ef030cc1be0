"""One directory per run: where a run's outputs go, decided once on rank 0 before anything starts.

No --run-dir: a fresh `runs/<preset>/<YYYYmmdd-HHMMSS>/` with `runs/<preset>/latest` pointing at
it; --run-dir DIR: exactly DIR, refused when it already holds a run unless --train.resume
(continue it) or --overwrite (replace Gyre's outputs in it); --train.resume alone continues
`latest` (docs/operations.md, "Run directories"). A resume from version V cuts `metrics.jsonl`
and `events.jsonl` back to steps before V; each launch is an attempt (gyre.runtime.attempts); a
restarted job finds its directory again through torchrun's agent store, which outlives the workers.

One job at a time: rank 0 locks the directory (`run.lock`, gyre.runtime.runlock) before it
writes or deletes anything in it and holds the lock until it exits. The other ranks read rank 0's
decision from the rendezvous store, so every rank writes to the same place; a refusal (a lock
held by another job included, naming its pid and host) is raised on every rank, before any
engine, proxy or harness exists.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gyre import checkpoint
from gyre.backends.config import Resume
from gyre.config import runs_root
from gyre.runtime.attempts import GroupJournal, evaluated, live_group, lost_groups, write_manifest
from gyre.runtime.runlock import RunLock, RunLocked
from gyre.runtime.outputs import events_until, metrics_until, truncate_jsonl

logger = logging.getLogger(__name__)

LATEST = "latest"
# What a run leaves in its directory; any of these means the directory already holds a run.
RUN_OUTPUTS = ("run.json", "metrics.jsonl", "groups.jsonl", "summary.json", "events.jsonl", "role_timeline.png",
               "executions", "checkpoints", "tito", "transport", "tensorboard", "wandb", "report")
_KEY = "rundir/decision"
ELASTIC_KEY = "gyre/elastic/run_dir"  # in the store that outlives a restart of the workers


@dataclass(frozen=True)
class RunDir:
    """Rank 0's decision, the same on every rank."""

    path: Path
    attempt: int  # 0: the first launch into this directory; then one more per resume or restart
    start_version: int  # the version training starts from: the checkpoint's, 0 without one
    checkpoint: str = ""  # the checkpoint resumed from ("" when none)
    redo_tasks: tuple[str, ...] = ()  # task ids of earlier attempts' groups lost (see `lost_groups`), dispatched first
    lost_in_flight: int = 0  # their executions
    # earlier attempts' groups evaluated but not trained into the checkpoint (journal rows): trained first
    carried: tuple[dict[str, Any], ...] = ()
    # rank 0: the directory's lock (gyre.runtime.runlock), held while this object lives; None elsewhere
    lock: RunLock | None = field(default=None, compare=False, repr=False)

    def shared(self) -> dict[str, Any]:
        """The decision as rank 0 sends it to the other ranks (JSON; the lock stays on rank 0)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "lock"}


class RunDirError(ValueError):
    """The run directory cannot be used as asked; the message names the flags that fix it."""


class RunFinished(Exception):
    """A restarted job (torchrun --max-restarts, a Slurm requeue) whose run had already reached
    --train.steps: a rank died after the final checkpoint. Nothing is left to do."""


def previous_outputs(path: Path) -> list[str]:
    """The names of a previous run's outputs found in `path` (empty: a fresh directory)."""
    return [name for name in RUN_OUTPUTS if (path / name).exists()]


def _fresh_timestamped(root: Path, now: float) -> Path:
    """Create and return `root/<timestamp>` (with -2, -3, ... when two runs start in one second)."""
    root.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    for n in range(1, 1000):
        path = root / (stamp if n == 1 else f"{stamp}-{n}")
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue
    raise RunDirError(f"could not create a fresh run directory under {root}")


def _point_latest(root: Path, target: Path) -> None:
    """Atomically make `root/latest` a relative link to `target`."""
    link, tmp = root / LATEST, root / f".{LATEST}.{os.getpid()}"
    tmp.unlink(missing_ok=True)
    os.symlink(target.name, tmp)
    os.replace(tmp, link)


def _lock(lock: RunLock, path: Path, wait_s: float) -> None:
    try:
        lock.acquire(path, wait_s=wait_s)
    except RunLocked as e:
        raise RunDirError(str(e)) from None


def decide(run_dir: str, preset: str, *, resume: bool = False, overwrite: bool = False, now: float | None = None,
           lock: RunLock | None = None, lock_wait_s: float = 0.0) -> Path:
    """Rank 0's decision (creates the directory); raises RunDirError with the fix when refused.

    The directory is locked (`lock`, see gyre.runtime.runlock) before anything in it is written or
    deleted; another job holding it is a refusal naming that job. Without `lock` the lock is
    taken and dropped again here (the in-process checks)."""
    own = lock is None
    lock = RunLock() if lock is None else lock
    try:
        return _decide_path(run_dir, preset, resume, overwrite, now, lock, lock_wait_s)
    finally:
        if own:
            lock.release()


def _decide_path(run_dir: str, preset: str, resume: bool, overwrite: bool, now: float | None, lock: RunLock,
                 lock_wait_s: float) -> Path:
    if not run_dir:
        root = runs_root(preset)
        if resume:
            latest = root / LATEST
            if not latest.exists():
                raise RunDirError(f"--train.resume: there is no previous run to resume ({latest} does not exist); "
                                  f"give the run's directory with --run-dir DIR")
            _lock(lock, latest.resolve(), lock_wait_s)
            return latest.resolve()
        path = _fresh_timestamped(root, time.time() if now is None else now)
        _lock(lock, path, lock_wait_s)
        _point_latest(root, path)
        return path.resolve()
    path = Path(run_dir)
    if resume:
        if not path.is_dir():
            raise RunDirError(f"--train.resume: run directory {path} does not exist")
        _lock(lock, path, lock_wait_s)
        return path.resolve()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise RunDirError(f"--run-dir {path}: cannot create it: {e.strerror}") from None
    _lock(lock, path, lock_wait_s)  # before the outputs are looked at: a job still writing them is the refusal
    found = previous_outputs(path)
    if found:
        if not overwrite:
            raise RunDirError(
                f"run directory {path} already holds a run ({', '.join(found)}). Pass --train.resume to continue it, "
                f"--overwrite to delete those outputs and start over, or another --run-dir (leave --run-dir unset "
                f"for a fresh timestamped directory under {runs_root(preset)}/)")
        for name in found:
            p = path / name
            shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
        logger.warning("--overwrite: deleted the previous run's %s in %s", ", ".join(found), path)
    return path.resolve()


def _resume_point(tc: Resume, path: Path, *, restart: bool) -> tuple[str, int, list[str]]:
    """The checkpoint a resume starts from, its version and the newer ones skipped (with why);
    ("", 0, []) for a run that stopped before its first checkpoint (no step_* directory at all).
    Raises RunDirError with what was found (checkpoints there, none usable)."""
    skipped: list[str] = []
    if tc.path:
        ck = Path(tc.path)
        why = checkpoint.check(ck) if ck.is_dir() else "not a directory"
        if why is not None and not (tc.weights_only and ck.is_dir()):
            raise RunDirError(f"--train.resume-from {ck}: {why}")
    else:
        try:
            found = checkpoint.select(path / "checkpoints", weights_only=tc.weights_only)
            ck, skipped = found.path, [f"{p.name}: {why}" for p, why in found.skipped]
        except checkpoint.CheckpointError as e:
            if not checkpoint.candidates(path / "checkpoints"):
                # The run stopped before its first checkpoint (a preemption before step 1, a crash
                # at start): nothing trained is lost by starting again, so a resume or a requeue
                # does that rather than refuse.
                logger.warning("%s: no checkpoint in %s yet (the run stopped before its first); starting again "
                               "from version 0", "restart" if restart else "--train.resume", path)
                return "", 0, []
            raise RunDirError(str(e)) from None
    try:
        version = checkpoint.version_of(ck)
    except checkpoint.CheckpointError as e:
        raise RunDirError(str(e)) from None
    if version >= tc.steps and restart:
        raise RunFinished(f"restart: {ck} is at version {version}, --train.steps {tc.steps}: the run had finished "
                          f"(a rank died after its final checkpoint); nothing to do")
    if version >= tc.steps:
        raise RunDirError(f"--train.resume: {ck} is already at version {version} >= --train.steps {tc.steps}; "
                          f"train.steps counts the whole run, raise it")
    return str(ck.resolve()), version, skipped


def _decide_all(run_dir: str, preset: str, resume: Resume, overwrite: bool, config: dict[str, Any], world_size: int,
                restart: int, elastic: Any) -> RunDir:
    """Rank 0: the directory, the resume point, the cut-back outputs, the manifest."""
    if restart and elastic is not None and elastic.check([ELASTIC_KEY]):
        run_dir = elastic.get(ELASTIC_KEY).decode()  # the directory the job's first attempt chose
        resume = dataclasses.replace(resume, on=True)
        logger.warning("elastic restart %d: resuming the run in %s", restart, run_dir)
    elif restart and run_dir and previous_outputs(Path(run_dir)):  # a store of its own per attempt
        resume = dataclasses.replace(resume, on=True)
        logger.warning("elastic restart %d: resuming the run in --run-dir %s", restart, run_dir)
    lock = RunLock()  # held for the job's life by the RunDir returned (rank 0 keeps it until it exits)
    try:
        # A restart waits a moment for the previous attempt's rank 0 (torchrun has stopped it; a
        # Slurm requeue's may still be exiting on another node).
        path = decide(run_dir, preset, resume=resume.on, overwrite=overwrite, lock=lock,
                      lock_wait_s=30.0 if restart else 0.0)
        return _decide_locked(path, resume, config, world_size, restart, elastic, lock)
    except BaseException:
        lock.release()  # a refusal holds nothing (its traceback may outlive this call)
        raise


def _decide_locked(path: Path, resume: Resume, config: dict[str, Any], world_size: int, restart: int, elastic: Any,
                   lock: RunLock) -> RunDir:
    ck, version, skipped = _resume_point(resume, path, restart=restart > 0) if resume.on else ("", 0, [])
    if resume.on:
        dropped = truncate_jsonl(path / "metrics.jsonl", metrics_until(version))
        truncate_jsonl(path / "events.jsonl", events_until(version))
        if dropped:
            logger.warning("metrics.jsonl: dropped %d rows of steps >= %d (after the checkpoint resumed from)",
                           dropped, version)
    lost, carried = [], []
    earlier = lost_groups(path, version) if resume.on or restart else []
    running = None  # --executions.plane process: what an earlier attempt's plane still runs
    if earlier and (path / "execution_plane.json").exists():
        from gyre.runtime.plane_attach import live_executions

        running = live_executions(path)
    for row in earlier:
        if evaluated(path, row, version):
            carried.append(row)
        elif running is not None and (live := live_group(path, row, running, version)) is not None:
            carried.append(live)
        else:
            lost.append(row)
    lost_in_flight = sum(len(row["executions"]) for row in lost)
    if adopted := [r["group_id"] for r in carried if r.get("live")]:
        logger.warning("%d groups of earlier attempts are still running in the execution plane: adopted (%s)",
                       len(adopted), ", ".join(adopted))
    if carried:
        logger.warning("%d groups of earlier attempts were evaluated but not trained into version %d; they are "
                       "trained first (%s)", len(carried), version, ", ".join(r["group_id"] for r in carried))
    attempt = write_manifest(path, config, world_size, start_version=version, resumed_from=ck, restart=restart,
                             lost_in_flight=lost_in_flight, carried=[r["group_id"] for r in carried],
                             skipped=skipped)
    if lost:
        journal = GroupJournal(path, attempt)
        journal.lost([row["group_id"] for row in lost])
        journal.close()
        logger.warning("%d executions (%d groups) of earlier attempts were in flight or not yet trained into "
                       "version %d; their tasks are dispatched again first", lost_in_flight, len(lost), version)
    if elastic is not None:
        elastic.set(ELASTIC_KEY, str(path))
    return RunDir(path, attempt, version, ck, tuple(row["task_id"] for row in lost), lost_in_flight, tuple(carried),
                  lock=lock)


def resolve(run_dir: str, preset: str, resume: Resume, rank: int, world_size: int, store: Any, *, overwrite: bool = False,
            config: dict[str, Any] | None = None, restart: int = 0, elastic: Any = None) -> RunDir:
    """Every rank: the run's directory, attempt and resume point, decided by rank 0 and shared
    through `store`, from `--run-dir`, `--preset`, the resume flags and `--overwrite` (`config`:
    what run.json records). `restart` counts torchrun's restarts of this job
    (TORCHELASTIC_RESTART_COUNT); `elastic` is a store that outlives them (where rank 0 finds the
    directory it chose before). Raises RunDirError on every rank when refused, RunFinished when
    a restart finds the run done.
    """
    if rank == 0:
        try:
            run = _decide_all(run_dir, preset, resume, overwrite, config or {}, world_size, restart, elastic)
            store.set(_KEY, json.dumps(run.shared(), default=str))
        except (RunDirError, RunFinished) as e:
            store.set(_KEY, json.dumps({"error": str(e), "finished": isinstance(e, RunFinished)}))
            raise
    else:
        store.wait([_KEY])  # blocking: rank 0's decision
    decision = json.loads(store.get(_KEY))
    if "error" in decision:
        raise (RunFinished if decision["finished"] else RunDirError)(decision["error"])
    if rank == 0:
        return run  # with its lock
    return RunDir(**{**decision, "path": Path(decision["path"]), "redo_tasks": tuple(decision["redo_tasks"]),
                     "carried": tuple(decision["carried"])})
