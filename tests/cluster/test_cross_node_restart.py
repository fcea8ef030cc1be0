"""A rank killed on the second node of a two-node Slurm job (tests/cluster/conftest.py) under
`GYRE_MAX_RESTARTS=1` with `--executions.plane process`: torchrun restarts the ranks of both
nodes, the job resumes in its run directory, rank 0 re-attaches the execution plane on the first
node and adopts the executions in flight: none is cancelled, no group runs again, every one the
first attempt started finished once and trained once (the groups journal and the executions
directory say so), and the job ends COMPLETED.

Before: launch.sh ran torchrun's static rendezvous, so only the dead rank's node restarted its
ranks and rank 0 carried on alone, then waited for the dead rank until gloo failed; and under
c10d rendezvous the two nodes' new ranks took different store prefixes (their torchruns count
restarts differently) and hung in `init_process_group`.
"""

import json
import os
import signal
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from tests.jobs import HARNESS, RUNS, rows, write_tasks

pytestmark = [pytest.mark.slow, pytest.mark.jobs]
ROOT = Path(__file__).resolve().parents[2]
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY", "BOOT_FAIL",
         "DEADLINE")


def _rank_on(cluster, node: str, job: str) -> int:
    """The pid of the job's gyre.run rank running on `node` (in its network namespace: one rank a
    node here), not its torchrun."""
    for pid in cluster.pids(node):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"gyre.run" in argv and f"SLURM_JOB_ID={job}".encode() in environ \
                and any(e.startswith(b"RANK=") for e in environ):
            return pid
    raise AssertionError(f"job {job}: no gyre.run rank on {node}\n" + cluster.logs())


def test_a_rank_killed_on_node_2_restarts_both_nodes_and_costs_no_execution(slurm_cluster, tmp_path):
    steps = 5
    # Four turns an execution: executions are in flight at the kill and go on across it.
    tasks = write_tasks(tmp_path / "tasks.jsonl", [sys.executable, str(HARNESS), "4", "8"])
    argv = RUNS["sbatch_restart"].command(tasks, None, steps=steps)
    job = slurm_cluster.sbatch(["--nodes=2", str(ROOT / "launch.sh"), *argv[argv.index("gyre.run") + 1:]],
                               cwd=tmp_path, GYRE_NPROC_PER_NODE="1", GYRE_MAX_RESTARTS="1")
    run = tmp_path / "runs" / "slurm" / job
    t0 = time.monotonic()
    while not (run / "metrics.jsonl").exists() or len(rows(run / "metrics.jsonl")) < 2:
        info = slurm_cluster.job(job)
        assert info["JobState"] in ("PENDING", "CONFIGURING", "RUNNING"), info
        assert time.monotonic() - t0 < 400, slurm_cluster.logs()
        time.sleep(0.5)
    plane_pid = json.loads((run / "execution_plane.json").read_text())["pid"]
    assert plane_pid in slurm_cluster.pids("n1")  # the plane runs beside rank 0, on the first node
    victim = _rank_on(slurm_cluster, "n2", job)
    os.kill(victim, signal.SIGKILL)
    info = slurm_cluster.wait(job, lambda j: j["JobState"] in ENDED, 400, "the job to end")
    log = (tmp_path / f"gyre-{job}.out").read_text()
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (info, log[-8000:])
    assert info["Restarts"] == "0" and "requeueing" not in log  # torchrun's restart, not Slurm's requeue
    assert "attaching to the execution plane an earlier attempt started" in log, log[-6000:]

    # Both nodes' ranks restarted: a second attempt of the whole world, resumed in the run directory.
    attempts = json.loads((run / "run.json").read_text())["attempts"]
    assert len(attempts) == 2 and [a["world_size"] for a in attempts] == [2, 2], attempts
    assert attempts[1]["restart"] >= 1 and attempts[1]["start_version"] >= 2, attempts
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == steps and summary["error"] is None, summary
    assert [r["version"] for r in rows(run / "metrics.jsonl")] == list(range(1, steps + 1))

    # 0 executions cancelled, 0 groups run again.
    assert summary["run"]["lost_in_flight"] == 0 and summary["redispatched_groups"] == 0, summary
    journal = [json.loads(line) for line in (run / "groups.jsonl").read_text().splitlines() if line.strip()]
    assert [r for r in journal if r["kind"] == "lost"] == []
    first = sorted(p.name for p in (run / "executions").iterdir() if ".a0." in p.name)
    outcomes = {e: json.loads((run / "executions" / e / "result.json").read_text())["outcome"] for e in first}
    assert "cancelled" not in outcomes.values(), outcomes
    groups_a0 = {r["group_id"] for r in journal if r["kind"] == "dispatched" and r["attempt"] == 0}
    adopted = {r["group_id"] for r in journal if r["kind"] == "dispatched" and r["attempt"] == 1} & groups_a0
    assert adopted, "no group was in flight at the kill"
    trained = Counter(r["group_id"] for r in journal if r["kind"] == "trained")
    assert all(trained[g] == 1 for g in adopted), (trained, journal)
    assert all(trained[g] <= 1 for g in groups_a0), trained
    # The plane was one process across the attempts, and it is gone with the run.
    assert not (run / "execution_plane.json").exists()
    with pytest.raises(ProcessLookupError):
        os.kill(plane_pid, 0)


def test_a_requeue_ends_the_execution_plane_and_its_executions_in_flight_run_again(slurm_cluster, tmp_path):
    """What a requeue loses, for docs/cluster.md's table: a SIGTERM to the batch shell (what
    `--signal=B:TERM@N` and a preemption deliver) stops the run and requeues the job; the job's
    end takes the execution plane with it, so the executions it still ran are lost, and the next
    attempt counts them (`lost_in_flight`, a `lost` row per group) and runs their groups again.
    Tasks in file order: the first two quick (steps 1 and 2), the rest wait for a file the test
    creates only after the requeue, so executions are in flight at the stop and cannot end before
    the job does."""
    from tests.jobs import AWK_EVALUATOR, write_task_rows

    gate = tmp_path / "go"
    gated = ["sh", "-c", f'while [ ! -e {gate} ]; do sleep 0.2; done; exec "$0" "$@"', sys.executable, str(HARNESS),
             "4", "8"]
    quick = [sys.executable, str(HARNESS), "4", "8"]
    tasks = write_task_rows(tmp_path / "tasks.jsonl", [{"harness": quick if i < 2 else gated,
                                                        "evaluator": {"command": AWK_EVALUATOR}} for i in range(40)])
    argv = RUNS["sbatch_restart"].command(tasks, None, "--executions.dataset.no-shuffle", steps=40)
    job = slurm_cluster.sbatch(["--nodes=2", str(ROOT / "launch.sh"), *argv[argv.index("gyre.run") + 1:]],
                               cwd=tmp_path, GYRE_NPROC_PER_NODE="1", GYRE_MAX_RESTARTS="1")
    run = tmp_path / "runs" / "slurm" / job
    t0 = time.monotonic()
    while not (run / "metrics.jsonl").exists() or len(rows(run / "metrics.jsonl")) < 2 \
            or not any(e.name.startswith("t2.") for e in (run / "executions").iterdir()):
        assert slurm_cluster.job(job)["JobState"] in ("PENDING", "CONFIGURING", "RUNNING")
        assert time.monotonic() - t0 < 400, slurm_cluster.logs()
        time.sleep(0.5)
    plane_pid = json.loads((run / "execution_plane.json").read_text())["pid"]
    slurm_cluster.client(["scancel", "--batch", "--signal=TERM", job])
    slurm_cluster.wait(job, lambda j: j["Restarts"] == "1", 150, "the requeue")
    t0 = time.monotonic()
    while len(json.loads((run / "run.json").read_text())["attempts"]) < 2:
        assert time.monotonic() - t0 < 300, slurm_cluster.job(job)
        time.sleep(0.5)
    gate.touch()
    slurm_cluster.client(["scancel", job])
    slurm_cluster.wait(job, lambda j: j["JobState"] in ENDED, 120, "the job to end")
    with pytest.raises(ProcessLookupError):
        os.kill(plane_pid, 0)
    attempts = json.loads((run / "run.json").read_text())["attempts"]
    journal = [json.loads(line) for line in (run / "groups.jsonl").read_text().splitlines() if line.strip()]
    lost = {r["group_id"] for r in journal if r["kind"] == "lost"}
    # The first attempt's executions that never ended well: no result, or cancelled.
    unfinished = []
    for e in (run / "executions").iterdir():
        if ".a0." in e.name:
            result = e / "result.json"
            if not result.exists() or json.loads(result.read_text())["outcome"] == "cancelled":
                unfinished.append(e.name)
    assert unfinished and lost == {e.rsplit(".", 1)[0] for e in unfinished}, (lost, unfinished)
    # A lost group counts all its executions (it runs again whole), finished ones too.
    size = {r["group_id"]: len(r["executions"]) for r in journal if r["kind"] == "dispatched"}
    assert attempts[1]["lost_in_flight"] == sum(size[g] for g in lost), (attempts, journal)
    print(f"requeue: {len(unfinished)} executions cut off, {attempts[1]['lost_in_flight']} executions "
          f"in {len(lost)} groups run again")
