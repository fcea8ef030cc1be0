"""A rank killed mid-run under `torchrun --max-restarts 1` (real torchrun, 2 ranks): the job
restarts, finds its run directory again (here the default, timestamped one, which only rank 0's
record in torchrun's store can name), resumes from the newest complete checkpoint, runs the
tasks of the groups the dead attempt lost first, and finishes its steps.

Before: any rank's death ended the job; `--max-restarts 1` failed at the gloo rendezvous (the
new ranks read the dead ones' addresses from the store), and a restarted job would have started
a fresh run.
"""

import json
from collections import Counter
import os
import signal
import subprocess
import sys

import pytest

from tests.jobs import ROOT, RUNS, env, rows, steps_done, worker_pid, write_tasks

pytestmark = [pytest.mark.multirank, pytest.mark.jobs]


@pytest.mark.parametrize("victim", [pytest.param(1, marks=pytest.mark.slow), pytest.param(0, marks=pytest.mark.slow)],
                         ids=["satellite", "core"])  # --executions.plane rank0, no longer the default: the slow tier
def test_a_rank_killed_mid_run_is_restarted_and_the_run_finishes_its_steps(tmp_path, victim):
    """victim 1: a satellite; its attempt ends gracefully (torchrun SIGTERMs rank 0). victim 0:
    the core, with the controller, the harness runner and the evaluators: its attempt leaves no
    record and its evaluators' temporary directories, which the restart sweeps."""
    steps = 6
    # Three turns per execution: slow enough that executions are in flight at the kill.
    tasks = write_tasks(tmp_path / "tasks.jsonl", [sys.executable, str(ROOT / "tests/runtime/tiny_harness.py"), "3", "8"])
    cmd = RUNS["restart"].command(tasks, None, steps=steps)
    log = open(tmp_path / "torchrun.log", "w")
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    proc = subprocess.Popen(cmd, cwd=tmp_path, env={**env(), "TMPDIR": str(tmpdir)}, stdout=log,
                            stderr=subprocess.STDOUT)
    root = tmp_path / "runs" / "train"
    try:
        steps_done(root, proc, 2, 240)  # two finished steps (their checkpoints are complete)
        pid = worker_pid(proc.pid, rank=victim)
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        rc = proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    out = (tmp_path / "torchrun.log").read_text()
    assert rc == 0, out[-5000:]

    runs = [p for p in root.iterdir() if p.name != "latest"]
    assert len(runs) == 1, runs  # the restart continued the run; it did not start a fresh one
    run = runs[0]
    attempts = json.loads((run / "run.json").read_text())["attempts"]
    assert [a["elastic_restart"] for a in attempts] == [0, 1]
    resumed = attempts[1]["start_version"]
    assert resumed >= 2 and attempts[1]["resumed_from"].endswith(f"step_{resumed:06d}")

    metrics = rows(run / "metrics.jsonl")
    assert [r["step"] for r in metrics] == list(range(steps))  # every step once, versions continuous
    assert [r["version"] for r in metrics] == list(range(1, steps + 1))
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == steps and summary["error"] is None

    # Nothing silently dropped: the first attempt's executions (counted from the executions
    # directory) beyond those of the groups trained into the checkpoint resumed from (one group of
    # 2 a step) are either lost in flight (and run again) or were evaluated and carried over.
    first = [p.name for p in (run / "executions").iterdir() if p.name.split(".")[1] == "a0"]
    in_flight = len(first) - 2 * resumed
    assert in_flight > 0
    assert summary["lost_in_flight"] + 2 * summary["carried_over_groups"] == in_flight
    assert summary["lost_in_flight"] == attempts[1]["lost_in_flight"]
    # ... and their tasks ran again first in the second attempt.
    journal = [json.loads(l) for l in (run / "groups.jsonl").read_text().splitlines()]
    lost = [r["group_id"] for r in journal if r["kind"] == "lost"]
    lost_tasks = [g.split(".")[0] for g in lost]
    redone = [r["task_id"] for r in journal if r["kind"] == "dispatched" and r["attempt"] == 1][:len(lost)]
    assert redone == lost_tasks and len(lost) == summary["redispatched_groups"]

    # The summary adds up the attempts that ended, and its totals agree with the executions
    # directory: every execution that ended has a result.json with its outcome.
    total = summary["run"]
    assert (total["attempts"], total["steps"]) == (2, steps), total
    assert total["lost_in_flight"] == summary["lost_in_flight"]  # only a restart finds groups lost
    results = {p.parent.name: json.loads(p.read_text())["outcome"] for p in (run / "executions").glob("*/result.json")}
    if victim == 1:  # the first attempt ended gracefully: torchrun SIGTERMed rank 0 after rank 1 died
        assert total["attempts_not_ended"] == [] and [e["attempt"] for e in total["errors"]] == [0]
        # The cause first: rank 1 died (its process gone), then torchrun's SIGTERM to rank 0.
        assert total["errors"][0]["error"].startswith("rank 1 died (") and "SIGTERM" in total["errors"][0]["error"]
        assert attempts[0]["ended"]["dead_ranks"] == [1] and [r["rank"] for r in attempts[0]["ranks"]] == [0, 1]
        assert total["execution_outcomes"] == dict(Counter(results.values())), (total, Counter(results.values()))
        assert sum(summary["execution_outcomes"].values()) < len(results)  # the last attempt's alone fall short
    else:  # rank 0 died: its attempt is named, not counted as zeros
        assert total["attempts_not_ended"] == [0] and total["errors"] == [] and "ended" not in attempts[0]
        assert total["execution_outcomes"] == dict(Counter(o for e, o in results.items() if ".a1." in e))
    # No temporary directory is left: the killed rank 0's were swept by the restart, the rest
    # removed at exit.
    assert [p.name for p in tmpdir.iterdir() if p.name.startswith("gyre-")] == []  # (torch's own stay)
