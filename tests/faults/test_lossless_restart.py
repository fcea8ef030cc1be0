"""A rank killed mid-run under `torchrun --max-restarts 1` with `--executions.plane process`
(real torchrun, 2 ranks, real harness subprocesses): the execution plane outlives the workers,
the restarted job attaches to it and adopts the executions in flight; none is cancelled, no group
runs again, and every execution started before the kill finishes once and trains once (the
groups journal, the executions directory and the TITO store say so).

Before: the harnesses were rank 0's children and died with the attempt; their groups ran again
(tests/faults/test_restart.py counts them as `lost_in_flight`).
"""

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter

import pytest

from gyre.trajectory.store import TitoStore
from gyre.executions.procs import alive
from tests.jobs import ROOT, RUNS, env, rows, steps_done, worker_pid, write_tasks

pytestmark = [pytest.mark.multirank, pytest.mark.jobs]


def _journal(run):
    return [json.loads(line) for line in (run / "groups.jsonl").read_text().splitlines() if line.strip()]


@pytest.mark.parametrize("victim", [1, pytest.param(0, marks=pytest.mark.slow)], ids=["satellite", "rank0"])
def test_a_rank_killed_mid_run_costs_no_execution(tmp_path, victim):
    steps = 5
    # Four turns per execution: executions are in flight at the kill, and go on across it.
    tasks = write_tasks(tmp_path / "tasks.jsonl", [sys.executable, str(ROOT / "tests/runtime/tiny_harness.py"), "4", "8"])
    cmd = RUNS["restart_plane"].command(tasks, None, steps=steps)
    log = open(tmp_path / "torchrun.log", "w")
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env(), stdout=log, stderr=subprocess.STDOUT)
    root = tmp_path / "runs" / "train"
    plane_pid = None
    try:
        run = steps_done(root, proc, 2, 300)  # two finished steps, and executions in flight
        plane_pid = json.loads((run / "execution_plane.json").read_text())["pid"]
        pid = worker_pid(proc.pid, rank=victim)
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        rc = proc.wait(timeout=400)
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
        if plane_pid is not None:
            try:
                os.kill(plane_pid, signal.SIGKILL)  # only if the test failed: it exits with the run
            except ProcessLookupError:
                pass
    out = (tmp_path / "torchrun.log").read_text()
    assert rc == 0, out[-6000:]
    assert "attaching to the execution plane an earlier attempt started" in out, out[-4000:]

    attempts = json.loads((run / "run.json").read_text())["attempts"]
    assert [a["elastic_restart"] for a in attempts] == [0, 1]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == steps and summary["error"] is None
    assert [r["version"] for r in rows(run / "metrics.jsonl")] == list(range(1, steps + 1))

    # 0 executions cancelled, 0 groups run again.
    assert summary["run"]["lost_in_flight"] == 0 and summary["redispatched_groups"] == 0
    journal = _journal(run)
    assert [r for r in journal if r["kind"] == "lost"] == []

    # Every execution the first attempt started finished once (one result.json, not cancelled) ...
    first = sorted(p.name for p in (run / "executions").iterdir() if ".a0." in p.name)
    outcomes = {e: json.loads((run / "executions" / e / "result.json").read_text())["outcome"] for e in first}
    assert "cancelled" not in outcomes.values(), outcomes
    # ... and its group trained exactly once: in the first attempt, or adopted and trained in the second.
    groups_a0 = {r["group_id"] for r in journal if r["kind"] == "dispatched" and r["attempt"] == 0}
    trained = Counter(r["group_id"] for r in journal if r["kind"] == "trained")
    adopted = {r["group_id"] for r in journal if r["kind"] == "dispatched" and r["attempt"] == 1} & groups_a0
    assert adopted, "no group was in flight at the kill"
    started = {e.rsplit(".", 1)[0] for e in first}
    for g in started:
        assert trained[g] == 1 or (g not in adopted and trained[g] == 0), (g, trained[g], journal)
    assert all(trained[g] == 1 for g in adopted)
    # The plane was the same process across the attempts, and it is gone with the run.
    assert not (run / "execution_plane.json").exists()
    deadline = time.monotonic() + 60  # its file goes before its process ends (the last of its stop)
    while alive(plane_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(plane_pid)
    # TITO: every call of the adopted executions recorded once.
    for e in first:
        if e.rsplit(".", 1)[0] in adopted:
            ids = [r.call_id for r in TitoStore(run / "tito").load(e)]
            assert ids == list(range(4)), (e, ids)
