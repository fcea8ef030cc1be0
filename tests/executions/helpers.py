"""Shared pieces of the executions tests: harness scripts and evaluators run as real processes."""

from __future__ import annotations

import os
import textwrap
import time
from pathlib import Path

from gyre.executions.tasks import ExecutionSpec, Task


def write_script(dirpath: Path, name: str, body: str) -> Path:
    p = Path(dirpath) / name
    p.write_text(textwrap.dedent(body))
    return p


def spec(task: Task, eid: str, group: str = "g0", index: int = 0) -> ExecutionSpec:
    return ExecutionSpec(execution_id=eid, task=task, group_id=group, index=index)


def alive(pid: int) -> bool:
    """True if pid exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


def wait_dead(pids, timeout: float = 3.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = [p for p in pids if alive(p)]
        if not left:
            return []
        time.sleep(0.02)
    return [p for p in pids if alive(p)]


# Evaluators importable by name ("tests.executions.helpers:NAME"), run in a child process.
def eval_hang(workspace, task, seconds: float = 60.0):
    marker = Path(os.environ.get("GYRE_TEST_MARKER_DIR", "/nonexistent"))
    if marker.is_dir():
        (marker / f"hang-{os.getpid()}").write_text(str(os.getpid()))
    time.sleep(seconds)
    return 1.0


def eval_flaky(workspace, task, counter: str):
    """Fails on its first call (per counter file), succeeds with 0.25 afterwards."""
    p = Path(counter)
    n = int(p.read_text()) if p.exists() else 0
    p.write_text(str(n + 1))
    if n == 0:
        raise RuntimeError("transient evaluator failure")
    return {"reward": 0.25, "calls": n + 1}


def eval_out_of_range(workspace, task):
    return 1.5


def assert_trained(run_dir: Path, steps: int) -> dict:
    """A finished run that trained `steps` steps on real executions: no error, some executions
    completed, none crashed, failed to launch or was counted by the health check. Its summary."""
    import json

    summary = json.loads((Path(run_dir) / "summary.json").read_text())
    assert summary["steps"] == steps and summary["error"] is None, summary
    outcomes = summary["execution_outcomes"]
    assert outcomes.get("completed", 0) > 0, outcomes
    assert not outcomes.get("crashed") and not outcomes.get("launch_failed"), outcomes
    assert summary["failed_executions"] == {}, summary["failed_executions"]
    return summary
