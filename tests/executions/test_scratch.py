"""gyre.executions.scratch: a process's temporary directories are removed by the next run once
the process is gone, however it ended (issue 19: evaluator temp dirs leaked on SIGKILL), and never
while it lives. Real processes, each with a harness-like child that outlives it."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from gyre.executions import scratch
from gyre.executions.evaluator import Evaluator, Outcome, RewardStatus
from gyre.executions.config import EvaluatorConfig
from gyre.executions.tasks import EvaluatorSpec, Task

# Makes an evaluator-like directory in its scratch root, starts a child that inherits everything it
# may (a harness, an evaluator), prints both, and waits to be killed.
OWNER = r"""
import subprocess, sys, time
from gyre.executions import scratch
d = scratch.mkdtemp("gyre-eval-")
open(d + "/task.json", "w").write("{}")
child = subprocess.Popen(["sleep", "300"], close_fds=False)
print(d, child.pid, flush=True)
time.sleep(300)
"""


def _owner(tmp: Path) -> tuple[subprocess.Popen, Path, int]:
    env = {**os.environ, "TMPDIR": str(tmp), "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.Popen([sys.executable, "-c", OWNER], env=env, stdout=subprocess.PIPE, text=True)
    d, child = proc.stdout.readline().split()
    return proc, Path(d), int(child)


def test_a_killed_process_s_directories_are_swept_and_a_live_one_s_are_not(tmp_path):
    killed, killed_dir, orphan = _owner(tmp_path)
    alive, alive_dir, child = _owner(tmp_path)
    lookalike = tmp_path / f"{scratch.PREFIX}1-unlocked"  # the name alone is not enough: no lock file
    lookalike.mkdir()
    try:
        assert killed_dir.parent.name.startswith(f"{scratch.PREFIX}{killed.pid}-")
        assert scratch.sweep(tmp_path) == []  # both alive: nothing goes
        killed.send_signal(signal.SIGKILL)
        killed.wait(10)
        # Its `sleep` child lives on (re-parented): it does not hold the lock.
        os.kill(orphan, 0)
        assert scratch.sweep(tmp_path) == [killed_dir.parent]
        assert not killed_dir.parent.exists()
        assert (alive_dir / "task.json").exists() and lookalike.is_dir()
        assert scratch.sweep(tmp_path) == []  # nothing twice
    finally:
        for p in (killed, alive):
            p.kill()
            p.wait()
        for pid in (orphan, child):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert scratch.sweep(tmp_path) == [alive_dir.parent]


def test_this_process_keeps_its_root_through_a_sweep_and_its_evaluator_works_under_it(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(scratch.tempfile, "tempdir", None)  # re-read TMPDIR
    monkeypatch.setattr(scratch, "_root", None)
    root = scratch.root()
    assert root.parent == tmp_path and scratch.sweep(tmp_path) == [] and root.is_dir()
    # The evaluator's task file lives under the root while it runs, and is gone after.
    cmd = [sys.executable, "-c", "import os; print(os.environ['GYRE_TASK_FILE']); print(0.5)"]
    seen = []
    task = Task(task_id="t", instruction="x", evaluator=EvaluatorSpec("command", cmd))
    real = scratch.temporary_directory

    def spy(prefix):
        d = real(prefix)
        seen.append(Path(d.name))
        return d

    monkeypatch.setattr(scratch, "temporary_directory", spy)
    res = asyncio.run(Evaluator(EvaluatorConfig()).evaluate("e0", task, tmp_path, Outcome.COMPLETED))
    assert res.status is RewardStatus.VALID and res.reward == 0.5
    assert [d.parent for d in seen] == [root] and not seen[0].exists()
    started = time.monotonic()
    assert scratch.sweep(tmp_path) == [] and time.monotonic() - started < 5
