"""The cell state machine (docs/design.md §1, §3).

Each cell is either serving rollouts or holding a training actor replica; the transitional
states make the switch visible and measurable:

    ROLLOUT ──► DRAINING ──► JOINING ──► TRAIN ──► RESUMING ──► ROLLOUT
                                │           │          ▲
                                │           └► PUBLISHING (core only, burst end)
                                └──────────────────────┘  (burst ended before it claimed work)
    PUBLISHING ──► TRAIN   (async mode: the core publishes and keeps training)

    ROLLOUT     the cell's engine serves model calls.
    DRAINING    the proxy reroutes the engine's in-flight calls to retained engines; the engine
                releases its memory.
    JOINING     the actor is built or resumed; a satellite pulls the core's current parameter
                snapshot; it becomes TRAIN when it claims its first micro-step.
    TRAIN       claims micro-steps, reduces gradients over the prefix group of the step.
    PUBLISHING  the core, at burst end: writes the new policy version for every engine.
    RESUMING    the engine resumes its memory and loads the published weights.

Any other transition raises `IllegalTransition`. Every transition is recorded with its
timestamp (from an injectable clock) and reported to the controller, whose ledger keeps the
timeline (`timeline_intervals`, `time_per_state`: time per role, the training fractions).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable


class CellState(enum.Enum):
    ROLLOUT = "rollout"
    DRAINING = "draining"
    JOINING = "joining"
    TRAIN = "train"
    PUBLISHING = "publishing"
    RESUMING = "resuming"


LEGAL: dict[CellState, frozenset[CellState]] = {
    CellState.ROLLOUT: frozenset({CellState.DRAINING}),
    CellState.DRAINING: frozenset({CellState.JOINING}),
    CellState.JOINING: frozenset({CellState.TRAIN, CellState.RESUMING}),
    CellState.TRAIN: frozenset({CellState.PUBLISHING, CellState.RESUMING}),
    CellState.PUBLISHING: frozenset({CellState.RESUMING, CellState.TRAIN}),
    CellState.RESUMING: frozenset({CellState.ROLLOUT}),
}

# States in which the cell's GPUs do training work (for the training fractions).
TRAIN_STATES = frozenset({CellState.JOINING, CellState.TRAIN, CellState.PUBLISHING})


class IllegalTransition(RuntimeError):
    pass


def timeline_intervals(transitions: Iterable[tuple[CellState | str, float]], start: float,
                       end: float) -> list[tuple[CellState, float, float]]:
    """A cell's timeline as (state, from, to) intervals: ROLLOUT from `start`, then each
    (destination state, time) transition in order, the last state until `end`. The intervals
    tile [start, end] (zero-length ones included, so every state visited appears).

    Example: [("draining", 3.0), ("joining", 4.0)], 0.0, 10.0 →
    [(ROLLOUT, 0.0, 3.0), (DRAINING, 3.0, 4.0), (JOINING, 4.0, 10.0)].
    """
    out, state, since = [], CellState.ROLLOUT, start
    for dst, t in transitions:
        out.append((state, since, t))
        state, since = CellState(dst), t
    out.append((state, since, end))
    return out


def time_per_state(intervals: Iterable[tuple[CellState, float, float]]) -> dict[str, float]:
    """Seconds per state visited (keys: `CellState.value`, in order of first visit)."""
    acc: dict[str, float] = {}
    for s, a, b in intervals:
        acc[s.value] = acc.get(s.value, 0.0) + (b - a)
    return acc


@dataclass
class Transition:
    cell: int
    src: CellState
    dst: CellState
    time: float
    note: str = ""


@dataclass
class CellStateMachine:
    """State of one cell, with its transition log. Not thread-safe: one owner drives it."""

    cell: int
    clock: Callable[[], float] = time.monotonic
    state: CellState = CellState.ROLLOUT
    log: list[Transition] = field(default_factory=list)

    @property
    def is_core(self) -> bool:
        return self.cell == 0

    def to(self, dst: CellState, note: str = "") -> Transition:
        if dst not in LEGAL[self.state]:
            raise IllegalTransition(f"cell {self.cell}: {self.state.name} → {dst.name} is not a legal transition "
                                    f"(legal: {sorted(s.name for s in LEGAL[self.state])})")
        if dst is CellState.PUBLISHING and not self.is_core:
            raise IllegalTransition(f"cell {self.cell}: only the core publishes")
        t = Transition(self.cell, self.state, dst, self.clock(), note)
        self.state = dst
        self.log.append(t)
        return t
