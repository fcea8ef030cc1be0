"""Clocks, decisions and the event log shared by the simulator and the runtime.

Clocks: `SimClock` is advanced explicitly (the simulator sets it to each event's time; tests
advance it by hand, no sleeps); `WallClock` reads `time.monotonic()`. Both are callables
returning seconds, so they also fit `gyre.runtime.cell.CellStateMachine(clock=...)`.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from collections.abc import Sequence
from typing import Any, Iterator, Protocol


class Clock(Protocol):
    def now(self) -> float: ...

    def __call__(self) -> float: ...


class WallClock:
    """Monotonic wall time in seconds."""

    def now(self) -> float:
        return time.monotonic()

    def __call__(self) -> float:
        return self.now()


class SimClock:
    """Simulated time; only moves when told to, and never backwards."""

    def __init__(self, start: float = 0.0) -> None:
        self._t = float(start)

    def now(self) -> float:
        return self._t

    def __call__(self) -> float:
        return self._t

    def set(self, t: float) -> None:
        if t < self._t:
            raise ValueError(f"SimClock cannot go back in time: {t} < {self._t}")
        self._t = float(t)

    def advance(self, dt: float) -> None:
        self.set(self._t + dt)


# ----------------------------------------------------------------------------- decisions
@dataclass(frozen=True)
class Dispatch:
    """Start `n_groups` new groups (ids first_group..first_group+n_groups−1, N executions each)
    at published version `version`."""

    first_group: int
    n_groups: int
    version: int

    @property
    def groups(self) -> range:
        return range(self.first_group, self.first_group + self.n_groups)


@dataclass(frozen=True)
class SwitchToTrain:
    """Cell leaves ROLLOUT (its in-flight calls are rerouted) and becomes a training replica."""

    cell: int


@dataclass(frozen=True)
class SwitchToRollout:
    """Cell leaves training (burst end) and serves rollouts again with the published weights."""

    cell: int


@dataclass(frozen=True)
class OptimizerStep:
    """All work of `step` is done: `cells` = (0, …, k−1), the cells in the TRAIN prefix when the
    step was decided, reduce over prefix group k — the reduce membership, decided only here
    (every cell that trained part of the step is in it; one that switched in after the last
    claim joins with zero gradients). `groups`: the step's B groups, in assignment order. The core
    clips and steps. Report `on_step_done(step)` when the update (and, on a non-final step of a
    burst, the parameter send to satellites) is finished."""

    step: int
    cells: tuple[int, ...]
    final_in_burst: bool
    groups: tuple[int, ...] = ()


@dataclass(frozen=True)
class Publish:
    """Burst end: the core publishes `version` to every engine."""

    version: int


@dataclass(frozen=True)
class Work:
    """A work grant: cell may train micro-step `item` of group `group` in step `step`."""

    step: int
    group: int
    item: int


Decision = Dispatch | SwitchToTrain | SwitchToRollout | OptimizerStep | Publish


# ----------------------------------------------------------------------------- log
@dataclass
class Event:
    t: float
    kind: str
    data: dict[str, Any] = field(default_factory=dict)

    def __getitem__(self, key: str) -> Any:
        return self.data[key]


def _event(row: tuple) -> Event:
    return Event(row[0], row[1], dict(zip(row[2], row[3])))


class _Events(Sequence):
    """`EventLog.events`: its rows as `Event`s, made when read."""

    def __init__(self, rows: list) -> None:
        self._rows = rows

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [_event(r) for r in self._rows[i]]
        return _event(self._rows[i])

    def __len__(self) -> int:
        return len(self._rows)


class EventLog:
    """Append-only list of (time, kind, data). Kinds written by the scheduler:

    dispatch(first_group, n_groups, version, w)
    exec_start(group, execution)   exec_finish(group, execution)   group_ready(group, version)
    tick(w, C_R, k, ready, supply_ticks)
    switch_to_train(cell, w, C_R, k, ready, supply_ticks)   switch_done(cell, role)
    switch_superseded(cell)   switch_to_rollout(cell)
    assign(group, step, version, d)   claim(cell, step, group, item)
    item_done(cell, step)   all_claimed(step, cells)   optimizer_step(step, cells, participants, final)
    step_done(step)   publish(version)

    w, C_R, k are the water level, the rollout capacity and the cells out of rollout *after*
    the event; ready is the number of ready, unassigned groups.

    Rows are kept as plain tuples, (t, kind, keys, values), and shown as `Event`s when
    read: tuples of floats, strs and numbers are objects the garbage collector stops tracking
    (a dict, even of numbers only, would keep its row tracked), so a full
    collection does not walk every event of the run (an `Event` object per row made each gen-2
    pause grow with the log: ~0.4 s at 0.9M events in benchmarks/scale_bench.py's K = 256).
    """

    def __init__(self, keep_ticks: bool = True) -> None:
        self._rows: list[tuple[float, str, tuple[str, ...], tuple[Any, ...]]] = []
        self.keep_ticks = keep_ticks

    def add(self, t: float, kind: str, **data: Any) -> None:
        if kind == "tick" and not self.keep_ticks:
            return
        self._rows.append((t, kind, tuple(data), tuple(data.values())))

    @property
    def events(self) -> "_Events":
        """The events so far, oldest first (a read-only sequence of `Event`)."""
        return _Events(self._rows)

    def of(self, *kinds: str) -> list[Event]:
        return [_event(r) for r in self._rows if r[1] in kinds]

    def __iter__(self) -> Iterator[Event]:
        return (_event(r) for r in self._rows)

    def __len__(self) -> int:
        return len(self._rows)

    def write_jsonl(self, path: str) -> None:
        with open(path, "w") as fh:
            for e in self.events:
                fh.write(json.dumps({"t": e.t, "kind": e.kind, **e.data}) + "\n")
