"""Tiny real Gyre jobs for the tests that run `torchrun -m gyre.run` (the runtime, the fault
injection): task files for the tiny harness, the command line (2 gloo ranks by default, the
`tiny` model, groups of 2 executions, one group a step, one step a burst), and the process
helpers the fault cases use to find, signal and reap what a job started. Every test asserts on
the run directory afterwards."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HARNESS = ROOT / "tests" / "runtime" / "tiny_harness.py"
FAULTS = ROOT / "tests" / "faults"
SLEEPER = FAULTS / "sleeper_harness.py"
# The tiny harness's reward (fraction of even-length answer lines) as a cheap command evaluator.
AWK_EVALUATOR = ["awk", "{n++; if (length($0) % 2 == 0) e++} END {print (n ? e / n : 0)}", "answer.txt"]


def write_task_rows(path: Path, tasks: list[dict]) -> Path:
    """One task a row: ids t0, t1, ... and `tasks[i]`'s fields (harness, evaluator, ...)."""
    with path.open("w") as f:
        for i, t in enumerate(tasks):
            f.write(json.dumps({"task_id": f"t{i}", "instruction": "say words", **t}) + "\n")
    return path


def tiny_task(turns: int = 1, tokens: int = 8) -> dict:
    """A task for the tiny harness: `turns` chat turns of at most `tokens` tokens each."""
    return {"harness": [sys.executable, str(HARNESS), str(turns), str(tokens)], "evaluator": {"command": AWK_EVALUATOR}}


def write_tasks(path: Path, harness: list[str] | None = None, n: int = 4) -> Path:
    """`n` tasks, all running `harness` (default: the tiny harness, 1 turn of 8 tokens)."""
    task = {**tiny_task(), **({"harness": harness} if harness else {})}
    return write_task_rows(path, [task] * n)


def command(tasks: Path, *extra: str, steps: int = 2, nproc: int = 2, torchrun: tuple[str, ...] = (),
            timeout_s: float = 120, sandbox: str | None = "none") -> list[str]:
    """The torchrun command line of a tiny job (`sandbox` None: the default sandbox)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), *torchrun,
            "-m", "gyre.run", "--job", "train", "--model.preset", "tiny", "--executions.dataset.path", str(tasks),
            "--executions.runner.timeout-s", f"{timeout_s:g}",
            *(("--executions.runner.sandbox", sandbox) if sandbox else ()),
            "--scheduler.n-per-group", "2", "--scheduler.batch-groups", "1", "--scheduler.mu", "1",
            "--scheduler.phi", "0", "--scheduler.tick-s", "0.1", "--train.steps", str(steps),
            "--train.max-tokens", "512", "--train.drain-at-end-s", "5", *extra]


def command_in(tasks: Path, run_dir: Path, *extra: str, steps: int = 2, nproc: int = 2) -> list[str]:
    """A tiny job in `run_dir` taking its tasks in file order, with the default sandbox and a
    300 s harness timeout (the signal, frozen-rank and accounting cases)."""
    return command(tasks, "--run-dir", str(run_dir), "--executions.dataset.no-shuffle", *extra, steps=steps,
                   nproc=nproc, timeout_s=300, sandbox=None)


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


def gyre(cwd: Path, tasks: Path, *extra: str, timeout: float = 300, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(command(tasks, *extra, **kw), cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env=env())


def log_of(proc: subprocess.CompletedProcess) -> str:
    return proc.stdout + proc.stderr


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def worker_pid(agent: int, rank: int) -> int | None:
    """The pid of torchrun's worker of `rank` in its first attempt (a child of the agent)."""
    try:
        children = Path(f"/proc/{agent}/task/{agent}/children").read_text().split()
    except OSError:
        return None
    for pid in children:
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ and b"TORCHELASTIC_RESTART_COUNT=0" in environ:
            return int(pid)
    return None


def start(cmd: list[str], cwd: Path, log: Path, **extra_env: str) -> subprocess.Popen:
    """torchrun in its own session (as a shell job: Ctrl-C reaches its whole process group)."""
    return subprocess.Popen(cmd, cwd=cwd, env={**env(), **extra_env}, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def wait_for(pred, timeout: float, proc: subprocess.Popen | None = None, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the job exited ({proc.returncode}) before {what}")
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def marked(marker: str) -> list[int]:
    """Live pids whose command line holds `marker` (by /proc: across pid namespaces)."""
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                cmd = Path(f"/proc/{name}/cmdline").read_bytes().decode(errors="replace")
                state = Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if marker in cmd and state not in ("Z", "X") and int(name) != os.getpid():
                out.append(int(name))
    return out


def reap(proc: subprocess.Popen, marker: str) -> None:
    """After a test: nothing of the job left to disturb the next one."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    for pid in marked(marker):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
