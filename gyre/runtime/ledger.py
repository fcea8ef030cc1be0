"""The run's ledger: one record per dispatched group, one per execution, one per optimizer step,
and the cell timeline (docs/design.md §2–3, §5). The controller writes it as events arrive;
`gyre.runtime.summary` reads the step rows and the summary from it. Nothing here does IO (the
TITO reader is passed in), waits, or talks to the scheduler.

An execution's record (`ExecutionRecord`) holds its accounting, in one place: the model calls and
sink errors the proxy counted when it closed it (`closed`), how its harness ended (`finished`),
its reward (`evaluated`) and, when its TITO records are not all its calls, what is missing
(`scored`: then it is excluded from training and from its group's baseline).

A group's record (`GroupRecord`) and its lifecycle:
    RUNNING ──set_work()──► READY ──(its step's close())──► CONSUMED
    (executions run and     (bundles made,           (the update is done; bundles and
     are evaluated)          the scheduler has it)    results dropped, rewards kept)

A step's record (`StepRecord`) and its lifecycle:
    OPEN ──decide()──► REDUCING ──close()──► DONE
    (cells claim its    (the reduce is sent:    (the core's update is done:
     micro-steps, their  membership, groups,     its metrics row is written)
     metrics merge in)   staleness, |E| fixed)

Any other transition raises `LedgerError`. Cell time comes from the state transitions the cells
report, through one function (`gyre.runtime.cell.timeline_intervals`): the per-step `cell_time_s`,
the summary's training fractions and the role-timeline plot all read the same intervals.
"""

from __future__ import annotations

import enum
import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from gyre import dispatch as D
from gyre.runtime.cell import CellState, time_per_state, timeline_intervals
from gyre.executions.tasks import Group
from gyre.runtime.samples import GroupWork, merge_metrics, outcome, summarize_metrics
from gyre.trajectory.advantages import Outcome
from gyre.trajectory.materialize import ScoredExecution

__all__ = ["ExecutionRecord", "GroupPhase", "GroupRecord", "LedgerError", "RunLedger", "StepPhase", "StepRecord",
           "missing_records"]

logger = logging.getLogger(__name__)


class LedgerError(RuntimeError):
    """An event that contradicts the ledger (unknown execution, a record in the wrong phase)."""


class GroupPhase(enum.Enum):
    RUNNING = "running"
    READY = "ready"
    CONSUMED = "consumed"


class StepPhase(enum.Enum):
    OPEN = "open"
    REDUCING = "reducing"
    DONE = "done"


@dataclass
class ExecutionRecord:
    """One dispatched execution's accounting (docs/design.md §5)."""

    execution_id: str
    group: int  # its group's scheduler index
    index: int  # its index in the group
    calls: int | None = None  # model calls the proxy counted when it closed it (None: not closed here)
    sink_errors: int = 0  # of those, call records the proxy failed to write
    outcome: str | None = None  # how its harness ended in this attempt (the runner's Outcome value)
    reward: Any = None  # its RewardResult once evaluated (here, or in an earlier attempt)
    incomplete_tito: str | None = None  # what is missing from its TITO records: excluded from training


def missing_records(calls: int | None, sink_errors: int, records: int, torn: bool) -> str | None:
    """What is missing from an execution's TITO records, None when they are all its calls.

    >>> missing_records(3, 0, 3, False) is None, missing_records(None, 0, 1, False) is None
    (True, True)
    >>> missing_records(3, 0, 2, False)
    '2 TITO records for its 3 calls'
    """
    if sink_errors:
        return f"the proxy could not write {sink_errors} of its {calls} call records"
    if torn:
        return "a torn record at the end of its TITO file"
    if calls is not None and records != calls:
        return f"{records} TITO records for its {calls} calls"
    return None


@dataclass
class GroupRecord:
    """One dispatched group: the spec the runner got, the scheduler's index for it, v_d, its
    evaluated executions and, once ready, its work (bundles, per-execution rewards, stats)."""

    index: int  # the scheduler's group index
    spec: Group  # what was dispatched: N executions of one task
    version: int  # v_d: the latest published version when dispatched
    evaluated: list[Any] = field(default_factory=list)  # runner ExecutionResults, in evaluation order
    work: GroupWork | None = None
    phase: GroupPhase = GroupPhase.RUNNING
    carried: bool = False  # evaluated in an earlier attempt (its results read from the run directory)

    @property
    def group_id(self) -> str:
        return self.spec.group_id

    @property
    def complete(self) -> bool:
        """Every dispatched execution evaluated: the group can be made into work."""
        return len(self.evaluated) == len(self.spec.executions)

    @property
    def rewards(self) -> list[float | None]:
        """Per execution, None when excluded (not in E); [] before the work is made."""
        return self.work.rewards if self.work is not None else []

    def _to(self, phase: GroupPhase) -> None:
        legal = {GroupPhase.RUNNING: GroupPhase.READY, GroupPhase.READY: GroupPhase.CONSUMED}
        if legal.get(self.phase) is not phase:
            raise LedgerError(f"group {self.index}: {self.phase.value} -> {phase.value} is not a legal change")
        self.phase = phase


@dataclass
class StepRecord:
    """One optimizer step: claims and micro-step metrics while OPEN, then what `decide` fixes."""

    step: int
    claims: list[int] = field(default_factory=list)  # cells, in claim order
    metrics: dict[str, float] = field(default_factory=dict)  # merged micro-step loss metrics
    cells: tuple[int, ...] = ()  # the reduce membership (the scheduler's OptimizerStep.cells)
    groups: list[int] = field(default_factory=list)
    final_in_burst: bool = False
    staleness: list[int] = field(default_factory=list)  # d = v_t − v_d per group, in assignment order
    valid: int = 0  # executions with a valid reward: |E|
    grad_scale: float | None = None  # B·N/valid; None: no valid execution, no update
    phase: StepPhase = StepPhase.OPEN

    def loss_metrics(self) -> dict[str, float]:
        """Step-level loss metrics; the micro-steps' summed loss used |E| = B·N, rescaled here."""
        out = summarize_metrics(self.metrics)
        out["loss"] *= self.grad_scale or 0.0
        return out


class RunLedger:
    """Every group and step of a run, and the cell timeline. Not thread-safe: the controller's
    loop is its one writer."""

    def __init__(self, num_cells: int) -> None:
        self.num_cells = num_cells
        self.groups: dict[int, GroupRecord] = {}
        self.steps: dict[int, StepRecord] = {}
        self.transitions: dict[int, list[tuple[str, float]]] = {c: [] for c in range(num_cells)}
        self.t_start: float | None = None  # every cell is in ROLLOUT from here
        self.executions: dict[str, ExecutionRecord] = {}  # every dispatched execution, by id
        # the memory hand-over's parts per switch ("actor_restore", "actor_offload", ...), in arrival order
        self.handovers: dict[str, list[float]] = {}
        # switch latencies as the controller sees them: the switch sent → the cell's answer
        self.switch_latencies: dict[str, list[float]] = {"to_train": [], "to_rollout": []}
        self._switch_sent: dict[int, float] = {}

    def begin(self, t: float) -> None:
        """Start the run's clock: the timeline's origin."""
        self.t_start = t

    # ------------------------------------------------------------------ groups
    def add_group(self, index: int, spec: Group, version: int, carried: bool = False) -> GroupRecord:
        if index in self.groups:
            raise LedgerError(f"group {index} dispatched twice")
        rec = self.groups[index] = GroupRecord(index, spec, version, carried=carried)
        for e in spec.executions:
            if e.execution_id in self.executions:
                raise LedgerError(f"execution {e.execution_id} dispatched twice")
            self.executions[e.execution_id] = ExecutionRecord(e.execution_id, index, e.index)
        return rec

    def execution(self, execution_id: str) -> ExecutionRecord:
        if execution_id not in self.executions:
            raise LedgerError(f"unknown execution {execution_id}")
        return self.executions[execution_id]

    def knows(self, execution_id: str) -> bool:
        """Whether this attempt dispatched (or carried over) the execution."""
        return execution_id in self.executions

    def of_execution(self, execution_id: str) -> tuple[GroupRecord, int]:
        """(its group's record, its index within the group)."""
        e = self.execution(execution_id)
        return self.groups[e.group], e.index

    # ------------------------------------------------------------------ executions
    def closed(self, execution_id: str, calls: int, sink_errors: int = 0) -> None:
        """The proxy closed the execution (its harness ended): its calls and unwritten records."""
        e = self.execution(execution_id)
        e.calls, e.sink_errors = calls, sink_errors

    def finished(self, execution_id: str, outcome: str) -> None:
        """Its harness ended (`outcome`: the runner's Outcome value)."""
        self.execution(execution_id).outcome = outcome

    def evaluated(self, result: Any) -> GroupRecord:
        """Record an evaluated execution (a runner ExecutionResult, or an earlier attempt's
        `gyre.runtime.attempts.CarriedResult`); returns its group."""
        rec, _ = self.of_execution(result.execution_id)
        if rec.phase is not GroupPhase.RUNNING:
            raise LedgerError(f"group {rec.index}: execution {result.execution_id} evaluated while {rec.phase.value}")
        rec.evaluated.append(result)
        self.executions[result.execution_id].reward = result.reward
        return rec

    def scored(self, index: int, read: Callable[[str], tuple[list, bool]]) -> list[ScoredExecution]:
        """The group's evaluated executions in index order, for the trajectory processor.
        `read(execution_id)` → (its TITO records, whether the file's tail was torn). One whose
        records are not all its calls is excluded (`Outcome.eval_failed`, no records), and what
        is missing is kept in its record."""
        out = []
        for result in sorted(self.groups[index].evaluated, key=lambda r: r.index):
            e = self.executions[result.execution_id]
            records, torn = read(e.execution_id)
            e.incomplete_tito = missing_records(e.calls, e.sink_errors, len(records), torn)
            if e.incomplete_tito is None:
                out.append(ScoredExecution(e.execution_id, outcome(result.reward), records=list(records)))
                continue
            logger.warning("execution %s: %s; excluded from training and from its group's baseline (counted in "
                           "summary.json incomplete_tito)", e.execution_id, e.incomplete_tito)
            out.append(ScoredExecution(e.execution_id, Outcome.eval_failed(), records=[]))
        return out

    def outcomes(self) -> dict[str, int]:
        """How this attempt's harnesses ended: outcome → executions."""
        return dict(Counter(e.outcome for e in self.executions.values() if e.outcome is not None))

    def incomplete_tito(self) -> dict[str, str]:
        """Execution → what is missing from its TITO records (excluded from training)."""
        return {e.execution_id: e.incomplete_tito for e in self.executions.values() if e.incomplete_tito is not None}

    @property
    def carried_over(self) -> int:
        """Groups evaluated in an earlier attempt and taken into this one."""
        return sum(g.carried for g in self.groups.values())

    @property
    def zero_advantage_groups(self) -> int:
        """Groups trained in this attempt's steps whose rewards were all equal (no forward/backward)."""
        return sum(g.phase is GroupPhase.CONSUMED and g.work is not None and g.work.zero_advantage
                   for g in self.groups.values())

    def set_work(self, index: int, work: GroupWork) -> None:
        rec = self.groups[index]
        rec._to(GroupPhase.READY)
        rec.work = work

    # ------------------------------------------------------------------ steps
    def step(self, step: int) -> StepRecord:
        """The step's record, opened on first use (a claim or a micro-step's metrics)."""
        if step not in self.steps:
            self.steps[step] = StepRecord(step)
        return self.steps[step]

    def _open(self, step: int) -> StepRecord:
        rec = self.step(step)
        if rec.phase is not StepPhase.OPEN:
            raise LedgerError(f"step {step} is {rec.phase.value}: no more claims or micro-steps")
        return rec

    def claim(self, step: int, cell: int) -> None:
        self._open(step).claims.append(cell)

    def merge_metrics(self, step: int, metrics: dict[str, float]) -> None:
        merge_metrics(self._open(step).metrics, metrics)

    def decide(self, step: int, cells: Sequence[int], groups: Sequence[int], final_in_burst: bool,
               valid: int, grad_scale: float | None) -> StepRecord:
        """The reduce is sent: fix the step's membership, groups, staleness and |E|."""
        rec = self._open(step)
        rec.cells, rec.groups, rec.final_in_burst = tuple(cells), list(groups), final_in_burst
        rec.staleness = [D.staleness(step, self.groups[g].version) for g in groups]
        rec.valid, rec.grad_scale = valid, grad_scale
        rec.phase = StepPhase.REDUCING
        return rec

    def close(self, step: int) -> StepRecord:
        """The step's update is done: its groups are consumed (their bundles are dropped)."""
        rec = self.step(step)
        if rec.phase is not StepPhase.REDUCING:
            raise LedgerError(f"step {step} closed while {rec.phase.value}")
        rec.phase = StepPhase.DONE
        for g in rec.groups:
            grp = self.groups[g]
            grp._to(GroupPhase.CONSUMED)
            grp.work.bundles = []  # sent out as blobs long ago; rewards and stats stay
            grp.evaluated = []
        return rec

    def step_fields(self, step: int, end: float) -> dict[str, Any]:
        """The ledger's part of a closed step's metrics.jsonl row (docs/design.md §2: staleness)."""
        rec = self.steps[step]
        by_group = [[r for r in self.groups[g].rewards if r is not None] for g in rec.groups]
        rewards = [r for g in by_group for r in g]
        counts = Counter(rec.claims)
        return {
            # the latest switch each way, as the controller saw it (None before the first)
            "switch_to_train_s": self._latest(self.switch_latencies["to_train"]),
            "switch_to_rollout_s": self._latest(self.switch_latencies["to_rollout"]),
            "cells_in_step": len(rec.cells),
            "claims_by_cell": {str(c): counts[c] for c in sorted(counts)},
            "claim_order": list(rec.claims),
            "final_in_burst": rec.final_in_burst,
            "groups": len(rec.groups),
            "reward_mean": float(np.mean(rewards)) if rewards else None,
            "reward_count": len(rewards),
            "executions_valid": rec.valid,
            "rewards": rewards,
            "group_rewards": by_group,
            "staleness_mean": float(np.mean(rec.staleness)) if rec.staleness else None,
            "staleness": list(rec.staleness),
            # selected trajectories of the step's groups that claimed no target (docs/design.md §5)
            "dropped_trajectories": sum(self.groups[g].work.dropped_trajectories for g in rec.groups),
            # groups whose rewards were all equal: no micro-steps, no forward/backward (docs/design.md §5)
            "zero_advantage_groups": sum(self.groups[g].work.zero_advantage for g in rec.groups),
            "cell_time_s": self.cell_times(end),
            # the latest switch's memory hand-over on a cell's first rank (None before the first)
            "actor_restore_s": self._last("actor_restore"),
            "actor_offload_s": self._last("actor_offload"),
            **rec.loss_metrics(),
        }

    def staleness_by_step(self) -> dict[str, list[int]]:
        """d of every group of every decided step (a step still reducing at the end included)."""
        return {str(s): r.staleness for s, r in sorted(self.steps.items()) if r.phase is not StepPhase.OPEN}

    # ------------------------------------------------------------------ memory hand-over
    def handover(self, parts: dict[str, float]) -> None:
        """One switch's parts in seconds (a Joined / RolledBack report's `handover_s`)."""
        for k, v in parts.items():
            self.handovers.setdefault(k, []).append(float(v))

    def switch_sent(self, cell: int, t: float) -> None:
        self._switch_sent[cell] = t

    def switched(self, cell: int, direction: str, t: float) -> None:
        """The cell answered its switch ("to_train" / "to_rollout"): its latency (0 when unsent)."""
        self.switch_latencies[direction].append(t - self._switch_sent.pop(cell, t))

    @staticmethod
    def _latest(seen: list[float] | None) -> float | None:
        return seen[-1] if seen else None

    def _last(self, part: str) -> float | None:
        return self._latest(self.handovers.get(part))

    def handover_summary(self) -> dict[str, dict[str, float]]:
        """part → {mean, max, count} over the run (the summary's `handover_s`; the paper reports
        8.52 s and 3.46 s for its two switch directions at 122B)."""
        return {k: {"mean": float(np.mean(v)), "max": float(np.max(v)), "count": len(v)}
                for k, v in sorted(self.handovers.items()) if v}

    # ------------------------------------------------------------------ timeline
    def transition(self, cell: int, dst: str, t: float) -> None:
        self.transitions[cell].append((dst, t))

    def intervals(self, end: float) -> dict[int, list[tuple[CellState, float, float]]]:
        """cell → [(state, start, end)] tiling [t_start, end], ROLLOUT first."""
        if self.t_start is None:
            raise LedgerError("the ledger's clock was never started (begin)")
        return {c: timeline_intervals(self.transitions[c], self.t_start, end) for c in range(self.num_cells)}

    def cell_times(self, end: float) -> dict[str, dict[str, float]]:
        """cell → seconds per state visited (as metrics.jsonl's `cell_time_s`)."""
        return {str(c): time_per_state(ivs) for c, ivs in self.intervals(end).items()}
