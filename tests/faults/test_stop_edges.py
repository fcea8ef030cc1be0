"""No run lost at the edges of its stop (issue 36 items 1-2, issue 35 item 5): real jobs (torchrun,
2 gloo ranks, the tiny model), asserting on the run directory.

* SIGTERM while the core writes a checkpoint (slowed by the test-only GYRE_TEST_SLOW_CHECKPOINT_S
  so the signal lands inside the write). Before: the stop closed the groups journal, then the
  core's StepDone for that step raised `I/O operation on closed file`: no summary, events, plot
  or `ended` record, and the step's metrics row and journal entries were lost, so its groups were
  trained again on resume. Now: all there, and the resume (a run that ends well with harnesses
  still running at its end) trains no group twice and waits for every rank (before: the drain's
  deadline overwrote the stop's, `ranks_not_stopped` named every rank).
* (slow) A full disk under the executions (a small tmpfs): before, ENOSPC writing result.json killed
  the execution tasks unnoticed and the run waited forever. Now it stops with one error naming
  the file and the errno, leaves its summary, and resumes once space is freed.
* (slow) 20 SIGTERMs at seeded random times into one run directory, each relaunch resuming it:
  every attempt that started leaves summary, events and an `ended` record; no group is trained
  twice over all of them.
"""

import json
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path

import pytest

from gyre import checkpoint
from tests.jobs import (AWK_EVALUATOR, RUNS, SLEEPER, reap, rows, start, tiny_task, wait_for,
                        write_task_rows)

pytestmark = [pytest.mark.multirank, pytest.mark.jobs]


def _tasks(path: Path, marker: str | None = None) -> Path:
    """Tiny tasks, and with a marker one sleeper (never ends on its own: something is always in
    flight at the end; the scheduler's next dispatch then waits for it, so only for short runs)."""
    sleeper = {"harness": [sys.executable, str(SLEEPER), marker], "evaluator": {"command": AWK_EVALUATOR}}
    return write_task_rows(path, [tiny_task(1, 8), tiny_task(1, 8), *([sleeper] if marker else []), tiny_task(1, 8)])


def _cmd(tasks: Path, run: Path, steps: int, *extra: str) -> list[str]:
    return RUNS["stop_edges"].command(tasks, run, *extra, steps=steps)


def _log(path: Path) -> str:
    return path.read_text()[-8000:] if path.exists() else ""


def _run_to_end(cmd: list[str], cwd: Path, log: Path, marker: str, timeout: float = 240, **env: str) -> int:
    proc = start(cmd, cwd, log, **env)
    try:
        return proc.wait(timeout)
    finally:
        reap(proc, marker)


def _attempts(run: Path) -> list[dict]:
    return json.loads((run / "run.json").read_text())["attempts"]


def assert_ended_records(run: Path, attempt: int) -> dict:
    """What every stop leaves: the attempt's summary, its events and run.json's `ended` record."""
    summary = json.loads((run / "summary.json").read_text())
    assert summary["attempt"] == attempt, summary
    assert _attempts(run)[attempt].get("ended"), _attempts(run)[attempt]
    events = rows(run / "events.jsonl")
    assert any(e["kind"] == "attempt" and e["attempt"] == attempt for e in events)
    return summary


def assert_no_group_trained_twice(run: Path) -> None:
    """From the journal: each group trained once, never trained and then lost (its task re-run)
    or carried over again; every step of metrics.jsonl has the groups it trained."""
    journal = rows(run / "groups.jsonl")
    trained = Counter(r["group_id"] for r in journal if r["kind"] == "trained")
    assert [g for g, n in trained.items() if n > 1] == [], trained
    lost = {r["group_id"] for r in journal if r["kind"] == "lost"}
    assert not lost & set(trained), lost & set(trained)
    for i, r in enumerate(journal):  # a group dispatched again (carried over) after it was trained
        if r["kind"] == "trained":
            later = [x for x in journal[i + 1:] if x["kind"] == "dispatched" and x["group_id"] == r["group_id"]]
            assert later == [], (r, later)
    steps = [r["step"] for r in rows(run / "metrics.jsonl")]
    assert steps == list(range(len(steps))), steps
    assert {r["step"] for r in journal if r["kind"] == "trained"} == set(steps)
    # Every step the newest checkpoint holds has its row and journal entries (else a resume from it
    # would carry that step's groups over and train them again).
    newest = checkpoint.newest_complete(run / "checkpoints").path
    assert newest is None or checkpoint.version_of(newest) == len(steps), (newest, steps)


def test_sigterm_during_a_checkpoint_write_keeps_the_steps_row_and_journal_and_the_resume_trains_nothing_twice(tmp_path):
    marker = str(uuid.uuid4().int % 10**10).rjust(10, "1")
    tasks, run, log = _tasks(tmp_path / "tasks.jsonl", marker), tmp_path / "run", tmp_path / "log.txt"
    proc = start(_cmd(tasks, run, 3), tmp_path, log, GYRE_TEST_SLOW_CHECKPOINT_S="6")
    try:
        writing = run / "checkpoints" / ".step_000001.tmp"
        wait_for(writing.exists, 180, proc, "the first checkpoint being written")
        proc.send_signal(signal.SIGTERM)  # scancel / preemption: torchrun forwards it to the ranks
        rc = proc.wait(60)
    finally:
        reap(proc, marker)
    assert rc != 0, _log(log)
    assert "I/O operation on closed file" not in log.read_text()
    summary = assert_ended_records(run, 0)
    assert summary["interrupted"] == "SIGTERM" and summary["steps"] == 1, (summary, _log(log))
    assert (run / "role_timeline.png").stat().st_size > 0
    # The checkpoint the signal landed in is complete, and its step has its row and journal entries.
    assert json.loads((run / "checkpoints" / "step_000001" / "COMPLETE").read_text())["version"] == 1
    assert [r["step"] for r in rows(run / "metrics.jsonl")] == [0]
    assert rows(run / "metrics.jsonl")[0]["checkpoint_s"] >= 6.0  # measured, for the stop budget
    assert_no_group_trained_twice(run)

    # The resume ends well with the sleepers still running: the drain, then every rank waited for.
    rc = _run_to_end(_cmd(tasks, run, 3, "--train.resume"), tmp_path, tmp_path / "log2.txt", marker)
    assert rc == 0, _log(tmp_path / "log2.txt")
    summary = assert_ended_records(run, 1)
    assert summary["steps"] >= 3 and summary["error"] is None
    assert summary["cancelled_at_end"] >= 1  # the sleepers: the drain path was taken
    assert summary["ranks_not_stopped"] == [], summary["ranks_not_stopped"]
    assert_no_group_trained_twice(run)
    end = (tmp_path / "log2.txt").read_text()
    assert f"run ended after {summary['steps']} steps" in end and "report: python -m gyre.report" in end
    assert "run summary: {" not in end and "CancelledError" not in end


def _mount_tmpfs(path: Path, size: str) -> None:
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")


def _fill(path: Path) -> Path:
    """Fill the file system of `path` to the last block."""
    filler = path / "filler"
    with open(filler, "wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError:
            pass
    return filler


@pytest.mark.timeout(1200)
@pytest.mark.slow  # three launches: 150-330 s here (the write errors' logic: tests/runtime/test_stop.py)
def test_a_full_disk_stops_the_run_with_one_error_naming_the_write_and_it_resumes_after(tmp_path):
    marker = str(uuid.uuid4().int % 10**10).rjust(10, "1")
    tasks, run = _tasks(tmp_path / "tasks.jsonl"), tmp_path / "run"
    # Attempt 0: one step, so the run directory exists (with its executions/) and has a checkpoint.
    rc = _run_to_end(_cmd(tasks, run, 1), tmp_path, tmp_path / "log0.txt", marker)
    assert rc == 0, _log(tmp_path / "log0.txt")
    executions = run / "executions"
    _mount_tmpfs(executions, "4m")  # the earlier attempt's executions are hidden: it ended well, none is carried
    try:
        # Attempt 1: the disk fills once its first step is done.
        log = tmp_path / "log1.txt"
        proc = start(_cmd(tasks, run, 6, "--train.resume"), tmp_path, log)
        try:
            done = len(rows(run / "metrics.jsonl"))
            wait_for(lambda: len(rows(run / "metrics.jsonl")) > done, 180, proc, "a step of the resumed attempt")
            filler = _fill(executions)
            rc = proc.wait(120)  # before: it waited forever ("groups ready 0" every 15 s)
        finally:
            reap(proc, marker)
        text = log.read_text()
        assert rc != 0, _log(log)
        summary = assert_ended_records(run, 1)
        err = summary["error"]
        assert "ENOSPC" in err and "errno 28" in err and str(executions) in err and "--train.resume" in err, err
        assert text.count("ENOSPC (errno 28)") == 1, _log(log)  # stated once
        # Space freed: the run resumes and finishes.
        filler.unlink()
        steps = len(rows(run / "metrics.jsonl")) + 1
        rc = _run_to_end(_cmd(tasks, run, steps, "--train.resume"), tmp_path, tmp_path / "log2.txt", marker)
        assert rc == 0, _log(tmp_path / "log2.txt")
        summary = assert_ended_records(run, 2)
        assert summary["steps"] >= steps and summary["error"] is None and summary["ranks_not_stopped"] == []
    finally:
        subprocess.run(["umount", "-l", str(executions)], capture_output=True)
    assert_no_group_trained_twice(run)


@pytest.mark.slow
@pytest.mark.timeout(2400)  # 20 launches and stops: 10-20 min on the 2-core machine
def test_twenty_sigterms_at_random_times_each_leave_the_records_and_no_group_is_trained_twice(tmp_path):
    """Stop times seeded (uniform over start-up, steps, checkpoints (slowed 2 s) and the stop);
    each relaunch resumes the run directory (from scratch, --overwrite, while it has no checkpoint)."""
    marker = str(uuid.uuid4().int % 10**10).rjust(10, "1")
    tasks, run = _tasks(tmp_path / "tasks.jsonl"), tmp_path / "run"
    # 2-55 s after the launch: imports, rendezvous, start-up, steps, checkpoints, a stop's end (on a
    # loaded 2-core machine start-up alone takes 10-30 s). GYRE_STOP_CYCLES=N runs the first N only.
    schedule = random.Random(36).sample([x / 2 for x in range(4, 111)], 20)[:int(os.environ.get("GYRE_STOP_CYCLES", "20"))]
    seen = []
    for i, after in enumerate(schedule):
        resume = any((run / "checkpoints").glob("step_*/COMPLETE"))
        extra = ("--train.resume",) if resume else (("--overwrite",) if (run / "run.json").exists() else ())
        before = len(_attempts(run)) if resume else 0
        log = tmp_path / f"log{i}.txt"
        proc = start(_cmd(tasks, run, 200, *extra), tmp_path, log, GYRE_TEST_SLOW_CHECKPOINT_S="2")
        try:
            deadline = time.monotonic() + after
            while proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            assert proc.poll() is None, _log(log)
            proc.send_signal(signal.SIGTERM)
            rc = proc.wait(60)
        finally:
            reap(proc, marker)
            # A SIGTERM while torchrun is still spawning its workers kills torchrun before it knows
            # them: a rank it started waits in the rendezvous for ever (torchrun's, not Gyre's).
            reap(proc, str(run))
        assert rc != 0, _log(log)
        started = (run / "run.json").exists() and len(_attempts(run)) > before
        seen.append((after, started, rc))
        if started:  # the attempt exists: it has its records (a stop before run.json leaves no run at all)
            attempt = len(_attempts(run)) - 1
            try:
                assert_ended_records(run, attempt)
            except (AssertionError, OSError) as e:
                raise AssertionError(f"stop {i} at {after}s: {e}\n{_log(log)}") from e
            assert_no_group_trained_twice(run)
    assert sum(s for _, s, _ in seen) >= len(schedule) // 3, seen  # enough stops landed in a started run
    resume = any((run / "checkpoints").glob("step_*/COMPLETE"))
    steps = len(rows(run / "metrics.jsonl")) + 2 if resume else 2
    rc = _run_to_end(_cmd(tasks, run, steps, "--train.resume" if resume else "--overwrite"), tmp_path,
                     tmp_path / "log_end.txt", marker)
    assert rc == 0, _log(tmp_path / "log_end.txt")
    assert_no_group_trained_twice(run)
