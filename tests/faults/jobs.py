"""Real torchrun jobs for the fault-injection tests: 2 gloo ranks (the core and one satellite),
the tiny model, groups of 2 executions of a tiny harness, one group a step, one step a burst."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HARNESS = ROOT / "tests" / "runtime" / "tiny_harness.py"
AWK_EVALUATOR = ["awk", "{n++; if (length($0) % 2 == 0) e++} END {print (n ? e / n : 0)}", "answer.txt"]


def write_tasks(path: Path, harness: list[str] | None = None, n: int = 4) -> Path:
    harness = harness or [sys.executable, str(HARNESS), "1", "8"]
    with path.open("w") as f:
        for i in range(n):
            f.write(json.dumps({"task_id": f"t{i}", "instruction": "say words", "harness": harness,
                                "evaluator": {"command": AWK_EVALUATOR}}) + "\n")
    return path


def command(tasks: Path, *extra: str, steps: int = 2, nproc: int = 2, torchrun: tuple[str, ...] = ()) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), *torchrun,
            "-m", "gyre.run", "--job", "train", "--model.preset", "tiny", "--executions.dataset.path", str(tasks),
            "--executions.runner.timeout-s", "120", "--executions.runner.sandbox", "none",
            "--scheduler.n-per-group", "2", "--scheduler.batch-groups", "1", "--scheduler.mu", "1",
            "--scheduler.phi", "0", "--scheduler.tick-s", "0.1", "--train.steps", str(steps),
            "--train.max-tokens", "512", "--train.drain-at-end-s", "5", *extra]


def gyre(cwd: Path, tasks: Path, *extra: str, timeout: float = 300, **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(command(tasks, *extra, **kw), cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env=env)


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
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env and b"TORCHELASTIC_RESTART_COUNT=0" in env:
            return int(pid)
    return None
