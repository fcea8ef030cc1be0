"""One call from scored groups to micro-steps: load → tree → select → advantages → pack.

`materialize_step(groups, ...)` takes `ScoredGroup`s (a group's executions with their outcomes
and TITO records); the runtime calls it once per finished group (`gyre.runtime.samples.group_work`),
offline tools with a whole step's B groups. Excluded executions (evaluation failed) are left out
of E. A group whose valid rewards are all equal (zero advantage: it teaches nothing) makes no
micro-steps by default (`skip_zero_advantage`, as slime and verl filter such groups): no forward or
backward is spent on it, yet its valid executions stay in |E|, so every other token weight
−A_i/(|E|·L_i) is the same as with the group packed at weight 0 (docs/design.md §6). It is
reported in `all_equal_groups` either way. (Which ready group a step takes is the scheduler's business: its heap hands
them out oldest dispatch version first, docs/design.md §2.)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from gyre.trajectory.advantages import Outcome, group_advantages
from gyre.trajectory.microstep import MicroStep
from gyre.trajectory.packing import ExecutionSample, pack_step
from gyre.trajectory.selection import Selection, select_trajectories
from gyre.trajectory.store import load_execution
from gyre.trajectory.tree import PrefixTree, build_tree

logger = logging.getLogger(__name__)

__all__ = ["ScoredExecution", "ScoredGroup", "StepBatch", "materialize_step"]


@dataclass
class ScoredExecution:
    """A finished execution as the trajectory processor sees it: its outcome and its TITO records
    (given, or read from `tito_path`)."""

    execution_id: str
    outcome: Outcome
    tito_path: str | None = None  # store file (gyre.trajectory.store)
    records: list[Any] | None = None  # or the CallRecords themselves (the runtime, tests)


@dataclass
class ScoredGroup:
    """One query's N scored executions, in execution order, with its dispatch version v_d."""

    group_id: str
    dispatch_version: int  # v_d
    executions: list[ScoredExecution]

    def staleness(self, train_version: int) -> int:
        """d = v_t − v_d for a step at trainer version `train_version`."""
        return int(train_version) - self.dispatch_version


@dataclass
class StepBatch:
    micro_steps: list[MicroStep]
    samples: list[ExecutionSample]  # the step's execution table, in order
    excluded: list[str] = field(default_factory=list)  # evaluation failed: not in E
    all_equal_groups: list[str] = field(default_factory=list)  # zero signal
    empty_groups: list[str] = field(default_factory=list)  # no valid execution
    dropped_trajectories: int = 0  # chosen trajectories that claimed no target
    tree_stats: dict[str, dict] = field(default_factory=dict)  # execution id → TreeStats.as_dict()
    staleness: list[int] = field(default_factory=list)  # per group, when train_version is given

    @property
    def num_tokens(self) -> int:
        return sum(m.num_tokens for m in self.micro_steps)

    @property
    def num_targets(self) -> int:
        return sum(m.num_targets for m in self.micro_steps)


def _records(res: ScoredExecution):
    if res.records is not None:
        return res.records
    if res.tito_path is None:
        return []
    return load_execution(res.tito_path)


def materialize_step(
    groups: Sequence[ScoredGroup],
    *,
    max_tokens: int,
    rng: np.random.Generator,
    j_max: int | None = 5,
    normalize_std: bool = True,
    skip_zero_advantage: bool = True,
    step: int = 0,
    train_version: int | None = None,
    num_executions: int | None = None,
    context_parallel_size: int = 1,
) -> StepBatch:
    """Materialize scored groups into micro-steps of at most `max_tokens` tokens.

    |E| = the valid executions of `groups` (those of skipped all-equal groups included: skipping
    them changes no other weight), unless the caller fixes it with `num_executions` (a
    streaming step packs each group as it becomes ready and uses the nominal B·N).
    `skip_zero_advantage=False` packs all-equal groups too, every token weight 0. An execution
    without records (e.g. a harness that failed before its first call) is in the table with
    L_i = 0 and contributes no tokens. `context_parallel_size`: see `pack_step`.
    """
    batch = StepBatch(micro_steps=[], samples=[])
    skipped = 0  # valid executions of skipped all-equal groups: still in |E|
    for g in groups:
        results = g.executions
        ga = group_advantages([r.outcome for r in results], normalize_std=normalize_std)
        if ga.all_equal:
            batch.all_equal_groups.append(g.group_id)
        if ga.empty:
            batch.empty_groups.append(g.group_id)
        if train_version is not None:
            batch.staleness.append(g.staleness(train_version))
        skip = skip_zero_advantage and ga.all_equal
        for res, a, ok in zip(results, ga.advantages, ga.valid):
            if not ok:
                batch.excluded.append(res.execution_id)
                continue
            if skip:
                skipped += 1
                continue
            records = _records(res)
            if not records:
                logger.info("execution %s has no records; it stays in E with L_i = 0", res.execution_id)
                batch.samples.append(ExecutionSample(res.execution_id, PrefixTree.empty(res.execution_id),
                                                   Selection(res.execution_id, [], 0, 0, j_max), float(a)))
                continue
            tree = build_tree(records)
            sel = select_trajectories(tree, j_max, rng)
            batch.dropped_trajectories += sel.dropped
            batch.tree_stats[res.execution_id] = tree.stats.as_dict()
            batch.samples.append(ExecutionSample(res.execution_id, tree, sel, float(a)))
    if batch.samples:
        n_exec = len(batch.samples) + skipped if num_executions is None else num_executions
        batch.micro_steps = pack_step(batch.samples, max_tokens, step=step, num_executions=n_exec,
                                      context_parallel_size=context_parallel_size)
    return batch

