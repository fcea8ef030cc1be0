"""The end of a run: one ordered sequence, whatever step the run was in (README.md, "What the main job does").

Every end takes it — the last step done, a worker's failure, a health stop, a silent rank, a
write error, SIGINT/SIGTERM — and each phase runs even when an earlier one raised (its error
logged, the next phase goes on):

    1 drain       a run that ended well: executions still running get `train.drain_at_end_s`
                  (only this phase; their evaluations are then waited for in full)
    2 executions  what still runs is stopped (harness trees killed); evaluations get their time
                  (after an interrupt: a share of the stop budget, then they are cancelled)
    3 ranks       every rank is sent Stop; its reports are handled until each has answered. A
                  `StepDone` the core sends from a checkpoint it was writing when the signal came
                  becomes that step's metrics row and journal entries here, so a resume from that
                  checkpoint never trains the step's groups again
    4 outputs     run.json's `ended` record, summary.json, events.jsonl, then the role timeline
    5 close       metrics.jsonl, the proxy; then the groups journal, last: nothing writes after it
    6 the end     a few lines in the log: steps, the reward trend with its interval, executions,
                  aborted calls, where the report is

Bounds: an interrupt bounds the whole sequence (`stop_deadline`: three quarters of
`train.shutdown_timeout_s` after the signal; the rank's own timer forces the exit at the full
budget). The drain's own bound (`drain_at_end_s`) is separate and never shortens the others —
it used to overwrite the interrupt deadline, leaving evaluations 1 s and every rank unwaited-for
(`ranks_not_stopped: [0, 1, 2, 3]` on runs that ended well).

The stop budget and checkpoints: `budget_note` says when the last checkpoint took longer than
the budget leaves it (Slurm's KillWait, 30 s by default, SIGKILLs what is still running after
its SIGTERM); the controller logs it once, at the step that measured it and at an interrupt.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import TYPE_CHECKING, Any, Awaitable, Callable

from gyre.runtime.ledger import GroupPhase
from gyre.runtime.messages import Failed, Stop
from gyre.runtime.outputs import append_events, plot_role_timeline, read_metrics, train_fractions, write_json
from gyre.runtime.rundir import end_attempt
from gyre.runtime.summary import RunEnd, build_summary, end_lines

if TYPE_CHECKING:
    from gyre.runtime.controller import Controller

logger = logging.getLogger(__name__)

# What the stop needs besides the checkpoint: the harness trees' grace, the ranks' answers, the
# outputs (measured: 3-8 s on the CPU path). A checkpoint must fit in the budget less this.
STOP_OVERHEAD_S = 8.0


_INTERRUPTS: list[Any] = []  # this process's `gyre.runtime.control.Interrupts` (gyre.run registers it)


def register(interrupts: Any) -> None:
    """`gyre.run`: the rank's signal handler, whose first signal's time starts the stop budget."""
    _INTERRUPTS[:] = [interrupts]


def signalled_at(now: float) -> float:
    """When this process took its first signal (monotonic), else `now`: the stop budget runs from
    the signal, not from when the controller reads its report (a signal during start-up is read
    only once the controller's loop runs, seconds later)."""
    first = _INTERRUPTS[0].first if _INTERRUPTS else None
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


def checkpointed(previous_s: float | None, took_s: float, budget_s: float) -> float:
    """The core wrote a periodic checkpoint in `took_s`: `budget_note` is logged once, when the
    previous one still fitted the budget (or there was none). Returns `took_s`, the new last."""
    if previous_s is None or budget_note(previous_s, budget_s) is None:
        if (note := budget_note(took_s, budget_s)) is not None:
            logger.warning("%s", note)
    return took_s


def warn_interrupted(signal_name: str, rank: int, budget_s: float, last_checkpoint_s: float | None) -> None:
    """The first interrupt's lines in the log: the stop's budget, and whether the checkpoint fits it."""
    logger.warning("interrupted by %s (rank %d): stopping the run (at most %.0fs)", signal_name, rank, budget_s)
    if (note := budget_note(last_checkpoint_s, budget_s)) is not None:
        logger.warning("%s", note)


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
    """The controller loop's exception handler: a task cancelled by the stop is not an error.
    (asyncio's stream servers call `task.exception()` on their cancelled connection tasks and log
    a CancelledError traceback each — one per harness relay: dozens burying the real error.)"""
    if isinstance(context.get("exception"), asyncio.CancelledError):
        logger.debug("cancelled by the stop: %s", context.get("message"))
        return
    loop.default_exception_handler(context)


def close_loop(loop: asyncio.AbstractEventLoop, timeout: float) -> None:
    """Cancel what is left on the controller's loop and close it, waiting at most `timeout`.

    `asyncio.run` would wait without limit for every task to take its cancellation; one that
    does not (a call stuck in a library) would keep the run from exiting after its summary
    is written. Here it is named in the log and left behind instead.
    """
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


class _Phases:
    """Runs the stop's phases in order; one that raises is logged (once, with what it was) and
    the next runs."""

    def __init__(self) -> None:
        self.failed: list[str] = []

    def run(self, name: str, fn: Callable[[], Any], default: Any = None) -> Any:
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - the rest of the stop must still happen
            self._log(name, e)
            return default

    async def arun(self, name: str, fn: Callable[[], Awaitable[Any]]) -> None:
        try:
            await fn()
        except Exception as e:  # noqa: BLE001
            self._log(name, e)

    def _log(self, name: str, e: BaseException) -> None:
        from gyre.runtime.writes import describe

        self.failed.append(name)
        if isinstance(e, OSError):
            logger.error("stop: %s", describe(e, name))
        else:
            logger.error("stop: %s failed: %s: %s", name, type(e).__name__, e, exc_info=e)


def _handle_reports(ctl: Controller) -> None:
    """Handle every report queued for the controller; one whose handling raises stops nothing
    more (the run is already stopping): its error becomes the run's when it has none."""
    while (msg := ctl.cp.try_recv()) is not None:
        try:
            ctl._on_message(msg)
        except Exception as e:  # noqa: BLE001
            ctl._error(e, f"handling {type(msg).__name__} from rank {msg.rank} during the stop")


async def stop_run(ctl: Controller, failed: bool) -> None:
    """The stop sequence (module docstring). After a failure nothing is waited for beyond a few
    seconds: the error is the news."""
    tc, phases = ctl.cfg.train, _Phases()
    ctl.stopping = True  # nothing is dispatched any more
    # 1 drain: a run that ended well lets its executions finish, within drain_at_end_s.
    in_flight = ctl.runner.in_flight()
    if in_flight and not failed:
        logger.info("run complete; waiting up to %.0fs for %d executions still running", tc.drain_at_end_s, len(in_flight))
        drain_until = time.monotonic() + tc.drain_at_end_s
        while ctl.runner.in_flight() and time.monotonic() < drain_until and ctl.interrupted is None:
            _handle_reports(ctl)
            await asyncio.sleep(0.05)
        failed = failed or ctl.task_error is not None  # a signal or an error while draining
    cancelled = len(ctl.runner.in_flight())
    deadline = stop_deadline(ctl._interrupt_t if ctl.interrupted else None, tc.shutdown_timeout_s)

    # 2 executions: after an interrupt nothing will train on a reward: evaluations in flight are
    # cancelled once the harness trees have had their grace to die.
    grace = None
    if deadline is not None:
        grace = max(1.0, min(ctl.cfg.executions.runner.kill_grace_s + 2.0, 0.5 * (deadline - time.monotonic())))
    await phases.arun("stopping the executions", lambda: ctl.runner.shutdown(evaluate=not failed, timeout=grace))

    # 3 ranks. The core checkpoints after an interrupt or a silent rank too: its weights and
    # optimizer state are sound (not after a worker failed: its state may not be).
    checkpoint = not any(isinstance(m, Failed) for m in ctl.stopped.values())
    for r in range(ctl.topo.world_size):
        phases.run(f"sending Stop to rank {r}", lambda r=r: ctl._command(r, Stop(failed=failed, checkpoint=checkpoint)))
    ctl.stop_sent = True
    await phases.arun("waiting for the ranks", lambda: _wait_for_ranks(ctl, failed, checkpoint, deadline))
    _handle_reports(ctl)  # what came with the last answers (a StepDone behind a Stopped is not possible: FIFO)
    missing = sorted(set(range(ctl.topo.world_size)) - set(ctl.stopped))
    if missing:
        logger.warning("ranks %s did not report stopping", missing)
    if not failed and ctl.task_error is None:  # a clean end: what was not trained is closed, not lost
        phases.run("groups.jsonl (closed groups)", lambda: ctl.journal.closed(
            [r.group_id for r in ctl.ledger.groups.values() if r.phase is not GroupPhase.CONSUMED]))

    # 4 outputs, each on its own; the records first, the plot (matplotlib: seconds on a loaded
    # machine) last, so a stop that runs out of its budget loses the picture, not the records.
    end = time.time()
    intervals = phases.run("the timeline", lambda: ctl.ledger.intervals(end), default={})
    fractions = phases.run("the training fractions", lambda: train_fractions(intervals), default={})
    ctl.summary = phases.run("the summary", lambda: _summary(ctl, end, fractions, cancelled, missing), default={})
    ctl.summary["write_errors_after_the_first"] = ctl.writes.later
    try:  # this attempt's record in run.json; the run's totals over every attempt so far
        ctl.summary["run"] = end_attempt(ctl.run_dir, ctl.attempt, ctl.summary)
    except (OSError, ValueError, LookupError) as e:
        logger.warning("run.json: this attempt's end not recorded (%s); summary.json has no run totals", e)
    phases.run("summary.json", lambda: write_json(ctl.run_dir / "summary.json", ctl.summary))
    # The scheduler's event log: replayable by `python -m gyre.sim --durations.source run-dir`.
    phases.run("events.jsonl", lambda: append_events(ctl.sched.log, str(ctl.run_dir / "events.jsonl"),
                                                     attempt=ctl.attempt, start_version=ctl.start_version))

    phases.run("role_timeline.png", lambda: plot_role_timeline(intervals, str(ctl.run_dir / "role_timeline.png"),
                                                               title=f"Gyre role timeline ({ctl.cfg.scheduler.mode})"))
    phases.run("the trackers' timeline", lambda: _track_timeline(ctl, fractions))

    # 5 close: the journal last (a report handled above may still have written to it).
    phases.run("metrics.jsonl (close)", ctl.metrics.close)
    await phases.arun("the proxy's router", ctl.proxy.router.close)  # calls waiting for an engine end now
    await phases.arun("the proxy", ctl.proxy_handle.astop)
    phases.run("groups.jsonl (close)", ctl.journal.close)

    # 6 the end, for a person.
    for line in end_lines(ctl.summary, ctl.run_dir, phases.failed):
        logger.info("%s", line)


async def _wait_for_ranks(ctl: Controller, failed: bool, checkpoint: bool, deadline: float | None) -> None:
    """Handle reports until every rank has answered its Stop (a failed run: 15 s at most; one
    that ended well: 300 s, a final checkpoint may be large), within the interrupt's deadline."""
    wait_until = time.monotonic() + (15 if failed else 300)
    if deadline is not None:
        wait_until = min(wait_until, deadline)
    world = set(range(ctl.topo.world_size))
    core, silent_told = set(ctl.topo.cell_ranks(0)), False
    while len(ctl.stopped) < ctl.topo.world_size and time.monotonic() < wait_until:
        _handle_reports(ctl)
        if deadline is not None and core <= set(ctl.stopped):
            # Interrupted: the core's checkpoint is what must not be lost; the others have a moment
            # more (one that died is why torchrun sent the signal, and will never answer).
            wait_until = min(wait_until, time.monotonic() + 3.0)
            core = set()
        ctl._check_silent()
        if ctl.silent_rank is not None and ctl.silent_rank not in ctl.stopped:
            # Named in the error; not waited for. Should it thaw, its queue says the run failed
            # (its first Stop may have said otherwise: the run had ended well until now).
            if not silent_told:
                ctl.cp.send(ctl.silent_rank, Stop(failed=True, checkpoint=checkpoint))
                silent_told = True
            if world - set(ctl.stopped) <= {ctl.silent_rank}:
                break  # the others have stopped (a loaded machine may take a moment for them)
        await asyncio.sleep(0.01)


def early_end(run: Any, signal_name: str, why: str = "while the job was starting; stopped before training") -> None:
    """Rank 0 took a signal before the controller could (the job was still starting: no control
    plane yet). The attempt still gets what every stop leaves: summary.json, its line in
    events.jsonl and run.json's `ended` record, saying it stopped before training. Nothing when
    the attempt has its `ended` record already (the controller's stop wrote them)."""
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


def _track_timeline(ctl: Controller, fractions: dict[int, float]) -> None:
    ctl.trackers.log({"train_fraction": {str(c): f for c, f in fractions.items()}}, ctl.steps_done)
    ctl.trackers.image("role_timeline", str(ctl.run_dir / "role_timeline.png"), ctl.steps_done)


def _summary(ctl: Controller, end: float, fractions: dict[int, float], cancelled: int,
             missing: list[int]) -> dict[str, Any]:
    """summary.json from the ledger and its named sources (`gyre.runtime.summary.build_summary`)."""
    try:
        rows = read_metrics(str(ctl.run_dir / "metrics.jsonl"))
    except OSError:
        rows = []
    how = RunEnd(steps=ctl.steps_done, end=end, cancelled_at_end=cancelled, ranks_not_stopped=missing,
                 error=str(ctl.task_error) if ctl.task_error is not None else None, interrupted=ctl.interrupted,
                 silent_rank=ctl.silent_rank, last_checkpoint_s=ctl.last_checkpoint_s)
    return build_summary(ctl.ledger, how, cfg=ctl.cfg, fractions=fractions, router=ctl.proxy.router.stats(),
                         proxy_totals=ctl.access.totals, worst_unmatched=ctl.proxy.worst_unmatched(10),
                         sink_errors=ctl.proxy.sink_errors, health=ctl.health.counts,
                         measured_staleness=ctl.sched.staleness, run=ctl.run, rows=rows)
