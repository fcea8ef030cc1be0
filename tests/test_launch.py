"""launch.sh: syntax, and the torchrun command it builds from a fake Slurm environment."""

import os
import shlex
import subprocess
from pathlib import Path

import pytest

from gyre.slurm import expand_nodelist

ROOT = Path(__file__).resolve().parents[1]


def test_launch_sh_syntax():
    subprocess.run(["bash", "-n", str(ROOT / "launch.sh")], check=True)


@pytest.mark.parametrize(
    "nodelist, first",
    [("gpu[07-10]", "gpu07"), ("node3,node9", "node3"), ("a[1,4-5]b,c", "a1b")],
)
def test_launch_builds_torchrun_from_slurm_env(nodelist, first):
    env = {
        "PATH": os.environ["PATH"],
        "HOME": os.environ.get("HOME", "/root"),
        "SLURM_NNODES": "4",
        "SLURM_NODEID": "2",
        "SLURM_JOB_NODELIST": nodelist,
        "SLURM_JOB_ID": "1234",
        "GYRE_DRY_RUN": "1",
        "GYRE_NPROC_PER_NODE": "8",
        "PYTHONPATH": str(ROOT),
    }
    out = subprocess.run(
        ["bash", str(ROOT / "launch.sh"), "--preset", "cpu-demo", "--seed", "7"],
        env=env, capture_output=True, text=True, check=True, cwd=ROOT,
    ).stdout
    argv = shlex.split(out)
    assert argv[0] == "torchrun"
    opts = dict(zip(argv[1:13:2], argv[2:13:2]))
    assert opts == {
        "--nnodes": "4",
        "--node-rank": "2",
        "--nproc-per-node": "8",
        "--master-addr": first,
        "--master-port": "29500",
        "--max-restarts": "0",
    }
    # The run directory is the job's, so a requeue finds it again.
    assert argv[13:] == ["-m", "gyre.run", "--preset", "cpu-demo", "--seed", "7", "--run-dir", "runs/slurm/1234"]


def _dry_run(*args, **env_extra):
    env = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/root"), "SLURM_NNODES": "1",
           "SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "n1", "SLURM_JOB_ID": "77", "GYRE_DRY_RUN": "1",
           "PYTHONPATH": str(ROOT), **env_extra}
    out = subprocess.run(["bash", str(ROOT / "launch.sh"), *args], env=env, capture_output=True, text=True,
                         check=True, cwd=ROOT).stdout
    argv = shlex.split(out)
    return argv[argv.index("gyre.run") + 1:], argv


def test_a_requeued_job_writes_to_the_same_run_dir_and_restarts_are_passed_to_torchrun():
    # (gyre.run sees SLURM_RESTART_COUNT and resumes: tests/test_rundir.py)
    for restart in ("0", "1"):
        args, _ = _dry_run("--preset", "cpu-demo", SLURM_RESTART_COUNT=restart)
        assert args == ["--preset", "cpu-demo", "--run-dir", "runs/slurm/77"]
    args, _ = _dry_run("--run-dir=/scratch/mine")
    assert args == ["--run-dir=/scratch/mine"]  # the user's directory, kept
    _, argv = _dry_run(GYRE_MAX_RESTARTS="3")
    assert argv[argv.index("--max-restarts") + 1] == "3"


def test_launch_outside_slurm_fails_clearly():
    env = {"PATH": os.environ["PATH"], "GYRE_DRY_RUN": "1"}
    r = subprocess.run(["bash", str(ROOT / "launch.sh")], env=env, capture_output=True, text=True)
    assert r.returncode != 0 and "SLURM_NNODES" in r.stderr


def test_expand_nodelist():
    assert expand_nodelist("gpu[07-10]") == ["gpu07", "gpu08", "gpu09", "gpu10"]
    assert expand_nodelist("x[1-2,5],y") == ["x1", "x2", "x5", "y"]
    assert expand_nodelist("single") == ["single"]
    with pytest.raises(ValueError):
        expand_nodelist("bad[1-2")
