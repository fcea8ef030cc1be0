"""The README's `sbatch launch.sh` line on a real two-node Slurm cluster (tests/cluster/conftest.py):
each node a network namespace with its own hostname and slurmd, the run directory on the shared
filesystem. The job is the tests' tiny one (tests/jobs.py), one rank per node."""

import json
import sys
import time
from pathlib import Path

import pytest

from tests.jobs import AWK_EVALUATOR, RUNS, rows, write_tasks

pytestmark = [pytest.mark.slow, pytest.mark.jobs]
ROOT = Path(__file__).resolve().parents[2]


def gyre_args(tasks: Path, *extra: str, steps: int = 2) -> list[str]:
    """The tiny job's gyre.run arguments (what follows `launch.sh` on the sbatch line)."""
    argv = RUNS["sbatch"].command(tasks, None, *extra, steps=steps)
    return argv[argv.index("gyre.run") + 1:]


def test_the_cluster_runs_a_step_on_both_nodes(slurm_cluster, tmp_path):
    out = slurm_cluster.client(["srun", "-N2", "--ntasks-per-node=1", "bash", "-c", 'echo "$(hostname) $SLURM_NODEID"'],
                               cwd=tmp_path, timeout=60).stdout
    assert sorted(out.split("\n")[:-1]) == ["n1 0", "n2 1"]


def test_sbatch_launch_sh_runs_a_job_across_two_nodes_to_completion(slurm_cluster, tmp_path):
    """`sbatch --nodes=2 launch.sh ...`, as the README says. Before the fix srun ran `bash "$0"`,
    sbatch's spool copy of the script, which only the batch node has: exit 127 within a second."""
    tasks = write_tasks(tmp_path / "tasks.jsonl")
    job = slurm_cluster.sbatch(["--nodes=2", str(ROOT / "launch.sh"), *gyre_args(tasks)], cwd=tmp_path,
                               GYRE_NPROC_PER_NODE="1")
    info = slurm_cluster.wait(job, lambda j: j["JobState"] not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING"),
                              420, "the job to end")
    log = (tmp_path / f"gyre-{job}.out").read_text()
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", log[-6000:]
    assert info["NodeList"] == "n[1-2]"
    run = tmp_path / "runs" / "slurm" / job
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["error"] is None, summary
    assert [r["version"] for r in rows(run / "metrics.jsonl")] == [1, 2]
    # Both nodes took part: one rank each, the step's task on n2 too.
    assert json.loads((run / "run.json").read_text())["attempts"][0]["world_size"] == 2
    assert f"launch task StepId={job}.0" in (slurm_cluster.root / "slurmd-n2.log").read_text()
    assert f"gyre: job {job} attempt 1" in log


ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY", "BOOT_FAIL",
         "DEADLINE")


def _mid_run(cluster, job: str, run: Path, steps: int = 1, timeout: float = 300) -> None:
    """Wait until the job's run has finished `steps` steps (its checkpoints are complete)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        m = run / "metrics.jsonl"
        if m.exists() and len(rows(m)) >= steps:
            return
        info = cluster.job(job)
        assert info["JobState"] in ("PENDING", "CONFIGURING", "RUNNING"), info
        time.sleep(0.5)
    raise AssertionError(f"job {job}: no step done in {timeout:.0f}s\n" + cluster.logs())


def test_term_to_the_batch_shell_requeues_the_next_attempt_resumes_and_scancel_stops_it(slurm_cluster, tmp_path):
    """1. What `--signal=B:TERM@N` (before the time limit) and a preemption's grace-time signal
    deliver: SIGTERM to the batch shell alone (`scancel --batch --signal=TERM`). launch.sh forwards
    it to every node's torchrun, the run stops gracefully (summary, checkpoint) and the job is
    requeued. Before, the shell exec'd srun, which answered SIGTERM by killing every task (exit
    137, no summary), and a graceful exit (143) left the job FAILED, never requeued.
    2. The second attempt resumes the run (SLURM_RESTART_COUNT 1) and appends to the same log
    (before, a requeue truncated it).
    3. `scancel` (SIGTERM to every process of the job, srun included, SIGKILL after KillWait) stops
    it gracefully again, and it is not requeued: the operator cancelled it."""
    tasks = write_tasks(tmp_path / "tasks.jsonl", n=40)
    job = slurm_cluster.sbatch(["--nodes=2", str(ROOT / "launch.sh"),
                                *gyre_args(tasks, "--train.checkpoint-every", "1", steps=40)],
                               cwd=tmp_path, GYRE_NPROC_PER_NODE="1")
    run = tmp_path / "runs" / "slurm" / job
    _mid_run(slurm_cluster, job, run, steps=1)
    slurm_cluster.client(["scancel", "--batch", "--signal=TERM", job])
    slurm_cluster.wait(job, lambda j: j["Restarts"] == "1" and j["JobState"] == "PENDING", 120, "the requeue")
    first = json.loads((run / "summary.json").read_text())
    assert first["interrupted"] == "SIGTERM", first
    done_first = len(rows(run / "metrics.jsonl"))
    _mid_run(slurm_cluster, job, run, steps=done_first + 1)
    slurm_cluster.client(["scancel", job])
    info = slurm_cluster.wait(job, lambda j: j["JobState"] in ENDED, 120, "the job to end")
    log = (tmp_path / f"gyre-{job}.out").read_text()
    assert info["JobState"] == "CANCELLED" and info["Restarts"] == "1", info  # not requeued again
    assert "exit code 137" not in log
    assert log.index(f"gyre: job {job} attempt 1 ") < log.index("requeueing") < log.index(f"gyre: job {job} attempt 2 ")
    assert log.count("requeueing") == 1 and "not requeued" in log
    attempts = json.loads((run / "run.json").read_text())["attempts"]
    assert len(attempts) == 2 and attempts[1]["start_version"] == done_first, attempts
    versions = [r["version"] for r in rows(run / "metrics.jsonl")]
    assert versions == list(range(1, len(versions) + 1)) and len(versions) > done_first  # continuous
    summary = json.loads((run / "summary.json").read_text())
    assert summary["interrupted"] == "SIGTERM", (summary, log[-4000:])
    assert (run / "checkpoints" / f"step_{versions[-1]:06d}").is_dir()


def test_a_preemption_stops_the_run_gracefully_and_requeues_it(slurm_cluster, tmp_path):
    """A job in the higher-tier partition preempts ours (PreemptMode=REQUEUE, GraceTime=120):
    Slurm sends SIGTERM to the steps (not the batch shell), the run stops gracefully, and
    launch.sh requeues the job; it resumes once the urgent job is done. Before, the graceful
    exit (143) left the job FAILED, never requeued."""
    tasks = write_tasks(tmp_path / "tasks.jsonl", n=40)
    job = slurm_cluster.sbatch(["--nodes=2", str(ROOT / "launch.sh"),
                                *gyre_args(tasks, "--train.checkpoint-every", "1", steps=40)],
                               cwd=tmp_path, GYRE_NPROC_PER_NODE="1")
    run = tmp_path / "runs" / "slurm" / job
    _mid_run(slurm_cluster, job, run, steps=1)
    urgent = slurm_cluster.sbatch(["--partition=urgent", "--nodes=2", "--exclusive", "--output=urgent.out",
                                   "--wrap", "sleep 1"], cwd=tmp_path)
    slurm_cluster.wait(job, lambda j: j["Restarts"] == "1", 150, "the preempted job's requeue")
    first = json.loads((run / "summary.json").read_text())
    assert first["interrupted"] == "SIGTERM", first
    done_first = len(rows(run / "metrics.jsonl"))
    slurm_cluster.wait(urgent, lambda j: j["JobState"] == "COMPLETED", 120, "the urgent job")
    _mid_run(slurm_cluster, job, run, steps=done_first + 1)
    slurm_cluster.client(["scancel", job])
    slurm_cluster.wait(job, lambda j: j["JobState"] in ENDED, 120, "the job to end")
    log = (tmp_path / f"gyre-{job}.out").read_text()
    assert "a preemption" in log and "exit code 137" not in log, log[-4000:]
    versions = [r["version"] for r in rows(run / "metrics.jsonl")]
    assert versions == list(range(1, len(versions) + 1)) and len(versions) > done_first


def test_a_node_failure_requeues_the_job_and_it_resumes(slurm_cluster, tmp_path):
    """n2 is lost mid-run (every process in its namespace SIGKILLed, the node DOWN): Slurm ends the
    job (NODE_FAIL) and requeues it (launch.sh's #SBATCH --requeue); launch.sh does not requeue it a
    second time. When the node is back the job resumes the run from its newest complete
    checkpoint, versions continuous; scancel then ends it."""
    tasks = write_tasks(tmp_path / "tasks.jsonl", n=40)
    job = slurm_cluster.sbatch(["--nodes=2", str(ROOT / "launch.sh"),
                                *gyre_args(tasks, "--train.checkpoint-every", "1", steps=40)],
                               cwd=tmp_path, GYRE_NPROC_PER_NODE="1")
    run = tmp_path / "runs" / "slurm" / job
    _mid_run(slurm_cluster, job, run, steps=1)
    try:
        slurm_cluster.fail_node("n2")
        slurm_cluster.wait(job, lambda j: j["Restarts"] == "1" and j["JobState"] == "PENDING", 120, "the requeue")
    finally:
        slurm_cluster.restore_node("n2")
    attempts = lambda: json.loads((run / "run.json").read_text())["attempts"]  # noqa: E731
    t0 = time.monotonic()
    while len(attempts()) < 2:
        assert time.monotonic() - t0 < 240, slurm_cluster.job(job)
        time.sleep(0.5)
    resumed = attempts()[1]["start_version"]
    _mid_run(slurm_cluster, job, run, steps=resumed + 1)
    slurm_cluster.client(["scancel", job])
    info = slurm_cluster.wait(job, lambda j: j["JobState"] in ENDED, 120, "the job to end")
    log = (tmp_path / f"gyre-{job}.out").read_text()
    assert info["Restarts"] == "1" and "requeueing" not in log, log[-4000:]
    assert f"gyre: job {job} attempt 2 " in log
    versions = [r["version"] for r in rows(run / "metrics.jsonl")]
    assert resumed >= 1 and versions == list(range(1, len(versions) + 1)), versions



def _kill_rank(job: str, rank: int) -> int:
    """SIGKILL the job's gyre.run rank `rank` (found by its environment: the nodes share this
    machine's pid namespace); returns its pid."""
    import os
    import signal

    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            env = dict(e.split(b"=", 1) for e in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in e)
        except OSError:
            continue
        if b"gyre.run" in argv and env.get(b"SLURM_JOB_ID") == job.encode() and env.get(b"RANK") == str(rank).encode() \
                and b"torch.distributed.run" not in b" ".join(argv):
            os.kill(int(pid), signal.SIGKILL)
            return int(pid)
    raise AssertionError(f"job {job}: no gyre.run process of rank {rank}")


def test_a_rank_killed_without_restarts_is_a_crash_and_is_not_requeued(slurm_cluster, tmp_path):
    """Issue 53 item 2: rank 3 (node n2) SIGKILLed with GYRE_MAX_RESTARTS=0: its torchrun SIGTERMs
    rank 2, so the run stops "interrupted" like a preemption; the summary names rank 3 as not
    stopped and launch.sh does not requeue (before: "a preemption ... requeueing", for ever)."""
    tasks = write_tasks(tmp_path / "tasks.jsonl", n=40)
    job = slurm_cluster.sbatch(["--nodes=2", str(ROOT / "launch.sh"),
                                *gyre_args(tasks, "--train.checkpoint-every", "1", steps=40)],
                               cwd=tmp_path, GYRE_NPROC_PER_NODE="2")
    run = tmp_path / "runs" / "slurm" / job
    _mid_run(slurm_cluster, job, run, steps=1)
    _kill_rank(job, 3)
    info = slurm_cluster.wait(job, lambda j: j["JobState"] in ENDED, 180, "the job to end")
    log = (tmp_path / f"gyre-{job}.out").read_text()
    assert info["Restarts"] == "0" and info["JobState"] == "FAILED", (info, log[-4000:])
    assert "requeueing" not in log and "a crash, not a preemption; not requeued" in log, log[-4000:]


def test_a_job_preempted_before_its_first_step_is_requeued_and_runs_to_completion(slurm_cluster, tmp_path):
    """Issue 53 item 1: SIGTERM (to the batch shell, as `--signal=B:TERM@N` or a preemption's grace
    signal) while every first-attempt harness still waits, so no step and no checkpoint exist;
    launch.sh requeues the job, and the requeue starts the run again from version 0 and finishes
    it (COMPLETED), rather than refusing the resume."""
    from tests.jobs import HARNESS, write_task_rows

    gate = tmp_path / "go"  # the first attempt's harnesses wait for it; the test creates it after the signal
    harness = ["sh", "-c", f'while [ ! -e {gate} ]; do sleep 0.2; done; exec "$0" "$@"', sys.executable, str(HARNESS),
               "1", "8"]
    tasks = write_task_rows(tmp_path / "tasks.jsonl", [{"harness": harness, "evaluator": {"command": AWK_EVALUATOR}}] * 8)
    job = slurm_cluster.sbatch(["--nodes=2", str(ROOT / "launch.sh"), *gyre_args(tasks, steps=2)],
                               cwd=tmp_path, GYRE_NPROC_PER_NODE="1")
    run = tmp_path / "runs" / "slurm" / job
    t0 = time.monotonic()
    while not (run / "executions").is_dir() or not any((run / "executions").iterdir()):
        assert time.monotonic() - t0 < 240, slurm_cluster.job(job)
        time.sleep(0.5)
    slurm_cluster.client(["scancel", "--batch", "--signal=TERM", job])
    slurm_cluster.wait(job, lambda j: j["Restarts"] == "1", 150, "the requeue")
    gate.touch()
    first = json.loads((run / "run.json").read_text())["attempts"][0]
    info = slurm_cluster.wait(job, lambda j: j["JobState"] in ENDED, 300, "the requeued job to end")
    log = (tmp_path / f"gyre-{job}.out").read_text()
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", (info, log[-4000:])
    assert first["start_version"] == 0 and not (run / "checkpoints" / "step_000000").exists()
    attempts = json.loads((run / "run.json").read_text())["attempts"]
    assert [a["start_version"] for a in attempts] == [0, 0], attempts
    assert [r["version"] for r in rows(run / "metrics.jsonl")] == [1, 2]
