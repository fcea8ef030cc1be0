"""Two `--train.resume` of one run directory at once (real torchrun, 2 gloo ranks each): the
second is refused on every rank before it writes anything, naming the first's pid, and the first
runs to its end with one metrics row per step and one attempt more in run.json (issue 36, item 4).

Before: nothing locked the directory; both resumes cut metrics.jsonl back, both trained to the
end, the rows of every step came twice and the run's totals added both lineages.
"""

import json
import os
import signal
import sys

import pytest

from tests.jobs import HARNESS, RUNS, env, log_of, rows, start, wait_for, write_tasks

# Three tiny launches (a first run, two resumes): 1-2 min on a quiet 2-core machine, 4 min under
# load; the lock's refusal on every rank and its release with the holder are checked in-process
# in tests/runtime/test_rundir.py (default tier).
pytestmark = [pytest.mark.multirank, pytest.mark.slow, pytest.mark.jobs]


def test_a_second_concurrent_resume_is_refused_and_the_first_finishes_alone(tmp_path):
    import subprocess

    # Each execution waits for the file `go` before its one turn: the resumed job stays mid-run
    # (not slowed by a guess) until the second resume has been refused.
    go = tmp_path / "go"
    go.touch()
    tasks = write_tasks(tmp_path / "tasks.jsonl",
                        harness=["sh", "-c", f"while [ ! -e {go} ]; do sleep 0.2; done; exec {sys.executable} {HARNESS} 1 8"])
    run = tmp_path / "run"
    first = subprocess.run(RUNS["run_lock"].command(tasks, run, "--executions.runner.sandbox", "none", steps=1), cwd=tmp_path,
                           capture_output=True, text=True, timeout=240, env=env())
    assert first.returncode == 0, log_of(first)[-3000:]
    go.unlink()
    resume = ("--train.resume", "--executions.runner.sandbox", "none")
    a = start(RUNS["run_lock"].command(tasks, run, *resume, steps=3), tmp_path, tmp_path / "a.log")
    try:
        wait_for(lambda: len(json.loads((run / "run.json").read_text())["attempts"]) == 2, 120, a,
                 "the first resume to record its attempt")
        holder = json.loads((run / "run.lock").read_text())["pid"]
        b = start(RUNS["run_lock"].command(tasks, run, *resume, steps=3), tmp_path, tmp_path / "b.log")
        try:
            b.wait(timeout=150)
        except subprocess.TimeoutExpired:  # it would wait for `go` too: it is running beside the first
            os.killpg(b.pid, signal.SIGKILL)
            raise AssertionError("the second resume was not refused: " + (tmp_path / "b.log").read_text()[-3000:])
        log_b = (tmp_path / "b.log").read_text()
        assert b.returncode != 0 and "exitcode  : 2" in log_b, log_b[-3000:]
        assert log_b.count(f"is in use by another Gyre job (pid {holder} on host ") == 1, log_b[-3000:]
        assert "run directory:" not in log_b and "proxy listening" not in log_b
        assert a.poll() is None  # refused while the first was mid-run
        go.touch()
        assert a.wait(timeout=240) == 0, (tmp_path / "a.log").read_text()[-3000:]
    finally:
        go.touch()
        if a.poll() is None:
            os.killpg(a.pid, signal.SIGKILL)
    assert [r["step"] for r in rows(run / "metrics.jsonl")] == list(range(3))  # one row a step
    attempts = json.loads((run / "run.json").read_text())["attempts"]
    assert [x["start_version"] for x in attempts] == [0, 1]  # the refused resume recorded nothing
    summary = json.loads((run / "summary.json").read_text())
    assert summary["run"]["attempts"] == 2 and summary["run"]["steps"] == 3 and summary["error"] is None
