"""A tiny real Gyre job for the fault tests (torchrun, 2 gloo ranks, the `tiny` model) and the
harnesses its tasks run. Every test here asserts on the run directory afterwards."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
TINY = ROOT / "tests" / "runtime" / "tiny_harness.py"
SLEEPER = HERE / "sleeper_harness.py"
AWK_EVALUATOR = ["awk", "{n++; if (length($0) % 2 == 0) e++} END {print (n ? e / n : 0)}", "answer.txt"]


def write_tasks(path: Path, tasks: list[dict]) -> Path:
    with path.open("w") as f:
        for i, t in enumerate(tasks):
            f.write(json.dumps({"task_id": f"t{i}", "instruction": "say words", **t}) + "\n")
    return path


def command(tasks: Path, run_dir: Path, *extra: str, steps: int = 2, nproc: int = 2) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
            "-m", "gyre.run", "--job", "train", "--model.preset", "tiny", "--run-dir", str(run_dir),
            "--executions.dataset.path", str(tasks), "--executions.dataset.no-shuffle",
            "--executions.runner.timeout-s", "300", "--scheduler.n-per-group", "2", "--scheduler.batch-groups", "1",
            "--scheduler.mu", "1", "--scheduler.phi", "0", "--scheduler.tick-s", "0.1", "--train.steps", str(steps),
            "--train.max-tokens", "512", "--train.drain-at-end-s", "5", *extra]


def start(cmd: list[str], cwd: Path, log: Path, **env: str) -> subprocess.Popen:
    """torchrun in its own session (as a shell job: Ctrl-C reaches its whole process group)."""
    full = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), **env}
    return subprocess.Popen(cmd, cwd=cwd, env=full, stdout=log.open("w"), stderr=subprocess.STDOUT,
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
