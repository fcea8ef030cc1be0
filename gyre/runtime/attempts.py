"""A run's attempts: every launch into one run directory (`run.json`'s `attempts`: the first run,
each resume, each restart), what each did, and the groups one attempt hands on to the next
(`groups.jsonl`). Attempt numbers go into execution ids, so no launch reuses an earlier one's.
Where the run lives: gyre.runtime.rundir; how a resume uses this: docs/operations.md.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from gyre.executions.evaluator import RewardResult, RewardStatus
from gyre.executions.tasks import Dataset, ExecutionSpec, Group
from gyre.runtime import peers
from gyre.runtime.outputs import write_json

logger = logging.getLogger(__name__)

JOURNAL = "groups.jsonl"


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


def live_group(run_dir: Path, row: dict[str, Any], running: frozenset[str], version: int) -> dict[str, Any] | None:
    """A lost group the execution plane still runs (some executions in `running`, every other one
    ended with its result.json) as a row to carry over and adopt (`live`), else None. Its version is
    capped at the resume's: a group sampled partly by a policy newer than the checkpoint trains
    with the checkpoint's lineage, its staleness counted from there (the loss's ratio uses the
    recorded log-probs)."""
    ids = row["executions"]
    if not any(e in running for e in ids):
        return None
    if not all(e in running or (run_dir / "executions" / e / "result.json").exists() for e in ids):
        return None
    return {**row, "version": min(row["version"], version), "live": True}


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


def attempt_groups(attempt: int, redo_tasks: tuple[str, ...], dataset: Dataset, n: int, *, shuffle: bool,
                   seed: int) -> Iterator[Group]:
    """The groups this attempt dispatches, in order: the tasks of the groups earlier attempts lost
    first, then a fresh task order (seeded). Ids are <task>.a<attempt>.g<k>.<i>: unique over every
    launch into the run directory (a resume, a second resume from the same checkpoint, a restart),
    whose executions/ and tito/ they name."""
    by_id, redo = {t.task_id: t for t in dataset.tasks}, []
    for task_id in redo_tasks:
        if task_id not in by_id:
            logger.warning("task %s of a lost group is no longer in the dataset; not dispatched again", task_id)
            continue
        gid = f"{task_id}.a{attempt}.g{len(redo)}"
        redo.append(Group(gid, by_id[task_id], [ExecutionSpec(f"{gid}.{i}", by_id[task_id], gid, i) for i in range(n)]))
    fresh = dataset.iter_groups(n, shuffle=shuffle, seed=seed,
                                make_id=lambda task, k: f"{task.task_id}.a{attempt}.g{k + len(redo)}")
    return itertools.chain(redo, fresh)


def carriable(carried: tuple[dict[str, Any], ...], dataset: Dataset, n: int) -> list[dict[str, Any]]:
    """Earlier attempts' evaluated groups (journal rows) this attempt can train: its task still in
    the dataset and N unchanged. They take the first dispatch slots; the others are named."""
    known = {t.task_id for t in dataset.tasks}
    rows = [r for r in carried if r["task_id"] in known and len(r["executions"]) == n]
    if len(rows) < len(carried):
        logger.warning("%d groups of earlier attempts cannot be carried over (their task left the dataset, or "
                       "--scheduler.n-per-group changed); they are not trained", len(carried) - len(rows))
    return rows


def carried_group(run_dir: Path, dataset: Dataset, row: dict[str, Any]) -> tuple[Group, list[CarriedResult]]:
    """An earlier attempt's evaluated group (a `groups.jsonl` row) as it was dispatched (its v_d
    the version it was sampled at) and its executions' rewards, read from their result.json (of a
    `live` row, `live_group`: those that have one)."""
    task = next(t for t in dataset.tasks if t.task_id == row["task_id"])
    specs = [ExecutionSpec(e, task, row["group_id"], i, dispatch_version=row["version"])
             for i, e in enumerate(row["executions"])]
    results = []
    for spec in specs:
        path = run_dir / "executions" / spec.execution_id / "result.json"
        if row.get("live") and not path.exists():
            continue  # still running in the execution plane: adopted, not carried
        saved = json.loads(path.read_text())["reward"]
        results.append(CarriedResult(spec.execution_id, spec.index,
                                     RewardResult(spec.execution_id, RewardStatus(saved["status"]), saved["reward"])))
    return Group(row["group_id"], task, specs), results
