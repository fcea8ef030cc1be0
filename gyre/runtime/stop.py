"""The end of a run: one ordered sequence, whatever step the run was in (docs/design.md §1).

Every end takes it: the last step done, a worker's failure, a health stop, a silent rank, a
write error, SIGINT/SIGTERM. Each phase runs even when an earlier one raised (logged, the next
goes on):

    1 drain       a run that ended well: executions still running get `train.drain_at_end_s`
    2 executions  what still runs is stopped (harness trees killed); evaluations get their time
                  (after an interrupt: a share of the stop budget, then they are cancelled)
    3 ranks       every rank is sent Stop; its reports are handled until each has answered (a
                  `StepDone` from a checkpoint written meanwhile becomes that step's row here)
    4 outputs     the records' end files (`RunRecords.finish`): summary, run.json, events, plot
    5 close       the data plane, then the records (the groups journal last)
    6 the end     a few lines in the log: steps, the reward trend, executions, where the report is

An interrupt bounds the whole sequence (`stop_deadline`: three quarters of
`train.shutdown_timeout_s` after the signal; the rank's own timer forces the exit at the full
budget); the drain's bound is its own. `budget_note` warns when the last checkpoint does not fit
the budget (Slurm's KillWait SIGKILLs what still runs after its SIGTERM).

It sees the controller as `Ranks`, how the run is ending as `Ending`, what it writes as
`gyre.runtime.records.RunRecords` (tests/runtime/test_stop.py runs it with fakes).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Collection, Protocol, Sequence

from gyre.runtime.messages import Failed, Stop
from gyre.runtime.outputs import read_metrics, write_json
from gyre.runtime.records import Phases, RunRecords
from gyre.runtime.attempts import end_attempt
from gyre.runtime.summary import RunEnd, end_lines

logger = logging.getLogger(__name__)

# What the stop needs besides the checkpoint: the harness trees' grace, the ranks' answers, the
# outputs (measured: 3-8 s on the CPU path). A checkpoint must fit in the budget less this.
STOP_OVERHEAD_S = 8.0


def signalled_at(interrupts: Any, now: float) -> float:
    """When this process took its first signal (monotonic; `interrupts`: its
    `gyre.runtime.control.Interrupts`), else `now`: the stop budget runs from the signal, not from
    when the controller reads its report (a signal during start-up is read seconds later)."""
    first = getattr(interrupts, "first", None)
    return min(now, first[1]) if first is not None else now


def stop_deadline(interrupted_at: float | None, budget_s: float) -> float | None:
    """The monotonic time the stop must be done by after an interrupt (None: not interrupted):
    three quarters of the budget for the harnesses, the ranks and the outputs, the rest slack
    before the rank's own timer forces the exit."""
    return None if interrupted_at is None else interrupted_at + 0.75 * budget_s


def budget_note(checkpoint_s: float | None, budget_s: float) -> str | None:
    """A warning when the last checkpoint took longer than a graceful stop leaves it (None: fits).

    >>> budget_note(2.0, 25.0) is None
    True
    >>> "KillWait" in budget_note(30.0, 25.0)
    True
    """
    if checkpoint_s is None or checkpoint_s + STOP_OVERHEAD_S <= budget_s:
        return None
    return (f"the last checkpoint took {checkpoint_s:.0f}s, but a graceful stop (SIGTERM: scancel, preemption, "
            f"Ctrl-C) has {budget_s:.0f}s for it and about {STOP_OVERHEAD_S:.0f}s more: a stop would cut the final "
            f"checkpoint (the previous complete one is resumed from, its later steps lost). Raise "
            f"--train.shutdown-timeout-s to at least {checkpoint_s + STOP_OVERHEAD_S:.0f} and the time the "
            f"scheduler grants after SIGTERM with it (Slurm's KillWait, 30 s by default, or --signal=B:TERM@N; "
            f"see docs/cluster.md)")


def silent_error(rank: int, command: type, quiet: float, limit: float) -> str:
    """The run's error when `rank` owes an answer to `command` and has said nothing for `quiet` s."""
    return (f"rank {rank} has sent nothing for {quiet:.0f}s while it owes an answer to {command.__name__} "
            f"(--train.control-timeout-s {limit:g}): it is frozen or gone (SIGSTOP, a hung collective or "
            f"driver, a lost node); stopping the run")


def stop_every_rank(store: Any, world_size: int, checkpoint: bool) -> None:
    """The controller raised before the stop sequence sent Stop: tell every rank, over a fresh
    connection, that the run failed (so none waits for a command forever)."""
    from gyre.runtime.control import CONTROLLER, ControlPlane

    cp = ControlPlane(store.clone(), CONTROLLER)
    for r in range(world_size):
        cp.send(r, Stop(failed=True, checkpoint=checkpoint))


def quiet_cancelled(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """The controller loop's exception handler: a task cancelled by the stop is not an error (the
    stream servers' cancelled connection tasks would log a traceback per harness relay)."""
    if isinstance(context.get("exception"), asyncio.CancelledError):
        logger.debug("cancelled by the stop: %s", context.get("message"))
        return
    loop.default_exception_handler(context)


def close_loop(loop: asyncio.AbstractEventLoop, timeout: float) -> None:
    """Cancel what is left on the controller's loop and close it, waiting at most `timeout`: a task
    that does not take its cancellation (a call stuck in a library) is named and left behind."""
    tasks = [t for t in asyncio.all_tasks(loop) if not t.done()]
    for t in tasks:
        t.cancel()
    if tasks:
        _, stuck = loop.run_until_complete(asyncio.wait(tasks, timeout=timeout))
        if stuck:
            logger.warning("controller: %d tasks did not stop within %.0fs and are abandoned: %s", len(stuck), timeout,
                           ", ".join(sorted(t.get_name() for t in stuck)))
    loop.run_until_complete(loop.shutdown_asyncgens())
    loop.close()


@dataclass
class Budget:
    """What bounds the stop, in seconds."""
    drain_s: float  # train.drain_at_end_s: a run that ended well lets its executions finish
    shutdown_s: float  # train.shutdown_timeout_s: the whole stop, from a signal
    kill_grace_s: float  # executions.runner.kill_grace_s: a harness tree's time to die


@dataclass
class Ending:
    """How the run is ending, gathered as it happens; `run_end` is its final form (`summary.RunEnd`)."""

    stopping: bool = False  # nothing more is dispatched; the loop ends
    error: BaseException | None = None  # the first error: the run's
    signal: str | None = None  # "SIGTERM" once a rank reported one (the first report counts)
    signal_t: float = 0.0  # when this process took it (monotonic): the stop budget runs from it
    silent_rank: int | None = None  # a rank past train.control_timeout_s: named, not waited for
    stopped: dict[int, Any] = field(default_factory=dict)  # rank -> its Stopped or Failed
    stop_sent: bool = False  # every rank has been sent Stop
    last_checkpoint_s: float | None = None  # the core's last periodic checkpoint's write

    def fail(self, error: BaseException | None) -> None:
        """Stop the run; the first error becomes the run's."""
        if self.error is None:
            self.error = error
        self.stopping = True

    def interrupt(self, signal: str, rank: int, at: float, budget_s: float) -> bool:
        """A signal reported by `rank`, taken at `at`: True (and its lines in the log) for the first."""
        if self.signal is not None:
            return False
        self.signal, self.signal_t = signal, at
        logger.warning("interrupted by %s (rank %d): stopping the run (at most %.0fs)", signal, rank, budget_s)
        if (note := budget_note(self.last_checkpoint_s, budget_s)) is not None:
            logger.warning("%s", note)
        return True

    def checkpointed(self, took_s: float, budget_s: float) -> None:
        """The core wrote a periodic checkpoint in `took_s`: `budget_note` is logged when the
        previous one still fitted the budget (once, not at every step)."""
        if budget_note(self.last_checkpoint_s, budget_s) is None and (note := budget_note(took_s, budget_s)):
            logger.warning("%s", note)
        self.last_checkpoint_s = took_s

    def run_end(self, steps: int, end: float, cancelled: int, missing: list[int]) -> RunEnd:
        return RunEnd(steps=steps, end=end, cancelled_at_end=cancelled, ranks_not_stopped=missing,
                      error=str(self.error) if self.error is not None else None, interrupted=self.signal,
                      silent_rank=self.silent_rank, last_checkpoint_s=self.last_checkpoint_s)


class Ranks(Protocol):
    """What the stop needs of the controller: its ranks and their reports."""

    world_size: int
    core_ranks: Collection[int]  # the core cell's: its checkpoint is what an interrupt must not lose

    def send_stop(self, rank: int, stop: Stop) -> None: ...

    def pump_reports(self) -> None:
        """Handle every queued report (a `Stopped` lands in `Ending.stopped`)."""

    def check_silent(self) -> None:
        """Fail the run (`Ending.silent_rank`) when a rank owes a report past the control timeout."""


async def stop_run(ranks: Ranks, runner: Any, records: RunRecords, ending: Ending, budget: Budget,
                   close: Sequence[tuple[str, Callable[[], Awaitable[Any]]]] = ()) -> dict[str, Any]:
    """The stop sequence (module docstring); `runner`: the data plane (`in_flight`, `shutdown`: `proxy_access.DataPlane`);
    `close`: the data plane's closers, named, run before the records close. Returns the summary.
    After a failure nothing is waited for beyond a few seconds: the error is the news."""
    phases, failed = Phases(), ending.error is not None
    ending.stopping = True  # nothing is dispatched any more
    # 1 drain: a run that ended well lets its executions finish, within drain_s.
    if (in_flight := runner.in_flight()) and not failed:
        logger.info("run complete; waiting up to %.0fs for %d executions still running", budget.drain_s, len(in_flight))
        drain_until = time.monotonic() + budget.drain_s
        while runner.in_flight() and time.monotonic() < drain_until and ending.signal is None:
            ranks.pump_reports()
            await asyncio.sleep(0.05)
        failed = ending.error is not None  # a signal or an error while draining
    deadline = stop_deadline(ending.signal_t if ending.signal else None, budget.shutdown_s)
    # 2 executions. Interrupted, with an execution plane that outlives rank 0: they run on there, and
    # a restart adopts them (a job that never comes back: the plane's own bound ends them).
    if ending.signal is not None and runner.survives:
        logger.warning("%d executions run on in the execution plane; a restart adopts them", len(runner.in_flight()))
        cancelled = 0
        await phases.arun("leaving the executions to the execution plane", runner.detach)
    else:
        cancelled = len(runner.in_flight())
        await _stop_executions(runner, phases, budget, failed, deadline)

    # 3 ranks. The core checkpoints after an interrupt or a silent rank too: its weights and
    # optimizer state are sound (not after a worker failed: its state may not be).
    checkpoint = not any(isinstance(m, Failed) for m in ending.stopped.values())
    for r in range(ranks.world_size):
        phases.run(f"sending Stop to rank {r}", lambda r=r: ranks.send_stop(r, Stop(failed=failed, checkpoint=checkpoint)))
    ending.stop_sent = True
    await phases.arun("waiting for the ranks", lambda: _wait_for_ranks(ranks, ending, failed, checkpoint, deadline))
    ranks.pump_reports()  # what came with the last answers (a StepDone behind a Stopped is not possible: FIFO)
    missing = sorted(set(range(ranks.world_size)) - set(ending.stopped))
    if missing:
        logger.warning("ranks %s did not report stopping", missing)

    # 4 outputs, 5 close (the data plane, then the records: the journal last), 6 the end.
    summary = records.finish(ending.run_end(records.steps, time.time(), cancelled, missing), phases)
    for name, fn in close:
        await phases.arun(name, fn)
    records.close(phases)
    for line in end_lines(summary, records.path, phases.failed):
        logger.info("%s", line)
    return summary


async def _stop_executions(runner: Any, phases: Phases, budget: Budget, failed: bool, deadline: float | None) -> None:
    """After an interrupt nothing will train on a reward: evaluations in flight are cancelled once
    the harness trees have had their grace to die."""
    grace = None
    if deadline is not None:
        grace = max(1.0, min(budget.kill_grace_s + 2.0, 0.5 * (deadline - time.monotonic())))
    await phases.arun("stopping the executions", lambda: runner.shutdown(evaluate=not failed, timeout=grace))


async def _wait_for_ranks(ranks: Ranks, ending: Ending, failed: bool, checkpoint: bool,
                          deadline: float | None) -> None:
    """Handle reports until every rank has answered its Stop (a failed run: 15 s at most; one
    that ended well: 300 s, a final checkpoint may be large), within the interrupt's deadline."""
    wait_until = time.monotonic() + (15 if failed else 300)
    if deadline is not None:
        wait_until = min(wait_until, deadline)
    world = set(range(ranks.world_size))
    core, silent_told = set(ranks.core_ranks), False
    while len(ending.stopped) < ranks.world_size and time.monotonic() < wait_until:
        ranks.pump_reports()
        if deadline is not None and core and core <= set(ending.stopped):
            # Interrupted: the core's checkpoint is what must not be lost; the others have a moment
            # more (one that died is why torchrun sent the signal, and will never answer).
            wait_until = min(wait_until, time.monotonic() + 3.0)
            core = set()
        ranks.check_silent()
        if (silent := ending.silent_rank) is not None and silent not in ending.stopped:
            # Not waited for. Should it thaw, its queue says the run failed (its first Stop may
            # have said otherwise: the run had ended well until now).
            if not silent_told:
                ranks.send_stop(silent, Stop(failed=True, checkpoint=checkpoint))
                silent_told = True
            if world - set(ending.stopped) <= {silent}:
                break  # the others have stopped (a loaded machine may take a moment for them)
        await asyncio.sleep(0.01)


def early_end(run: Any, signal_name: str, why: str = "while the job was starting; stopped before training") -> None:
    """Rank 0 took a signal before the controller could (no control plane yet): the attempt still
    gets summary.json, its events.jsonl line and run.json's `ended` record, saying it stopped
    before training. Nothing when it has its `ended` record (the controller's stop wrote them)."""
    attempts = json.loads((run.path / "run.json").read_text())["attempts"]
    if attempts[run.attempt].get("ended"):
        return
    try:  # the steps whose rows were written (a forced exit may come after some)
        steps = len(read_metrics(str(run.path / "metrics.jsonl")))
    except (OSError, ValueError):
        steps = run.start_version
    summary: dict[str, Any] = {
        "steps": max(steps, run.start_version), "wall_s": 0.0, "attempt": run.attempt, "execution_outcomes": {},
        "error": f"interrupted by {signal_name} {why}",
        "interrupted": signal_name, "ranks_not_stopped": [], "lost_in_flight": run.lost_in_flight,
        "redispatched_groups": len(run.redo_tasks), "carried_over_groups": 0}
    summary["run"] = end_attempt(run.path, run.attempt, summary)
    write_json(run.path / "summary.json", summary)
    with open(run.path / "events.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps({"t": time.time(), "kind": "attempt", "attempt": run.attempt, "version": run.start_version})
                + "\n")
    logger.error("%s (summary: %s)", summary["error"], run.path / "summary.json")
