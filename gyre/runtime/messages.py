"""The controller ⇄ worker protocol: typed commands and reports (docs/design.md §1, §3).

Every rank runs a `gyre.runtime.worker.CellWorker`; rank 0 also runs the controller
(`gyre.runtime.controller.Controller`) in its own thread. They talk through the mailboxes of
`gyre.runtime.control.ControlPlane`, which pickles whatever it is given: the messages below are frozen
dataclasses, and each side dispatches them through one explicit table (`CellWorker.HANDLERS`,
`Controller.HANDLERS`), so a grep for `Reduce` finds its sender and its handler
`def _on_reduce(self, msg: Reduce)`. A message type without a handler raises `UnknownMessage`.

The two loops and what each waits for:

* The **worker** (`gyre.runtime.job`, every rank's main thread) blocks on `control.recv()` for the next
  command; only the controller unblocks it. Inside a command it waits on other ranks only in two
  places: the blob of a `TrainWork` (put by the controller before the command is sent, so it is
  there), and the collectives of a `Reduce` (every rank of cells 0..k−1 at the same position
  enters them; the controller sends `Reduce` to all of those cells at once, so the last one to
  arrive unblocks the others).
* The **controller** (rank 0's thread, an asyncio loop) never blocks on a worker: it polls its
  mailbox every few milliseconds (`cp.try_recv()`), feeds each report to the scheduler, carries
  out the scheduler's decisions as commands, and retries the cells whose work requests could not
  be served yet. Only at the end does it wait, with a deadline, for every rank's `Stopped`.

Cell reports (`Transition`, `Joined`, `RequestWork`, `WorkDone`, `StepDone`, `RolledBack`,
`Loaded`) come from a cell's first rank only, one per cell; `StepDone` from the core only;
`Stopped`, `Failed` and `Interrupted` from every rank. A cell's states are `gyre.runtime.cell.CellState`.
Every command that is answered is watched (`gyre.runtime.control.ReplyWatch`): a rank that owes
a report and sends nothing for `--train.control-timeout-s` (frozen) fails the run, named.

    controller (rank 0 thread, polls)              worker (every rank, blocks on recv)
    ─────────────────────────────────              ───────────────────────────────────
    SwitchToTrain(c): the proxy drains c's engine
        ── ToTrain() ─────────────────────────▶  ROLLOUT → DRAINING (engine releases) →
                                                  JOINING (actor ready; a satellite pulls the
                                                  core's current snapshot from the board)
        ◀── Transition ×2, Joined(version), RequestWork
    pending cell, scheduler grants (step, group, item): bundle put under `key` first
        ── TrainWork(step, group, item, key, version) ─▶  take the blob, train it (JOINING →
                                                  TRAIN on the first)
        ◀── [Transition], WorkDone(step, group, item, metrics), RequestWork
    OptimizerStep(step): to every rank of cells 0..k−1
        ── Reduce(step, k, final, stay, grad_scale, trained) ▶
                                                  all-reduce gradients over prefix group k
                                                  (blocks until cells 0..k−1 all enter); the
                                                  core scales, steps, puts the snapshot on the
                                                  board; unless the burst ends here, a broadcast
                                                  of the new parameters over the same group.
                                                  Not trained (all groups all-equal): no
                                                  reduce, no update, the snapshot as it was
        ◀── [Transition → PUBLISHING], StepDone(step, stats) (core),
            RequestWork (cells that keep training)
    SwitchToRollout(c)
        ── ToRollout(version) ───────────────────▶  → RESUMING (engine resumes, loads the
                                                  published version) → ROLLOUT
        ◀── Transition ×2, RolledBack(version)
    Publish(version): rollout cells and pool engines
        ── Load(version) ────────────────────────▶  the engine loads it between decode steps
        ◀── Loaded(version)
    the run's end, or a failure: every rank
        ── Stop(failed, checkpoint) ─────────────▶  checkpoint (core, not after a failure unless
                                                  `checkpoint`), stop the engine, leave the loop
        ◀── Stopped()
    a handler raised on some rank                 that rank reports, then exits
        ◀── Failed(command, error)                (the controller stops every other rank)
    SIGINT/SIGTERM on some rank                   its handler reports; it serves on until Stop
        ◀── Interrupted(signal)                   (the controller stops the run gracefully,
                                                  Stop(failed, checkpoint=True), summary says so)
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar


class UnknownMessage(TypeError):
    """A message whose type has no handler on the side that received it."""


def handler_for(table: dict[type, Callable], msg: Any, where: str) -> Callable:
    """The handler `table` holds for `type(msg)`; UnknownMessage if none."""
    handler = table.get(type(msg))
    if handler is None:
        known = ", ".join(sorted(t.__name__ for t in table))
        raise UnknownMessage(f"{where}: no handler for {type(msg).__name__} ({msg!r}); it handles {known}")
    return handler


# ----------------------------------------------------------------------------- reports
@dataclasses.dataclass(frozen=True, kw_only=True)
class Report:
    """A rank → the controller's mailbox (`gyre.runtime.control.CONTROLLER`)."""

    cell: int | None  # None on a standalone-pool rank
    rank: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class Transition(Report):
    """The cell's state machine moved (`gyre.runtime.cell.CellState` values); the controller's timeline."""

    src: str
    dst: str
    t: float  # wall-clock time of the transition


@dataclasses.dataclass(frozen=True, kw_only=True)
class Joined(Report):
    """The cell is ready to train (JOINING), its actor at `version`. `handover_s`: seconds of the
    switch's parts on this rank (engine_release, actor_restore, snapshot)."""

    version: int
    handover_s: dict[str, float] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RequestWork(Report):
    """The cell can take the next micro-step bundle."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class WorkDone(Report):
    """A `TrainWork` was trained; its loss metrics (summed over the bundle) and compute time."""

    step: int
    group: int
    item: int
    metrics: dict[str, float]


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepDone(Report):
    """The core finished the optimizer step of `step` (version step + 1 is on the board)."""

    step: int
    stats: dict[str, float]  # the actor's update stats; {} on a satellite


@dataclasses.dataclass(frozen=True, kw_only=True)
class RolledBack(Report):
    """The cell is back in ROLLOUT, its engine at `version`. `handover_s`: seconds of the
    switch's parts on this rank (actor_offload, engine_resume, engine_load)."""

    version: int
    handover_s: dict[str, float] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Loaded(Report):
    """The engine loaded `version` (newer than asked when the asked one left the board)."""

    version: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class Stopped(Report):
    """The rank stopped (its checkpoint, when it writes one, is complete)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Failed(Report):
    """A handler raised on this rank; it exits after this report (the traceback is in its log)."""

    command: str | None  # the command's type name
    error: str  # "ExceptionType: message"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Interrupted(Report):
    """The rank got SIGINT/SIGTERM (Ctrl-C, scancel, torchrun forwarding one): the controller runs
    the graceful stop (harnesses killed, ranks stopped, checkpoint, summary) and the run exits
    non-zero. The rank keeps serving commands until its `Stop`."""

    signal: str  # "SIGINT" / "SIGTERM"


# ----------------------------------------------------------------------------- commands
@dataclasses.dataclass(frozen=True, kw_only=True)
class Command:
    """Controller → a rank's mailbox. `reply`: the report that answers it (None: none), from the
    first rank of the cell or pool engine it went to; `Reduce` is answered by the core alone,
    `Stop` by every rank (`gyre.runtime.control.ReplyWatch` holds the debts)."""

    reply: ClassVar[type[Report] | None] = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class ToTrain(Command):
    """Leave rollout: release the engine, get the actor ready, join the training set."""

    reply: ClassVar[type[Report] | None] = Joined


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainWork(Command):
    """Train one micro-step bundle of the scheduler's `Work(step, group, item)`."""

    reply: ClassVar[type[Report] | None] = WorkDone

    step: int
    group: int
    item: int
    key: str  # the blob the bundle was put under (`ControlPlane.take_blob`)
    version: int  # the policy version the step trains at (a satellite behind pulls it from the board)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Reduce(Command):
    """Sum gradients over the prefix group of cells 0..k−1; the core steps (docs/design.md §3, §6)."""

    reply: ClassVar[type[Report] | None] = StepDone

    step: int
    k: int  # cells in the step: the prefix group 0..k−1
    final: bool  # the burst's last step: its version is published
    stay: bool = False  # async mode: training cells keep training after a publish
    grad_scale: float | None  # B·N / |E| for the core's update; None: nothing valid, no update
    trained: bool = True  # False: no group of the step made a micro-step (all rewards equal in each):
    # zero gradients everywhere, so no cell reduces and the core makes no update


@dataclasses.dataclass(frozen=True, kw_only=True)
class ToRollout(Command):
    """Back to rollout: the engine resumes and loads published `version`."""

    reply: ClassVar[type[Report] | None] = RolledBack

    version: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class Load(Command):
    """A rollout engine loads published `version` between decode steps."""

    reply: ClassVar[type[Report] | None] = Loaded

    version: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class Stop(Command):
    """Report, checkpoint (the core, unless `failed` and not `checkpoint`), stop the engine, leave the loop."""

    reply: ClassVar[type[Report] | None] = Stopped

    failed: bool = False  # the controller stopped the run early (it reports why)
    checkpoint: bool = False  # checkpoint even though failed (an interrupt: the weights are sound)


COMMANDS: tuple[type[Command], ...] = (ToTrain, TrainWork, Reduce, ToRollout, Load, Stop)
REPORTS: tuple[type[Report], ...] = (Transition, Joined, RequestWork, WorkDone, StepDone, RolledBack, Loaded,
                                     Stopped, Failed, Interrupted)
