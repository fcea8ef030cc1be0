"""What a newcomer meets on the first runs, for real (torchrun, 2 gloo ranks, tiny model):

* a harness that cannot start (here: it imports a module that is not installed) stops the run
  early with one error naming the module and the harness's stderr log, and a non-zero exit,
  instead of training on zero-reward placeholders and exiting 0;
* the same command run twice works both times and keeps the first run: each run gets its own
  directory under runs/<preset>/, `latest` points at the newest, and `--train.resume` with no
  --run-dir continues the latest run;
* an explicit --run-dir that holds a run is refused before anything starts, naming the flags
  that resume or overwrite it.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.jobs import HARNESS, ROOT, gyre, write_tasks

pytestmark = pytest.mark.multirank


def _tasks(path: Path, harness: list[str]) -> Path:
    return write_tasks(path, harness)


def _gyre(cwd: Path, tasks: Path, *extra: str, steps: int = 2, timeout: float = 300) -> subprocess.CompletedProcess:
    return gyre(cwd, tasks, *extra, steps=steps, timeout=timeout, sandbox=None)


def test_a_harness_that_cannot_import_stops_the_run_with_the_missing_module_named(tmp_path):
    broken = [sys.executable, "-c", "import gyre_no_such_module_xyz"]
    tasks = _tasks(tmp_path / "tasks.jsonl", broken)
    proc = _gyre(tmp_path, tasks, "--run-dir", str(tmp_path / "run"), steps=6)
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0, log[-3000:]
    # One diagnosis, from rank 0, with the module and the log it came from.
    assert log.count("the run failed:") == 1, log[-5000:]
    assert "No module named 'gyre_no_such_module_xyz'" in log
    assert "stderr.log" in log and str(tmp_path / "run" / "executions") in log
    assert "2 of the last 2 executions gave nothing to train on (2 crashed)" in log
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 0 and summary["failed_executions"] == {"crashed": 2}
    assert "gyre_no_such_module_xyz" in summary["error"]


def test_the_same_command_twice_keeps_both_runs_and_resume_continues_the_latest(tmp_path):
    tasks = _tasks(tmp_path / "tasks.jsonl", [sys.executable, str(HARNESS), "1", "8"])
    first = _gyre(tmp_path, tasks)
    assert first.returncode == 0, (first.stdout + first.stderr)[-5000:]
    second = _gyre(tmp_path, tasks)
    assert second.returncode == 0, (second.stdout + second.stderr)[-5000:]

    root = tmp_path / "runs" / "train"  # no --preset: runs/train/<timestamp>
    runs = sorted(p for p in root.iterdir() if p.name != "latest")
    assert len(runs) == 2, list(root.iterdir())
    assert (root / "latest").resolve() == runs[1].resolve()
    for run in runs:  # each run complete and its own: 2 steps, every execution completed
        summary = json.loads((run / "summary.json").read_text())
        assert summary["steps"] == 2 and summary["error"] is None
        assert summary["execution_outcomes"].get("completed", 0) > 0 and set(summary["execution_outcomes"]) == {"completed"}
        assert len((run / "metrics.jsonl").read_text().splitlines()) == 2
        assert json.loads((run / "run.json").read_text())["config"]["run_dir"] == ""

    # --train.resume with no --run-dir continues the latest run, to 3 steps in all.
    third = _gyre(tmp_path, tasks, "--train.resume", steps=3)
    assert third.returncode == 0, (third.stdout + third.stderr)[-5000:]
    assert len([p for p in root.iterdir() if p.name != "latest"]) == 2
    rows = [json.loads(x) for x in (runs[1] / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert len((runs[0] / "metrics.jsonl").read_text().splitlines()) == 2  # the first run untouched


def test_an_explicit_run_dir_holding_a_run_is_refused_before_anything_starts(tmp_path):
    run = tmp_path / "run"
    (run / "executions").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 0}\n')
    tasks = _tasks(tmp_path / "tasks.jsonl", [sys.executable, str(HARNESS), "1", "8"])
    proc = _gyre(tmp_path, tasks, "--run-dir", str(run), timeout=120)
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "already holds a run" in log and "--train.resume" in log and "--overwrite" in log
    assert log.count("already holds a run") == 1  # said once, by rank 0
    assert "dispatched" not in log and "proxy listening" not in log  # refused before anything started
    assert (run / "metrics.jsonl").read_text() == '{"step": 0}\n'


def test_the_smoke_preset_prepares_its_data_before_any_rank_reads_the_prepared_model(tmp_path):
    """The newcomer's first run prepares its data (a warm-start checkpoint and tasks) on rank 0 while
    the others wait; a rank that reads `--model.checkpoint` before that barrier finds nothing
    there. (A refactor once moved that read before the barrier; only a fresh data dir shows it.)"""
    data, run_dir = tmp_path / "data", tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "gyre.run",
           "--preset", "cpu-demo-smoke", "--run-dir", str(run_dir), "--train.prepare-dir", str(data),
           "--model.checkpoint", f"{data}/warm_start", "--executions.dataset.path", f"{data}/tasks.jsonl",
           "--train.steps", "1"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert (data / "warm_start" / "config.json").exists()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 1 and summary["error"] is None
