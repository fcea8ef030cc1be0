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
    opts = dict(zip(argv[1:11:2], argv[2:11:2]))
    assert opts == {
        "--nnodes": "4",
        "--node-rank": "2",
        "--nproc-per-node": "8",
        "--master-addr": first,
        "--master-port": "29500",
    }
    assert argv[11:] == ["-m", "gyre.run", "--preset", "cpu-demo", "--seed", "7"]


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
