"""Honest accounting (issue 19, finding 5): nothing silently lost, nothing trained on nothing.

One real job (torchrun, 2 gloo ranks, unsandboxed so the test can reach the harnesses), two steps:

* step 0, a harness SIGKILLed from outside (as by the OOM killer) after its one model call wrote
  an answer: its outcome is `killed`, its workspace is evaluated like a timed-out one (its
  partial credit, 1.0 here) and the group's rewards are the two evaluations, not a 0.0
  placeholder that would shift the baseline (before: `crashed`, reward 0.0, rewards [0.0, 1.0]);
* step 1, a TITO write failure (execution `.0` of the group finds a directory where its TITO file
  goes): the execution is excluded from training and from its group (one valid execution, one
  reward), named in summary.json `incomplete_tito`, and the proxy's sink errors are in
  metrics.jsonl and summary.json (before: counted in a field nobody read, trained on a reward
  with no trajectory).
"""

import json
import os
import signal
import sys
from pathlib import Path

import pytest

from tests.jobs import FAULTS, SLEEPER, command_in, reap, start, wait_for, write_task_rows

pytestmark = pytest.mark.multirank

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


def test_an_external_kill_is_evaluated_and_a_tito_write_failure_is_excluded_and_counted(tmp_path):
    tasks = write_task_rows(tmp_path / "tasks.jsonl", [
        {"harness": [sys.executable, str(SLEEPER), "7", "1"], "evaluator": {"command": ONE_LINE}, "timeout_s": 20},
        {"harness": [sys.executable, str(FAULTS / "tito_poison_harness.py"), "1", "8"], "evaluator": {"command": ONE_LINE}},
    ])
    run = tmp_path / "run"
    proc = start(command_in(tasks, run, "--executions.runner.sandbox", "none", steps=2), tmp_path, tmp_path / "log.txt")
    log = lambda: (tmp_path / "log.txt").read_text()[-6000:]  # noqa: E731
    killed = run / "executions" / "t0.a0.g0.0"
    try:
        wait_for(lambda: (killed / "workspace" / "called").exists() and _harness_pid(killed / "workspace"), 120, proc,
                 "the first harness's call")
        os.kill(_harness_pid(killed / "workspace"), signal.SIGKILL)  # from outside the runner
        rc = proc.wait(240)
    finally:
        reap(proc, "sleeper_harness")
    assert rc == 0, log()

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

    # Step 1: the execution whose records could not be written is out of training and of its group.
    assert list(summary["incomplete_tito"]) == ["t1.a0.g1.0"], summary["incomplete_tito"]
    assert "could not write" in summary["incomplete_tito"]["t1.a0.g1.0"]
    assert summary["sink_errors"] >= 1 and rows[-1]["sink_errors"] == summary["sink_errors"]
    assert rows[1]["incomplete_tito"] == 1 and rows[0]["incomplete_tito"] == 0
    assert rows[1]["executions_valid"] == 1 and len(rows[1]["rewards"]) == 1
    assert not (run / "tito" / "t1.a0.g1.0.tito").is_file() and (run / "tito" / "t1.a0.g1.1.tito").is_file()
