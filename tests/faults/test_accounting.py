"""Honest accounting (issue 19, finding 5): nothing silently lost, nothing trained on nothing.

One real job (torchrun, 2 gloo ranks, unsandboxed so the test can reach the harnesses), two steps:

* step 0, a harness SIGKILLed from outside (as by the OOM killer) after its one model call wrote
  an answer: its outcome is `killed`, its workspace is evaluated like a timed-out one (its
  partial credit, 1.0 here) and the group's rewards are the two evaluations, not a 0.0
  placeholder that would shift the baseline (before: `crashed`, reward 0.0, rewards [0.0, 1.0]);
* step 1, a TITO write failure (execution `.0` of the group finds a directory where its TITO file
  goes): a write error of the run, so the run states it once (path and errno) and stops
  (issue 36: every write error stops the run, never a silent loss); the execution is named in
  summary.json `incomplete_tito` and the sink error is counted there (before issue 19: counted in
  a field nobody read, trained on a reward with no trajectory; before issue 36: excluded and the
  run went on past a write the disk had refused).
"""

import json
import os
import signal
import sys
from pathlib import Path

import pytest

from tests.jobs import FAULTS, RUNS, SLEEPER, reap, start, wait_for, write_task_rows

pytestmark = [pytest.mark.multirank, pytest.mark.jobs]

ONE_LINE = ["sh", "-c", "if test -s answer.txt; then echo 1; else echo 0; fi"]  # the partial credit: an answer written


def _harness_pid(workspace: Path) -> int | None:
    """The sleeper harness (not its reaper) running in `workspace`."""
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                argv = Path(f"/proc/{name}/cmdline").read_bytes().split(b"\0")
                cwd = os.readlink(f"/proc/{name}/cwd")
            except OSError:
                continue
            if len(argv) > 1 and argv[1] == str(SLEEPER).encode() and cwd == str(workspace):
                return int(name)
    return None


def test_an_external_kill_is_evaluated_and_a_tito_write_failure_stops_the_run_naming_it(tmp_path):
    tasks = write_task_rows(tmp_path / "tasks.jsonl", [
        {"harness": [sys.executable, str(SLEEPER), "7", "1"], "evaluator": {"command": ONE_LINE}, "timeout_s": 20},
        {"harness": [sys.executable, str(FAULTS / "tito_poison_harness.py"), "1", "8"], "evaluator": {"command": ONE_LINE}},
    ])
    run = tmp_path / "run"
    proc = start(RUNS["accounting"].command(tasks, run), tmp_path, tmp_path / "log.txt")
    log = lambda: (tmp_path / "log.txt").read_text()[-6000:]  # noqa: E731
    killed = run / "executions" / "t0.a0.g0.0"
    try:
        wait_for(lambda: (killed / "workspace" / "called").exists() and _harness_pid(killed / "workspace"), 120, proc,
                 "the first harness's call")
        os.kill(_harness_pid(killed / "workspace"), signal.SIGKILL)  # from outside the runner
        rc = proc.wait(240)
    finally:
        reap(proc, "sleeper_harness")
    assert rc != 0, log()  # the TITO write failure of step 1 stopped the run

    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((run / "summary.json").read_text())
    # Step 0: the killed execution was evaluated; its reward is what its workspace earns.
    result = json.loads((killed / "result.json").read_text())
    assert result["outcome"] == "killed" and result["exit_code"] == -signal.SIGKILL
    assert (killed / "workspace" / "answer.txt").read_text().strip()  # it had answered: partial credit 1.0
    assert result["reward"]["status"] == "valid" and result["reward"]["reward"] == 1.0
    other = json.loads((run / "executions" / "t0.a0.g0.1" / "result.json").read_text())
    assert other["outcome"] == "timed_out" and other["reward"]["reward"] == 1.0
    assert rows[0]["group_rewards"] == [[1.0, 1.0]] and rows[0]["executions_valid"] == 2
    assert summary["execution_outcomes"].get("killed") == 1 and "crashed" not in summary["failed_executions"]

    # Step 1: the write failure is the run's error, named once with its path and errno; nothing of
    # the failed execution was trained on (no step 1 row), its record is not on disk.
    assert summary["error"].startswith("could not write the TITO record of execution t1.a0.g1.0"), summary["error"]
    assert "EISDIR" in summary["error"] and log().count("the run failed: could not write the TITO record") == 1
    assert len(rows) == 1 and summary["steps"] == 1
    assert summary["sink_errors"] >= 1, summary  # the group never ended: no incomplete_tito entry to make
    assert not (run / "tito" / "t1.a0.g1.0.tito").is_file()
