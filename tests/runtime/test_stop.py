"""The stop's parts without a job: write errors become one stated error (gyre.runtime.writes), the
checkpoint's failure, timing and cut note (gyre.checkpoint), the stop budget's warning
and the end-of-run lines (gyre.runtime.stop). The real-run cases are tests/faults/test_stop_edges.py."""

import asyncio
import errno
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest

from gyre.errors import RunFailed
from gyre import checkpoint
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

    from gyre.runtime.rundir import RunDir, write_manifest
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
    stop.register(it)
    try:
        assert stop.signalled_at(100.0) == 100.0  # no signal here: the report's arrival
        it.first = ("SIGTERM", 80.0)
        assert stop.signalled_at(100.0) == 80.0  # taken 20 s before the controller read it
        assert stop.stop_deadline(80.0, 25.0) == 80.0 + 18.75
    finally:
        stop.register(None)
        stop._INTERRUPTS.clear()
