"""One directory per run: where a run's outputs go, decided once on rank 0 before anything starts.

    --run-dir ""  (the default)   a fresh `runs/<preset>/<YYYYmmdd-HHMMSS>/` (`runs/train/...`
                                  with no --preset), and the link
                                  `runs/<preset>/latest` pointing at it; running the same command
                                  again makes another directory and keeps every earlier run
    --run-dir DIR                 exactly DIR; refused when DIR already holds a run, unless
                                  --train.resume (continue it) or --overwrite (replace it)
    --train.resume                continue DIR, or the run `runs/<preset>/latest` points at

A directory's lineage is in `run.json`: `attempts` lists every launch into it (the first run,
each resume, each restart by torchrun `--max-restarts` or a Slurm requeue); attempt numbers go
into execution ids, so no launch reuses an earlier one's ids, and a resume from version V cuts
`metrics.jsonl` and `events.jsonl` back to steps before V. A restarted job finds its directory
again through torchrun's agent store, which outlives the workers (docs/operations.md,
"Checkpoints, resuming and restarts").

One job at a time: rank 0 locks the directory (`run.lock`, gyre.runtime.runlock) before it
writes or deletes anything in it and holds the lock until it exits; a second launch into it (a
second `--train.resume`, an `--overwrite`, a relaunch while the old job is still stopping) is
refused on every rank, naming the holder's pid and host.

Data a preset prepares lives beside the runs, in `runs/<preset>/data`. Rank 0 decides and creates the directory and
writes `run.json` (the config and command line); the other ranks read the decision from the
rendezvous store, so every rank writes to the same place even when their clocks differ. A
refusal is raised on every rank, before any engine, proxy or harness exists.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from gyre import checkpoint
from gyre.backends.config import Resume
from gyre.config import runs_root
from gyre.executions.evaluator import RewardResult, RewardStatus
from gyre.executions.tasks import Dataset, ExecutionSpec, Group
from gyre.runtime import peers
from gyre.runtime.runlock import RunLock, RunLocked
from gyre.runtime.outputs import events_until, metrics_until, truncate_jsonl, write_json

logger = logging.getLogger(__name__)

LATEST = "latest"
# What a run leaves in its directory; any of these means the directory already holds a run.
RUN_OUTPUTS = ("run.json", "metrics.jsonl", "groups.jsonl", "summary.json", "events.jsonl", "role_timeline.png",
               "executions", "checkpoints", "tito", "transport", "tensorboard", "wandb", "report")
_KEY = "rundir/decision"
ELASTIC_KEY = "gyre/elastic/run_dir"  # in the store that outlives a restart of the workers


JOURNAL = "groups.jsonl"


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


class GroupJournal:
    """`run_dir/groups.jsonl`: what became of every dispatched group, across attempts, one line per
    fact, flushed as it happens (a crash loses at most the line being written):

        {"kind": "dispatched", "attempt", "group_id", "task_id", "version", "executions": [...]}
        {"kind": "trained", "group_id", "step"}      the step's update is done (the core holds it)
        {"kind": "closed", "group_id"}               the run ended cleanly without training it
        {"kind": "lost", "group_id", "attempt"}      a later attempt found it lost and re-runs its task

    A resume from the checkpoint of version V reads it (`lost_groups`): a group dispatched before
    and neither trained by a step < V nor closed nor already counted lost was in flight when its
    attempt ended. If it had been evaluated (`evaluated`: results, rewards and TITO on disk) the
    new attempt carries it over and trains it first (a "dispatched" row again, its own ids);
    otherwise it is lost (a "lost" row, its executions counted in `lost_in_flight`) and its task
    is dispatched again first.
    """

    def __init__(self, run_dir: str | Path, attempt: int) -> None:
        self.attempt = attempt
        self._f = open(Path(run_dir) / JOURNAL, "a", encoding="utf-8")

    def _write(self, **row: Any) -> None:
        self._f.write(json.dumps(row) + "\n")
        self._f.flush()

    def dispatched(self, group_id: str, task_id: str, version: int, executions: list[str]) -> None:
        self._write(kind="dispatched", attempt=self.attempt, group_id=group_id, task_id=task_id, version=version,
                    executions=executions)

    def trained(self, group_ids: list[str], step: int) -> None:
        for g in group_ids:
            self._write(kind="trained", group_id=g, step=step)

    def closed(self, group_ids: list[str]) -> None:
        for g in group_ids:
            self._write(kind="closed", group_id=g)

    def lost(self, group_ids: list[str]) -> None:
        for g in group_ids:
            self._write(kind="lost", group_id=g, attempt=self.attempt)

    def close(self) -> None:
        self._f.close()


def lost_groups(run_dir: Path, version: int) -> list[dict[str, Any]]:
    """The dispatched rows of the groups lost when earlier attempts ended (see `GroupJournal`),
    in dispatch order, for a resume from `version`."""
    path = run_dir / JOURNAL
    if not path.exists():
        return []
    dispatched: dict[str, dict[str, Any]] = {}
    done: set[str] = set()
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # torn last line
        kind, g = row.get("kind"), row.get("group_id")
        if kind == "dispatched":  # again when a later attempt carries it over: it is in flight again
            dispatched[g] = row
            done.discard(g)
        elif kind in ("closed", "lost") or (kind == "trained" and row["step"] < version):
            done.add(g)
    return [row for g, row in dispatched.items() if g not in done]


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


def write_manifest(path: Path, config: dict[str, Any], world_size: int, *, start_version: int = 0, resumed_from: str = "",
                   restart: int = 0, lost_in_flight: int = 0, carried: list[str] | None = None,
                   skipped: list[str] | None = None) -> int:
    """`run.json`: what was run, so a directory explains itself; every launch into the directory
    appends to `attempts`; `config` (the run's, as a dict) is recorded by the first. Returns this
    launch's attempt number."""
    manifest = path / "run.json"
    entry = {"started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "argv": sys.argv, "world_size": world_size,
             "resumed_from": resumed_from, "start_version": start_version, "skipped_checkpoints": skipped or [],
             "restart": restart,
             "elastic_restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
             "slurm_restart": int(os.environ.get("SLURM_RESTART_COUNT", "0")),
             "elastic_run_id": os.environ.get("TORCHELASTIC_RUN_ID", ""), "lost_in_flight": lost_in_flight,
             "carried_groups": carried or []}
    if manifest.exists():
        data = json.loads(manifest.read_text())
        if "attempts" not in data:  # written before attempts were recorded: the first run and its resumes
            first = {k: data[k] for k in ("started", "argv", "world_size") if k in data}
            data["attempts"] = [{"attempt": 0, **first}] + [{"attempt": i + 1, **r} for i, r in
                                                            enumerate(data.pop("resumes", []))]
    else:
        data = {"config": config, "attempts": []}
    attempt = len(data["attempts"])
    data["attempts"].append({"attempt": attempt, **entry})
    write_json(manifest, data, indent=1)
    return attempt


# What run.json keeps of each attempt's summary (its "ended" record), and which of those add up
# over the attempts into the run's totals (summary.json's "run").
ENDED_FIELDS = ("steps", "wall_s", "calls", "aborted_calls", "reroutes", "engine_stalls", "sink_errors",
                "execution_outcomes", "incomplete_tito", "lost_in_flight", "carried_over_groups",
                "redispatched_groups", "error", "interrupted", "silent_rank", "ranks_not_stopped", "dead_ranks")
SUMMED = ("wall_s", "calls", "aborted_calls", "reroutes", "engine_stalls", "sink_errors", "lost_in_flight",
          "carried_over_groups", "redispatched_groups")


def end_attempt(path: Path, attempt: int, summary: dict[str, Any]) -> dict[str, Any]:
    """Rank 0, at an attempt's end: records what it did in its `run.json` entry ("ended") and
    returns the whole run's totals over every attempt so far, for summary.json's "run".

    An attempt that never reached its end (rank 0 killed: SIGKILL, OOM, a node lost) has no
    "ended" record. Its counts are unknown, not zero: the totals name it in `attempts_not_ended`
    and add up the others."""
    manifest = path / "run.json"
    data = json.loads(manifest.read_text())
    _name_the_dead(data["attempts"][attempt], summary)
    ended = {k: summary.get(k) for k in ENDED_FIELDS}
    ended["incomplete_tito"] = len(summary.get("incomplete_tito") or {})
    data["attempts"][attempt]["ended"] = {"at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **ended}
    write_json(manifest, data, indent=1)
    return run_totals(data["attempts"])


def record_ranks(path: Path, attempt: int, ranks: list[dict[str, Any]]) -> None:
    """Rank 0, once every rank has started: each rank's process (`gyre.runtime.peers.identity`)
    in this attempt's run.json entry, so its end can tell which ones died."""
    manifest = path / "run.json"
    data = json.loads(manifest.read_text())
    data["attempts"][attempt]["ranks"] = ranks
    write_json(manifest, data, indent=1)


def _name_the_dead(entry: dict[str, Any], summary: dict[str, Any]) -> None:
    """A signal-stopped attempt with ranks that never stopped: those whose process is gone died
    first (torchrun's SIGTERM to the others followed); the summary's error (summary.json's and
    run.json's alike) names them first, and `dead_ranks` lists them."""
    not_stopped = set(summary.get("ranks_not_stopped") or [])
    if not summary.get("interrupted") or not not_stopped or not summary.get("error"):
        return
    died = [r for r in peers.dead([r for r in entry.get("ranks", []) if r["rank"] in not_stopped])]
    if died:
        summary["dead_ranks"] = died
        summary["error"] = peers.name_the_dead(summary["error"], died)
        logger.error("%s", summary["error"])


def run_totals(attempts: list[dict[str, Any]]) -> dict[str, Any]:
    """The run's totals over `run.json`'s attempts (see `end_attempt`)."""
    ended = [a["ended"] for a in attempts if a.get("ended")]
    totals: dict[str, Any] = {"attempts": len(attempts),
                              "attempts_not_ended": [a["attempt"] for a in attempts if not a.get("ended")],
                              "steps": ended[-1]["steps"] if ended else 0}
    for k in SUMMED:
        totals[k] = sum(e.get(k) or 0 for e in ended)
    totals["incomplete_tito"] = sum(e.get("incomplete_tito") or 0 for e in ended)
    outcomes: dict[str, int] = {}
    for e in ended:
        for outcome, n in (e.get("execution_outcomes") or {}).items():
            outcomes[outcome] = outcomes.get(outcome, 0) + n
    totals["execution_outcomes"] = outcomes
    totals["errors"] = [{"attempt": a["attempt"], "error": a["ended"]["error"]} for a in attempts
                        if a.get("ended") and a["ended"].get("error")]
    return totals


def evaluated(run_dir: Path, row: dict[str, Any], version: int) -> bool:
    """Whether a lost group can be carried over into a resume from `version` and trained there:
    every execution has its result and reward on disk (executions/<id>/result.json; its TITO
    records are in tito/), and it was dispatched at a version this resume's lineage holds (a group
    sampled by a policy newer than the checkpoint is from a branch the resume discards)."""
    if row["version"] > version:
        return False
    for execution_id in row["executions"]:
        try:
            result = json.loads((run_dir / "executions" / execution_id / "result.json").read_text())
        except (OSError, ValueError):
            return False
        if result.get("reward") is None:
            return False
    return True


# ----------------------------------------------------------------------------- carry-over
@dataclass(frozen=True)
class CarriedResult:
    """An execution evaluated in an earlier attempt, as the ledger takes it (its result.json)."""

    execution_id: str
    index: int
    reward: RewardResult


def attempt_groups(run: RunDir, dataset: Dataset, n: int, *, shuffle: bool, seed: int) -> Iterator[Group]:
    """The groups this attempt dispatches, in order: the tasks of the groups earlier attempts lost
    first, then a fresh task order (seeded). Ids are <task>.a<attempt>.g<k>.<i>: unique over every
    launch into the run directory (a resume, a second resume from the same checkpoint, a restart),
    whose executions/ and tito/ they name."""
    by_id, redo = {t.task_id: t for t in dataset.tasks}, []
    for task_id in run.redo_tasks:
        if task_id not in by_id:
            logger.warning("task %s of a lost group is no longer in the dataset; not dispatched again", task_id)
            continue
        gid = f"{task_id}.a{run.attempt}.g{len(redo)}"
        redo.append(Group(gid, by_id[task_id], [ExecutionSpec(f"{gid}.{i}", by_id[task_id], gid, i) for i in range(n)]))
    fresh = dataset.iter_groups(n, shuffle=shuffle, seed=seed,
                                make_id=lambda task, k: f"{task.task_id}.a{run.attempt}.g{k + len(redo)}")
    return itertools.chain(redo, fresh)


def carriable(run: RunDir, dataset: Dataset, n: int) -> list[dict[str, Any]]:
    """Earlier attempts' evaluated groups (journal rows) this attempt can train: its task still in
    the dataset and N unchanged. They take the first dispatch slots; the others are named."""
    known = {t.task_id for t in dataset.tasks}
    rows = [r for r in run.carried if r["task_id"] in known and len(r["executions"]) == n]
    if len(rows) < len(run.carried):
        logger.warning("%d groups of earlier attempts cannot be carried over (their task left the dataset, or "
                       "--scheduler.n-per-group changed); they are not trained", len(run.carried) - len(rows))
    return rows


def carried_group(run_dir: Path, dataset: Dataset, row: dict[str, Any]) -> tuple[Group, list[CarriedResult]]:
    """An earlier attempt's evaluated group (a `groups.jsonl` row) as it was dispatched (its v_d
    the version it was sampled at) and its executions' rewards, read from their result.json."""
    task = next(t for t in dataset.tasks if t.task_id == row["task_id"])
    specs = [ExecutionSpec(e, task, row["group_id"], i, dispatch_version=row["version"])
             for i, e in enumerate(row["executions"])]
    results = []
    for spec in specs:
        saved = json.loads((run_dir / "executions" / spec.execution_id / "result.json").read_text())["reward"]
        results.append(CarriedResult(spec.execution_id, spec.index,
                                     RewardResult(spec.execution_id, RewardStatus(saved["status"]), saved["reward"])))
    return Group(row["group_id"], task, specs), results


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
    for row in lost_groups(path, version) if resume.on or restart else []:
        (carried if evaluated(path, row, version) else lost).append(row)
    lost_in_flight = sum(len(row["executions"]) for row in lost)
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
