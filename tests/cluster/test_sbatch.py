"""The README's `sbatch launch.sh` line on a real two-node Slurm cluster (tests/cluster/conftest.py):
each node a network namespace with its own hostname and slurmd, the run directory on the shared
filesystem. The job is the tests' tiny one (tests/jobs.py), one rank per node."""

import json
from pathlib import Path

import pytest

from tests.jobs import command, rows, write_tasks

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def gyre_args(tasks: Path, *extra: str, steps: int = 2) -> list[str]:
    """The tiny job's gyre.run arguments (what follows `launch.sh` on the sbatch line)."""
    argv = command(tasks, *extra, steps=steps)
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
