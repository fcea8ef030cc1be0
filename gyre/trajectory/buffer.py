"""Group buffer: finished groups wait here until a training step takes them (docs/design.md §2).

A group (one query run N times) is registered when its executions are dispatched, with its
dispatch version v_d (the latest *published* policy version at dispatch). It becomes READY when
every execution has finished and been scored. `take(B)` hands out ready groups **oldest dispatch
version first** (ties: the group that became ready first). When a step consumes a group at
trainer version v_t (the version just before the step), its staleness is d = v_t − v_d.

Lifecycle of a group (`GroupState`), transitions allowed and nothing else (others raise):

    PENDING  --all executions finished-->  READY
    READY    --take()-------------------->  ASSIGNED
    ASSIGNED --release() (step abandoned)->  READY
    ASSIGNED --consume(v_t)-------------->  CONSUMED

Thread-safe: one lock guards all state (the proxy / evaluator threads call `finish`, the
scheduler calls `num_ready` and `take`).
"""

from __future__ import annotations

import enum
import itertools
import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Sequence

from gyre.trajectory.advantages import Outcome

logger = logging.getLogger(__name__)

__all__ = ["ExecutionResult", "Group", "GroupBuffer", "GroupState", "IllegalTransition"]


class IllegalTransition(RuntimeError):
    pass


class GroupState(enum.Enum):
    PENDING = "pending"
    READY = "ready"
    ASSIGNED = "assigned"
    CONSUMED = "consumed"


_ALLOWED = {
    (GroupState.PENDING, GroupState.READY),
    (GroupState.READY, GroupState.ASSIGNED),
    (GroupState.ASSIGNED, GroupState.READY),
    (GroupState.ASSIGNED, GroupState.CONSUMED),
}


@dataclass
class ExecutionResult:
    """What a finished execution leaves behind: its outcome and where its TITO records are."""

    execution_id: str
    outcome: Outcome
    tito_path: str | None = None  # store file (gyre.trajectory.store)
    records: list[Any] | None = None  # or the CallRecords themselves (tests, in-process runs)
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class Group:
    group_id: str
    dispatch_version: int  # v_d
    execution_ids: list[str]
    results: dict[str, ExecutionResult] = field(default_factory=dict)
    state: GroupState = GroupState.PENDING
    ready_seq: int = -1  # order in which groups became ready (tie-break)
    consumed_version: int | None = None  # v_t when consumed

    def _to(self, new: GroupState) -> None:
        if (self.state, new) not in _ALLOWED:
            raise IllegalTransition(f"group {self.group_id}: {self.state.name} -> {new.name} is not allowed")
        self.state = new

    def staleness(self, train_version: int) -> int:
        """d = v_t − v_d for a step at trainer version `train_version`."""
        return int(train_version) - self.dispatch_version

    def ordered_results(self) -> list[ExecutionResult]:
        return [self.results[e] for e in self.execution_ids]


class GroupBuffer:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._groups: dict[str, Group] = {}
        self._exec_to_group: dict[str, str] = {}
        self._ready_counter = itertools.count()
        self._staleness: list[int] = []

    def dispatch(self, group_id: str, dispatch_version: int, execution_ids: Sequence[str]) -> Group:
        if not execution_ids:
            raise ValueError(f"group {group_id}: execution_ids is empty")
        if len(set(execution_ids)) != len(execution_ids):
            raise ValueError(f"group {group_id}: duplicate execution ids")
        with self._lock:
            if group_id in self._groups:
                raise ValueError(f"group {group_id} already dispatched")
            for e in execution_ids:
                if e in self._exec_to_group:
                    raise ValueError(f"execution {e} already belongs to group {self._exec_to_group[e]}")
            g = Group(group_id, int(dispatch_version), list(execution_ids))
            self._groups[group_id] = g
            for e in execution_ids:
                self._exec_to_group[e] = group_id
            return g

    def finish(self, result: ExecutionResult) -> Group:
        """Record a finished (scored or failed) execution; returns its group."""
        with self._lock:
            gid = self._exec_to_group.get(result.execution_id)
            if gid is None:
                raise KeyError(f"execution {result.execution_id} was never dispatched")
            g = self._groups[gid]
            if result.execution_id in g.results:
                raise ValueError(f"execution {result.execution_id} already finished")
            if g.state is not GroupState.PENDING:
                raise IllegalTransition(f"group {gid} is {g.state.name}; cannot add a result")
            g.results[result.execution_id] = result
            if len(g.results) == len(g.execution_ids):
                g._to(GroupState.READY)
                g.ready_seq = next(self._ready_counter)
            return g

    def num_ready(self) -> int:
        with self._lock:
            return sum(1 for g in self._groups.values() if g.state is GroupState.READY)

    def num_pending(self) -> int:
        with self._lock:
            return sum(1 for g in self._groups.values() if g.state is GroupState.PENDING)

    def take(self, n: int) -> list[Group]:
        """Up to `n` ready groups, oldest dispatch version first; they become ASSIGNED."""
        with self._lock:
            ready = sorted(
                (g for g in self._groups.values() if g.state is GroupState.READY),
                key=lambda g: (g.dispatch_version, g.ready_seq),
            )[: max(n, 0)]
            for g in ready:
                g._to(GroupState.ASSIGNED)
            return ready

    def release(self, groups: Sequence[Group]) -> None:
        """Give assigned groups back (their step was abandoned); they keep their place."""
        with self._lock:
            for g in groups:
                self._groups[g.group_id]._to(GroupState.READY)

    def consume(self, groups: Sequence[Group], train_version: int) -> list[int]:
        """Mark groups consumed by the step at trainer version v_t; returns their staleness."""
        with self._lock:
            out = []
            for g in groups:
                gg = self._groups[g.group_id]
                gg._to(GroupState.CONSUMED)
                gg.consumed_version = int(train_version)
                out.append(gg.staleness(train_version))
            self._staleness.extend(out)
            for g in groups:  # forget consumed groups so the buffer does not grow without bound
                for e in self._groups[g.group_id].execution_ids:
                    self._exec_to_group.pop(e, None)
                del self._groups[g.group_id]
            return out

    def mean_staleness(self) -> float | None:
        """Measured E[d] over every consumed group so far (None before the first)."""
        with self._lock:
            return sum(self._staleness) / len(self._staleness) if self._staleness else None
