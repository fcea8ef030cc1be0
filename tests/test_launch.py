"""launch.sh: syntax, the torchrun command it builds from a fake Slurm environment, and the batch
shell's srun line run by a fake srun that, like a real second node, has no copy of the script.

Independent of the machine: PATH holds only the tools the script needs and fakes of Slurm's
(a real `scontrol` without slurm.conf fails; one on a Slurm node answers), so the result is the
same with or without Slurm installed. tests/cluster/ runs it on a real two-node Slurm cluster."""

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from gyre.slurm import expand_nodelist

ROOT = Path(__file__).resolve().parents[1]
TOOLS = ("bash", "head", "hostname", "date", "sleep", "cat", "grep", "mktemp", "rm")


def _bin(tmp_path: Path, **fakes: str) -> Path:
    """A PATH directory: the few real tools launch.sh uses, this Python, and the given fakes."""
    d = tmp_path / "bin"
    if d.exists() and not fakes:
        return d
    d.mkdir()
    for t in TOOLS:
        (d / t).symlink_to(shutil.which(t))
    (d / "python").symlink_to(sys.executable)
    for name, body in fakes.items():
        (d / name).write_text(f"#!{sys.executable}\n" + textwrap.dedent(body))
        (d / name).chmod(0o755)
    return d


SCONTROL_WITHOUT_CONF = """\
import sys
sys.exit("scontrol: error: s_p_parse_file: unable to read slurm.conf")
"""
SCONTROL_HOSTNAMES = """\
import sys
assert sys.argv[1:3] == ["show", "hostnames"], sys.argv
print("from-scontrol")
"""


def _env(bindir: Path, **extra) -> dict:
    return {"PATH": str(bindir), "HOME": os.environ.get("HOME", "/root"), "PYTHONPATH": str(ROOT), **extra}


def test_launch_sh_syntax():
    subprocess.run(["bash", "-n", str(ROOT / "launch.sh")], check=True)


@pytest.mark.parametrize("scontrol", ["absent", "without-conf"])
@pytest.mark.parametrize(
    "nodelist, first",
    [("gpu[07-10]", "gpu07"), ("node3,node9", "node3"), ("a[1,4-5]b,c", "a1b")],
)
def test_launch_builds_torchrun_from_slurm_env(tmp_path, nodelist, first, scontrol):
    fakes = {} if scontrol == "absent" else {"scontrol": SCONTROL_WITHOUT_CONF}
    env = _env(_bin(tmp_path, **fakes), SLURM_NNODES="4", SLURM_NODEID="2", SLURM_JOB_NODELIST=nodelist,
               SLURM_JOB_ID="1234", GYRE_DRY_RUN="1", GYRE_NPROC_PER_NODE="8")
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


def _dry_run(tmp_path, *args, fakes=None, **env_extra):
    env = _env(_bin(tmp_path, **(fakes or {})), SLURM_NNODES="1", SLURM_NODEID="0", SLURM_JOB_NODELIST="n1",
               SLURM_JOB_ID="77", GYRE_DRY_RUN="1", **env_extra)
    r = subprocess.run(["bash", str(ROOT / "launch.sh"), *args], env=env, capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    argv = shlex.split(r.stdout)
    return argv[argv.index("gyre.run") + 1:], argv, r.stderr


def test_the_master_address_is_scontrols_where_it_works(tmp_path):
    _, argv, _ = _dry_run(tmp_path, fakes={"scontrol": SCONTROL_HOSTNAMES})
    assert argv[argv.index("--master-addr") + 1] == "from-scontrol"


def test_ranks_per_node_come_from_the_gpus_slurm_gave(tmp_path):
    def nproc(**env):
        d = tmp_path / str(len(list(tmp_path.iterdir())))
        d.mkdir()
        _, argv, err = _dry_run(d, **env)
        return argv[argv.index("--nproc-per-node") + 1], err

    assert nproc(SLURM_GPUS_ON_NODE="4", SLURM_GPUS_PER_NODE="8") == ("4", "")
    assert nproc(SLURM_GPUS_PER_NODE="h100:8") == ("8", "")
    assert nproc(GYRE_NPROC_PER_NODE="2", SLURM_GPUS_ON_NODE="4") == ("2", "")
    n, err = nproc()
    assert n == "1" and "--gpus-per-node" in err and "GYRE_NPROC_PER_NODE" in err
    env = _env(_bin(tmp_path / "0"), SLURM_NNODES="1", SLURM_NODEID="0", SLURM_JOB_NODELIST="n1",
               SLURM_JOB_ID="77", GYRE_DRY_RUN="1", GYRE_NPROC_PER_NODE="eight")
    r = subprocess.run(["bash", str(ROOT / "launch.sh")], env=env, capture_output=True, text=True)
    assert r.returncode != 0 and "GYRE_NPROC_PER_NODE" in r.stderr and "eight" in r.stderr


def test_a_requeued_job_writes_to_the_same_run_dir_and_restarts_are_passed_to_torchrun(tmp_path):
    # (gyre.run sees SLURM_RESTART_COUNT and resumes: tests/runtime/test_rundir.py)
    for i, restart in enumerate(("0", "1")):
        (tmp_path / str(i)).mkdir()
        args, _, _ = _dry_run(tmp_path / str(i), "--preset", "cpu-demo", SLURM_RESTART_COUNT=restart)
        assert args == ["--preset", "cpu-demo", "--run-dir", "runs/slurm/77"]
    (tmp_path / "a").mkdir()
    args, _, _ = _dry_run(tmp_path / "a", "--run-dir=/scratch/mine")
    assert args == ["--run-dir=/scratch/mine"]  # the user's directory, kept
    (tmp_path / "b").mkdir()
    _, argv, _ = _dry_run(tmp_path / "b", GYRE_MAX_RESTARTS="3")
    assert argv[argv.index("--max-restarts") + 1] == "3"


def test_restarts_use_c10d_rendezvous_hosted_by_node_0_with_a_store_per_round(tmp_path):
    """GYRE_MAX_RESTARTS > 0: c10d rendezvous (static restarts only the failed node's ranks), the
    store hosted by node 0's torchrun, node order by Slurm node name, and a store of their own for
    each round's ranks (docs/cluster.md §5); none of static's flags, which c10d ignores."""
    for node in ("0", "1"):
        (tmp_path / node).mkdir()
        env = _env(_bin(tmp_path / node), SLURM_NNODES="2", SLURM_NODEID=node, SLURM_JOB_NODELIST="n[1-2]",
                   SLURM_JOB_ID="77", GYRE_DRY_RUN="1", GYRE_MAX_RESTARTS="2", SLURMD_NODENAME=f"n{int(node) + 1}")
        argv = shlex.split(subprocess.run(["bash", str(ROOT / "launch.sh")], env=env, capture_output=True, text=True,
                                          check=True, cwd=tmp_path / node).stdout)
        assert argv[:3] == ["env", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1", "torchrun"], argv
        opts = dict(zip(argv[3:argv.index("-m"):2], argv[4:argv.index("-m"):2]))
        assert opts == {"--nnodes": "2", "--nproc-per-node": "1", "--rdzv-backend": "c10d",
                        "--rdzv-endpoint": "n1:29500", "--rdzv-id": "gyre-77", "--rdzv-conf": f"is_host={1 - int(node)}",
                        "--local-addr": f"n{int(node) + 1}", "--max-restarts": "2"}, argv
    env = _env(_bin(tmp_path), SLURM_NNODES="1", SLURM_NODEID="0", SLURM_JOB_NODELIST="n1", SLURM_JOB_ID="77",
               GYRE_DRY_RUN="1", GYRE_MAX_RESTARTS="-1")
    r = subprocess.run(["bash", str(ROOT / "launch.sh")], env=env, capture_output=True, text=True)
    assert r.returncode != 0 and "GYRE_MAX_RESTARTS" in r.stderr and "'-1'" in r.stderr


def test_launch_outside_slurm_fails_clearly(tmp_path):
    env = {"PATH": str(_bin(tmp_path)), "GYRE_DRY_RUN": "1"}
    r = subprocess.run(["bash", str(ROOT / "launch.sh")], env=env, capture_output=True, text=True)
    assert r.returncode != 0 and "SLURM_NNODES" in r.stderr


def test_sbatch_script_directives():
    head = [ln for ln in (ROOT / "launch.sh").read_text().splitlines() if ln.startswith("#SBATCH")]
    # Requeueable, and a requeued attempt appends to the first attempt's log instead of truncating it.
    assert "#SBATCH --requeue" in head and "#SBATCH --open-mode=append" in head


# A fake srun: one task per node of SLURM_JOB_NODELIST, each with its SLURM_NODEID, in a directory
# of its own. Before it starts them it moves the batch script's directory away, as a second
# node has no copy of sbatch's spool file.
FAKE_SRUN = """\
import os, subprocess, sys
argv = sys.argv[1:]
while argv[0].startswith("-"):
    argv.pop(0)
spool = os.environ["FAKE_SPOOL"]
os.rename(spool, spool + ".elsewhere")
open(os.environ["FAKE_LOG"], "a").write("srun pid %d\\n" % os.getpid())
procs = []
for node in range(int(os.environ["SLURM_NNODES"])):
    d = os.path.join(os.environ["FAKE_NODES"], str(node))
    os.makedirs(d, exist_ok=True)
    procs.append(subprocess.Popen(argv, cwd=d, env={**os.environ, "SLURM_NODEID": str(node)}))
sys.exit(max(p.wait() for p in procs))
"""
# torchrun: records its argv (and cwd) per node, then runs until SIGTERM when FAKE_BLOCK is set.
FAKE_TORCHRUN = """\
import json, os, signal, sys, time
node = sys.argv[sys.argv.index("--node-rank") + 1]
log = os.environ["FAKE_LOG"]
def term(*_):
    open(log, "a").write("torchrun %s SIGTERM\\n" % node)
    sys.exit(143)
signal.signal(signal.SIGTERM, term)
open(os.path.join(os.environ["FAKE_NODES"], "torchrun-%s.json" % node), "w").write(json.dumps(sys.argv[1:]))
open(log, "a").write("torchrun %s pid %d\\n" % (node, os.getpid()))
while os.environ.get("FAKE_BLOCK"):
    time.sleep(0.05)
"""
# scancel --signal=TERM JOB: signals the job's steps, i.e. every node's torchrun.
FAKE_SCANCEL = """\
import os, re, signal, sys
log = os.environ["FAKE_LOG"]
open(log, "a").write("scancel " + " ".join(sys.argv[1:]) + "\\n")
for pid in re.findall(r"torchrun \\d+ pid (\\d+)", open(log).read()):
    os.kill(int(pid), signal.SIGTERM)
"""
FAKE_SCONTROL = """\
import os, sys
if sys.argv[1:3] == ["show", "hostnames"]:
    sys.exit("scontrol: error: no slurm.conf")
open(os.environ["FAKE_LOG"], "a").write("scontrol " + " ".join(sys.argv[1:]) + "\\n")
if sys.argv[1:3] == ["show", "job"]:
    print(os.environ["FAKE_JOB_INFO"])
"""


# A valid command line (the batch shell checks it before srun) with a value that must survive quoting.
ARGS = ("--job", "train", "--preset", "cpu-demo", "--tracking.wandb-name", "x y")


def _batch(tmp_path, block=False, job_info="JobId=5 JobState=RUNNING Reboot=0 Requeue=1 Restarts=0", args=ARGS, **extra_env):
    spool = tmp_path / "spool"
    spool.mkdir()
    script = spool / "slurm_script"
    shutil.copy(ROOT / "launch.sh", script)
    bindir = _bin(tmp_path, srun=FAKE_SRUN, torchrun=FAKE_TORCHRUN, scancel=FAKE_SCANCEL, scontrol=FAKE_SCONTROL)
    env = _env(bindir, SLURM_NNODES="2", SLURM_JOB_NODELIST="n[1-2]", SLURM_JOB_ID="5", SLURM_NODEID="0",
               FAKE_SPOOL=str(spool), FAKE_NODES=str(tmp_path / "nodes"), FAKE_LOG=str(tmp_path / "log"),
               FAKE_JOB_INFO=job_info, GYRE_NPROC_PER_NODE="2", **({"FAKE_BLOCK": "1"} if block else {}), **extra_env)
    proc = subprocess.Popen(["bash", str(script), *args], env=env, cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return proc, tmp_path / "nodes", tmp_path / "log"


def test_the_batch_shell_starts_torchrun_on_every_node_without_its_script(tmp_path):
    proc, nodes, _ = _batch(tmp_path)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "gyre: job 5 attempt 1" in out
    for node in ("0", "1"):
        argv = json.loads((nodes / f"torchrun-{node}.json").read_text())
        assert argv[argv.index("--node-rank") + 1] == node
        assert argv[argv.index("--master-addr") + 1] == "n1"
        assert argv[argv.index("--nproc-per-node") + 1] == "2"
        assert argv[argv.index("gyre.run") + 1:] == [*ARGS, "--run-dir", "runs/slurm/5"]


@pytest.mark.parametrize("args, says", [
    (("--preset", "cpu-demo", "--job", "train", "--train.stepz", "3"), "--train.stepz"),  # tyro's own message
    (("--preset", "smoke", "--train.steps", "3"), "add --job train"),  # check_job's ConfigError
])
def test_a_refused_command_line_is_said_once_and_no_node_starts(tmp_path, args, says):
    """Issue 53 item 4: a typo'd flag under sbatch was printed once per rank (then once per node),
    each after torchrun's failure report. The batch shell checks the line first: one message,
    a non-zero exit, and srun never runs."""
    proc, _, log = _batch(tmp_path, args=args)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode != 0
    assert err.count(says) == 1, err
    assert "no node started" in err and "Traceback" not in err
    assert not log.exists() or " pid " not in log.read_text()  # neither srun nor any torchrun


def test_help_under_sbatch_prints_the_help_once_and_starts_nothing(tmp_path):
    proc, _, log = _batch(tmp_path, args=("--preset", "cpu-demo", "--help"))
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert out.count("--train.steps") >= 1 and not log.exists()


def _wait_for(path: Path, text: str, n: int = 1, timeout: float = 30) -> str:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        s = path.read_text() if path.exists() else ""
        if s.count(text) >= n:
            return s
        time.sleep(0.05)
    raise AssertionError(f"{text!r} x{n} not in {path}: {s!r}")


@pytest.mark.parametrize("state", ["RUNNING", "COMPLETING"])
def test_sigterm_to_the_batch_shell_reaches_every_torchrun_and_requeues(tmp_path, state):
    """RUNNING: `--signal=B:TERM@N` reaches only the batch shell: it forwards SIGTERM to the job's
    steps (torchrun stops gracefully) and waits for them, then asks for a requeue. COMPLETING:
    scancel (or the time limit) signals every process itself: no second SIGTERM (torchrun takes
    it as "force"), no requeue."""
    proc, _, log = _batch(tmp_path, block=True, job_info=f"JobId=5 JobState={state} Reboot=0 Requeue=1 Restarts=0")
    text = _wait_for(log, " pid ", n=3)  # srun and both torchruns
    proc.send_signal(signal.SIGTERM)
    if state == "COMPLETING":
        _wait_for(log, "scontrol show job")
        for pid in re.findall(r"torchrun \d+ pid (\d+)", text):
            os.kill(int(pid), signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    text = log.read_text()
    assert ("scancel --signal=TERM 5" in text) == (state == "RUNNING"), text
    assert "torchrun 0 SIGTERM" in text and "torchrun 1 SIGTERM" in text
    assert ("scontrol requeue 5" in text) == (state == "RUNNING"), text
    assert proc.returncode == 143, err  # torchrun's status, not the shell's own death by signal


def _stop_the_steps(d: Path, summary: dict, **extra_env) -> tuple[str, str]:
    """A batch job whose steps get SIGTERM (not the shell) after the attempt wrote `summary`."""
    proc, _, log = _batch(d, block=True, **extra_env)
    text = _wait_for(log, " pid ", n=3)
    run = d / "runs" / "slurm" / "5"
    run.mkdir(parents=True)
    (run / "summary.json").write_text(json.dumps(summary))
    for pid in re.findall(r"torchrun \d+ pid (\d+)", text):
        os.kill(int(pid), signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    return log.read_text(), err


def test_a_preemption_signals_the_steps_only_and_the_job_is_requeued(tmp_path):
    """PreemptMode=REQUEUE with a GraceTime sends SIGTERM to the steps, not the batch shell: the
    run stops gracefully (its summary says interrupted) while the job is RUNNING; the shell
    requeues it (else the non-zero exit marks it FAILED). A crash is not: no such summary, or
    (issue 53 item 2) an interrupted one naming ranks that died rather than stopped — torchrun
    SIGTERMs the survivors when a rank is SIGKILLed, so the summary says interrupted too."""
    cases = [({"interrupted": "SIGTERM"}, True), ({"interrupted": None}, False),
             ({"interrupted": "SIGTERM", "ranks_not_stopped": [3]}, False),
             ({"interrupted": "SIGTERM", "dead_ranks": [1]}, False)]
    for i, (summary, requeued) in enumerate(cases):
        d = tmp_path / str(i)
        d.mkdir()
        log, err = _stop_the_steps(d, summary)
        assert ("scontrol requeue 5" in log) == requeued, (summary, log, err)
        crashed = summary.get("ranks_not_stopped") or summary.get("dead_ranks")
        assert (f"ranks {crashed} died" in err and "not requeued" in err) == bool(crashed), err


def test_requeues_stop_at_the_cap(tmp_path):
    """A job preempted again and again is requeued until it has been requeued GYRE_MAX_REQUEUES
    times (default 8), then left to end, saying why."""
    for restarts, cap, requeued in (("7", None, True), ("8", None, False), ("2", "2", False), ("1", "2", True)):
        d = tmp_path / f"{restarts}-{cap}"
        d.mkdir()
        log, err = _stop_the_steps(d, {"interrupted": "SIGTERM"}, SLURM_RESTART_COUNT=restarts,
                                   **({"GYRE_MAX_REQUEUES": cap} if cap else {}))
        assert ("scontrol requeue 5" in log) == requeued, (restarts, cap, log, err)
        assert ("not requeued: the job was requeued" in err) == (not requeued), err


def test_a_sigkilled_batch_shell_leaves_no_file_behind(tmp_path):
    """Issue 53 item 4: the attempt's start time was the mtime of a `gyre-attempt.*` temp file,
    removed by an EXIT trap that a SIGKILL never runs."""
    tmp = tmp_path / "tmpdir"
    tmp.mkdir()
    proc, _, log = _batch(tmp_path, block=True, TMPDIR=str(tmp))
    text = _wait_for(log, " pid ", n=3)
    proc.kill()
    proc.wait(timeout=30)
    for pid in re.findall(r"(?:torchrun \d+|srun) pid (\d+)", text):
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert list(tmp.iterdir()) == []
