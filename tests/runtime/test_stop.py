"""The stop without a job: the sequence's phase order, budget and silent rank with fakes for the
controller, the runner and the records (gyre.runtime.stop); write errors become one stated error
(gyre.runtime.writes); the checkpoint's failure and cut note (gyre.checkpoint). The real-run
cases are tests/faults/test_stop_edges.py and tests/faults/test_signals.py."""

import asyncio
import errno
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest

from gyre.errors import RunFailed
from gyre import checkpoint
from gyre.runtime.messages import Stop, Stopped
from gyre.runtime.stop import budget_note, quiet_cancelled
from gyre.runtime.writes import FirstError, Guarded, WatchedSink, WriteFailed, watch_execution


def _enospc(path=None):
    return OSError(errno.ENOSPC, "No space left on device", *([str(path)] if path else []))


def test_the_first_write_error_is_the_runs_naming_path_and_errno_and_later_ones_are_counted():
    first = FirstError()
    err = first.note(_enospc(), "execution t0.a0.g0.0's result", "/run/executions/t0.a0.g0.0/result.json")
    assert isinstance(err, WriteFailed) and isinstance(err, RunFailed)
    assert "/run/executions/t0.a0.g0.0/result.json" in str(err) and "ENOSPC (errno 28)" in str(err)
    assert "--train.resume" in str(err)
    assert first.note(_enospc("/run/metrics.jsonl"), "metrics.jsonl") is None and first.later == 1
    assert first.error is err


def test_guarded_writes_and_the_tito_sink_report_their_errors(tmp_path):
    seen = []
    on_error = lambda exc, what, path: seen.append((type(exc).__name__, what, str(path)))  # noqa: E731
    f = open(tmp_path / "m.jsonl", "a")
    f.close()
    guarded = Guarded(f, "metrics.jsonl", tmp_path / "m.jsonl", on_error)
    with pytest.raises(ValueError):  # a write after close: reported, and still raised
        guarded.write("x")
    assert seen == [("ValueError", "metrics.jsonl", str(tmp_path / "m.jsonl"))]

    class Full:
        def on_record(self, record):
            raise _enospc()

        def close_execution(self, execution_id):
            seen.append(("closed", execution_id, ""))

    sink = WatchedSink(Full(), lambda e: tmp_path / f"{e}.tito", on_error)
    with pytest.raises(OSError) as raised:  # raised on, marked: the proxy counts it against e1, logs no traceback
        sink.on_record(SimpleNamespace(execution_id="e1"))
    assert raised.value.reported
    sink.close_execution("e1")
    assert seen[1:] == [("OSError", "the TITO record of execution e1", str(tmp_path / "e1.tito")), ("closed", "e1", "")]


def test_an_execution_tasks_exception_is_reported_and_its_cancellation_is_not():
    seen = []

    async def main():
        async def fails():
            raise _enospc("/r/executions/x/result.json")

        async def sleeps():
            await asyncio.sleep(10)

        a, b = asyncio.create_task(fails()), asyncio.create_task(sleeps())
        watch_execution(a, "x", Path("/r/executions/x"), lambda exc, what, path: seen.append((exc.filename, what)))
        watch_execution(b, "y", Path("/r/executions/y"), lambda exc, what, path: seen.append(what))
        await asyncio.sleep(0.01)
        b.cancel()
        await asyncio.sleep(0.01)

    asyncio.run(main())
    assert seen == [("/r/executions/x/result.json", "execution x's result")]


def test_a_failed_checkpoint_write_names_its_path_and_a_cut_one_is_named(tmp_path):
    def full(tmp):
        raise _enospc()

    with pytest.raises(WriteFailed, match=r"checkpoint step_000003 .*\.step_000003\.tmp.*ENOSPC"):
        checkpoint.write(tmp_path, 3, full)
    assert checkpoint.cut_note() is None and not (tmp_path / "step_000003").exists()

    notes = []

    def save(tmp):
        notes.append(checkpoint.cut_note())  # what a forced exit now would say
        (Path(tmp) / checkpoint.MODEL).write_bytes(b"w")
        (Path(tmp) / checkpoint.META).write_text('{"version": 4}')

    checkpoint.write(tmp_path, 4, save)
    assert "version 4 was being written" in notes[0] and "--train.shutdown-timeout-s" in notes[0]
    assert checkpoint.cut_note() is None and checkpoint.last_write_s is not None
    assert checkpoint.check(tmp_path / "step_000004") is None


def test_the_budget_warning_names_the_flag_and_slurms_killwait():
    assert budget_note(None, 25.0) is None and budget_note(10.0, 25.0) is None
    note = budget_note(40.0, 25.0)
    assert "took 40s" in note and "--train.shutdown-timeout-s to at least 48" in note and "KillWait" in note


def test_a_cancelled_task_in_a_callback_logs_no_traceback(caplog):
    loop = asyncio.new_event_loop()
    try:
        with caplog.at_level(logging.DEBUG):
            quiet_cancelled(loop, {"message": "Exception in callback", "exception": asyncio.CancelledError()})
            assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
            quiet_cancelled(loop, {"message": "boom", "exception": RuntimeError("real")})
            assert [r for r in caplog.records if r.levelno >= logging.ERROR]
    finally:
        loop.close()


def test_a_signal_during_start_up_still_ends_the_attempt_once(tmp_path):
    """stop.early_end: summary, the attempt's events line and run.json's `ended`; nothing when the
    controller's stop already wrote them (a forced exit after a finished stop)."""
    import json

    from gyre.runtime.attempts import write_manifest
    from gyre.runtime.rundir import RunDir
    from gyre.runtime.stop import early_end

    write_manifest(tmp_path, {"preset": "x"}, 2)
    early_end(RunDir(tmp_path, attempt=0, start_version=0), "SIGTERM")
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["interrupted"] == "SIGTERM" and "while the job was starting" in summary["error"]
    assert summary["steps"] == 0 and summary["run"]["attempts_not_ended"] == []
    ended = json.loads((tmp_path / "run.json").read_text())["attempts"][0]["ended"]
    assert ended["interrupted"] == "SIGTERM"
    assert (tmp_path / "events.jsonl").read_text().count('"kind": "attempt"') == 1
    early_end(RunDir(tmp_path, attempt=0, start_version=0), "SIGINT", "again")  # already ended: nothing
    assert json.loads((tmp_path / "summary.json").read_text())["interrupted"] == "SIGTERM"
    assert (tmp_path / "events.jsonl").read_text().count('"kind": "attempt"') == 1


def test_the_stop_budget_runs_from_this_processs_own_signal():
    from gyre.runtime import stop

    class Interrupts:
        first = None

    it = Interrupts()
    assert stop.signalled_at(None, 100.0) == 100.0  # no handler (a test's controller): the report's arrival
    assert stop.signalled_at(it, 100.0) == 100.0  # no signal here
    it.first = ("SIGTERM", 80.0)
    assert stop.signalled_at(it, 100.0) == 80.0  # taken 20 s before the controller read it
    assert stop.stop_deadline(80.0, 25.0) == 80.0 + 18.75


# ---------------------------------------------------------------- the stop sequence, with fakes
class _Clock:
    """stop.py's `time`: monotonic() moves on by `step` at each read (no wall clock in the test)."""

    def __init__(self, step: float = 0.0) -> None:
        self.t, self.step = 1000.0, step

    def monotonic(self) -> float:
        self.t += self.step
        return self.t

    def time(self) -> float:
        return 5000.0


class _Ranks:
    """The controller as the stop sees it (`stop.Ranks`): ranks in `answer` report Stopped to
    their Stop; `silent` is named by check_silent; Stop to `broken` raises."""

    def __init__(self, log, ending, world=3, core=(0,), answer=None, silent=None, broken=None):
        self.world_size, self.core_ranks, self.log, self.ending = world, frozenset(core), log, ending
        self.answer = set(range(world)) if answer is None else set(answer)
        self.silent, self.broken, self.queue, self.sent = silent, broken, [], []

    def send_stop(self, rank, msg):
        if rank == self.broken:
            raise ConnectionError(f"rank {rank}'s mailbox")
        self.sent.append((rank, msg))
        self.log.append(f"stop {rank}")
        if rank in self.answer:
            self.queue.append(Stopped(cell=None, rank=rank))

    def pump_reports(self):
        while self.queue:
            msg = self.queue.pop(0)
            self.ending.stopped[msg.rank] = msg
            self.log.append(f"stopped {msg.rank}")

    def check_silent(self):
        if self.silent is not None and self.ending.silent_rank is None:
            self.ending.silent_rank = self.silent
            self.ending.fail(RunFailed(f"rank {self.silent} is silent"))


class _Runner:
    def __init__(self, log, in_flight=0, raises=False, survives=False):
        self.log, self.running, self.raises, self.survives = log, in_flight, raises, survives

    async def detach(self):
        self.log.append(f"detach with {self.running} running")

    def in_flight(self):
        return list(range(self.running))

    async def shutdown(self, evaluate, timeout):
        self.log.append(f"executions evaluate={evaluate} timeout={timeout}")
        if self.raises:
            raise RuntimeError("a harness tree would not die")
        self.running = 0


class _Records:
    steps, path = 4, Path("runs/x")

    def __init__(self, log):
        self.log, self.how = log, None

    def finish(self, how, phases):
        self.log.append("finish")
        self.how = how
        return {"steps": how.steps, "wall_s": 1.0}

    def close(self, phases):
        self.log.append("records closed")


def _stop(monkeypatch, ranks, runner, records, ending, budget=None, closers=(), clock=None):
    from gyre.runtime import stop

    monkeypatch.setattr(stop, "time", clock or _Clock())
    budget = budget or stop.Budget(drain_s=0.0, shutdown_s=20.0, kill_grace_s=5.0)
    return asyncio.run(stop.stop_run(ranks, runner, records, ending, budget, close=closers))


def _closer(log, name, raises=False):
    async def close():
        log.append(name)
        if raises:
            raise OSError(errno.EIO, "gone")
    return name, close


def test_the_stop_phases_run_in_order_and_the_journal_closes_last(monkeypatch):
    """executions, Stop to every rank, their answers, the end files, the data plane, the records."""
    from gyre.runtime.stop import Ending

    log, ending = [], Ending()
    ranks, records = _Ranks(log, ending), _Records(log)
    summary = _stop(monkeypatch, ranks, _Runner(log), records, ending,
                    closers=[_closer(log, "router"), _closer(log, "proxy")])
    assert log == ["executions evaluate=True timeout=None", "stop 0", "stop 1", "stop 2",
                   "stopped 0", "stopped 1", "stopped 2", "finish", "router", "proxy", "records closed"]
    assert ending.stopping and ending.stop_sent and summary == {"steps": 4, "wall_s": 1.0}
    assert all(m == Stop(failed=False, checkpoint=True) for _, m in ranks.sent)
    how = records.how
    assert (how.steps, how.end, how.ranks_not_stopped, how.error, how.cancelled_at_end) == (4, 5000.0, [], None, 0)


def test_a_phase_that_raises_does_not_stop_the_later_ones(monkeypatch, caplog):
    from gyre.runtime.stop import Ending

    log, ending = [], Ending()
    ending.fail(RunFailed("a worker failed"))  # a failed run: 15 s for the ranks, no evaluations
    ranks = _Ranks(log, ending, broken=1)
    with caplog.at_level(logging.INFO, logger="gyre"):
        _stop(monkeypatch, ranks, _Runner(log, in_flight=2, raises=True), _Records(log), ending,
              closers=[_closer(log, "router", raises=True), _closer(log, "proxy")], clock=_Clock(step=1.0))
    assert log == ["executions evaluate=False timeout=None", "stop 0", "stop 2", "stopped 0", "stopped 2",
                   "finish", "router", "proxy", "records closed"]
    assert "ranks [1] did not report stopping" in caplog.text
    (end,) = [r.message for r in caplog.records if r.message.startswith("not written at the end")]
    assert end == ("not written at the end: stopping the executions, sending Stop to rank 1, router (errors above)")
    assert all(m == Stop(failed=True, checkpoint=True) for _, m in ranks.sent)


def test_a_clean_end_drains_and_an_interrupt_bounds_the_stop(monkeypatch):
    """drain_s only for a run that ended well; after a signal, the harnesses' grace is a share of
    what is left of the budget, and a budget already spent waits for no rank."""
    from gyre.runtime.stop import Budget, Ending

    log, ending = [], Ending()
    clock = _Clock(step=1.0)
    records = _Records(log)
    _stop(monkeypatch, _Ranks(log, ending), _Runner(log, in_flight=2), records, ending,
          budget=Budget(drain_s=5.0, shutdown_s=20.0, kill_grace_s=5.0), clock=clock)
    assert records.how.cancelled_at_end == 2  # still running after the drain's 5 s (the clock's reads)
    assert log[0] == "executions evaluate=True timeout=None"

    # A signal 2 s ago, budget 20 s: the deadline is 15 s after it; grace = min(5 + 2, half the 13 s left).
    log, ending, clock = [], Ending(), _Clock()
    ending.interrupt("SIGTERM", 0, clock.t - 2.0, 20.0)
    ending.fail(RunFailed("interrupted"))
    _stop(monkeypatch, _Ranks(log, ending), _Runner(log), _Records(log), ending, clock=clock)
    assert log[0] == "executions evaluate=False timeout=6.5" and "stopped 2" in log

    # The signal came 30 s ago: the budget is spent; grace is the minimum, no rank is waited for.
    log, ending, clock = [], Ending(), _Clock()
    ending.interrupt("SIGTERM", 0, clock.t - 30.0, 20.0)
    ending.fail(RunFailed("interrupted"))
    records = _Records(log)
    _stop(monkeypatch, _Ranks(log, ending, answer=()), _Runner(log), records, ending, clock=clock)
    assert log[0] == "executions evaluate=False timeout=1.0"
    assert records.how.ranks_not_stopped == [0, 1, 2] and records.how.interrupted == "SIGTERM"


def test_an_interrupt_leaves_the_executions_to_a_plane_that_outlives_rank_0(monkeypatch):
    """--executions.plane process: a signal (torchrun stopping the workers to restart them) detaches
    from the plane, its executions run on and none is cancelled; a run that ends well, or fails
    without a signal, still stops them (planted: detach whenever the plane survives -> the second
    case fails; never detach -> the first fails)."""
    from gyre.runtime.stop import Ending

    log, ending, clock = [], Ending(), _Clock()
    ending.interrupt("SIGTERM", 1, clock.t, 20.0)
    ending.fail(RunFailed("interrupted"))
    records = _Records(log)
    _stop(monkeypatch, _Ranks(log, ending), _Runner(log, in_flight=3, survives=True), records, ending, clock=clock)
    assert log[0] == "detach with 3 running" and not any(x.startswith("executions") for x in log)
    assert records.how.cancelled_at_end == 0

    for fail in (False, True):
        log, ending = [], Ending()
        if fail:
            ending.fail(RunFailed("a worker failed"))
        records = _Records(log)
        _stop(monkeypatch, _Ranks(log, ending), _Runner(log, in_flight=2, survives=True), records, ending,
              clock=_Clock(step=1.0))
        assert log[0] == f"executions evaluate={not fail} timeout=None" and not any(x.startswith("detach") for x in log)


def test_after_an_interrupt_the_others_get_a_moment_once_the_core_has_stopped(monkeypatch):
    from gyre.runtime.stop import Ending

    log, ending, clock = [], Ending(), _Clock(step=0.5)
    ending.interrupt("SIGINT", 2, clock.t, 100.0)  # the deadline: 75 s after the signal
    ending.fail(RunFailed("interrupted"))
    records = _Records(log)
    _stop(monkeypatch, _Ranks(log, ending, answer=(0,)), _Runner(log), records, ending, clock=clock)
    assert records.how.ranks_not_stopped == [1, 2]
    assert clock.t < ending.signal_t + 15.0  # 3 s after the core, not the 75 s deadline nor the 15 s of a failure


def test_a_silent_rank_is_told_the_run_failed_and_not_waited_for(monkeypatch):
    """The run ended well, then rank 2 went silent during the stop: the run fails naming it,
    it gets a second Stop saying so, and the stop does not wait out the 300 s of a clean end."""
    from gyre.runtime.stop import Ending

    log, ending, clock = [], Ending(), _Clock(step=1.0)
    ranks, records = _Ranks(log, ending, answer=(0, 1), silent=2), _Records(log)
    _stop(monkeypatch, ranks, _Runner(log), records, ending, clock=clock)
    assert ranks.sent[:3] == [(r, Stop(failed=False, checkpoint=True)) for r in range(3)]
    assert ranks.sent[3:] == [(2, Stop(failed=True, checkpoint=True))]
    assert records.how.silent_rank == 2 and records.how.ranks_not_stopped == [2]
    assert records.how.error == "rank 2 is silent" and clock.t < 1000.0 + 15.0


def test_a_failed_worker_means_no_checkpoint():
    from gyre.runtime.messages import Failed
    from gyre.runtime.stop import Ending

    log, ending = [], Ending()
    ending.stopped[1] = Failed(cell=1, rank=1, command="Reduce", error="RuntimeError: x")
    ending.fail(RunFailed("rank 1 failed"))
    ranks = _Ranks(log, ending, answer=(0, 2))
    with pytest.MonkeyPatch.context() as mp:
        _stop(mp, ranks, _Runner(log), _Records(log), ending)
    assert {m for _, m in ranks.sent} == {Stop(failed=True, checkpoint=False)}


def test_the_ending_keeps_the_first_error_and_signal_and_warns_on_a_slow_checkpoint_once(caplog):
    from gyre.runtime.stop import Ending

    e = Ending()
    e.fail(None)  # a later write error whose first was already the run's: stopping, no error of its own
    e.fail(RunFailed("first"))
    e.fail(RunFailed("second"))
    assert e.stopping and str(e.error) == "first"
    assert e.interrupt("SIGTERM", 1, 50.0, 25.0) and not e.interrupt("SIGINT", 0, 60.0, 25.0)
    assert (e.signal, e.signal_t) == ("SIGTERM", 50.0)
    with caplog.at_level(logging.WARNING):
        for took in (2.0, 30.0, 31.0, 2.0, 40.0):  # the note when a checkpoint stops fitting, not every step
            e.checkpointed(took, 25.0)
    notes = [r.message.split(",")[0] for r in caplog.records if r.message.startswith("the last checkpoint")]
    assert notes == ["the last checkpoint took 30s", "the last checkpoint took 40s"]
    how = e.run_end(3, 9.0, 1, [2])
    assert (how.error, how.interrupted, how.last_checkpoint_s, how.ranks_not_stopped) == ("first", "SIGTERM", 40.0, [2])
