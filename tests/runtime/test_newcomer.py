"""What a newcomer meets on the first runs, for real (torchrun, 2 gloo ranks, tiny model):

* a harness that cannot start (here: it imports a module that is not installed) stops the run
  early with one error naming the module and the harness's stderr log, and a non-zero exit,
  instead of training on zero-reward placeholders and exiting 0;
* `--train.resume` with no --run-dir continues the latest run under runs/<preset>/ and leaves
  the others alone (one resume of two copies of the shared finished run; that each run gets its
  own directory and `latest` follows the newest is rank 0's `rundir.decide`, proven in-process in
  tests/test_rundir.py); the same launch is the real weights-only resume (the latest run's
  checkpoints lost their optimizer state; tests/faults/test_checkpoints.py has the rest of it);
* an explicit --run-dir that holds a run is refused before anything is written, naming the flags
  that resume or overwrite it (in-process: rank 0's decision; the exit-2 wiring is the real job
  in tests/faults/test_config.py);
* the smoke preset prepares its data before any rank reads it.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.jobs import env, gyre, launcher, write_tasks


def _tasks(path: Path, harness: list[str]) -> Path:
    return write_tasks(path, harness)


def _gyre(cwd: Path, tasks: Path, *extra: str, steps: int = 2, timeout: float = 300) -> subprocess.CompletedProcess:
    return gyre(cwd, tasks, *extra, steps=steps, timeout=timeout, sandbox=None)


@pytest.mark.multirank
@pytest.mark.jobs
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


@pytest.mark.multirank
@pytest.mark.jobs
def test_resume_without_a_run_dir_continues_the_latest_run_weights_only_and_leaves_the_others(finished_run, tmp_path):
    root = tmp_path / "runs" / "train"  # no --preset: runs/train/<timestamp>, `latest` the newest
    old = finished_run.copy_of(root / "20261201-100000")
    new = finished_run.copy_of(root / "20261201-100500")
    (root / "latest").symlink_to(new.name)
    old_rows = (old / "metrics.jsonl").read_text()
    for step in (new / "checkpoints").iterdir():  # the latest run's optimizer state is lost: weights only
        (step / "optimizer.pt").unlink()

    # --train.resume with no --run-dir continues the latest run, to 3 steps in all, with a fresh optimizer.
    third = _gyre(tmp_path, finished_run.tasks, "--train.resume", "--train.resume-weights-only", steps=3)
    assert third.returncode == 0, (third.stdout + third.stderr)[-5000:]
    assert "optimizer.pt (optimizer state) is missing; --train.resume-weights-only" in third.stdout + third.stderr
    assert sorted(p.name for p in root.iterdir()) == ["20261201-100000", "20261201-100500", "latest"]  # no new run
    rows = [json.loads(x) for x in (new / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    summary = json.loads((new / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["error"] is None
    assert (old / "metrics.jsonl").read_text() == old_rows  # the other run untouched


def test_an_explicit_run_dir_holding_a_run_is_refused_before_anything_is_written(tmp_path):
    import torch.distributed as dist

    from gyre.config import parse_config
    from gyre.run import resolve_run_dir
    from gyre.runtime import rundir

    run = tmp_path / "run"
    (run / "executions").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 0}\n')
    tasks = write_tasks(tmp_path / "tasks.jsonl")
    cfg = parse_config(["--job", "train", "--executions.dataset.path", str(tasks), "--run-dir", str(run)])
    with pytest.raises(rundir.RunDirError) as e:
        resolve_run_dir(cfg, 0, 2, dist.HashStore())  # rank 0's decision, before anything starts
    log = str(e.value)
    assert "already holds a run" in log and "--train.resume" in log and "--overwrite" in log
    assert (run / "metrics.jsonl").read_text() == '{"step": 0}\n' and not (run / "run.json").exists()


@pytest.mark.multirank
@pytest.mark.jobs
def test_the_smoke_preset_prepares_its_data_before_any_rank_reads_the_prepared_model(tmp_path):
    """The newcomer's first run prepares its data (a warm-start checkpoint and tasks) on rank 0 while
    the others wait; a rank that reads `--model.checkpoint` before that barrier finds nothing
    there. (A refactor once moved that read before the barrier; only a fresh data dir shows it.)
    The hook is tests/runtime/quick_prepare.py's (the preset's tasks, a random-init model where
    its warm start goes, in seconds): the ordering is the job's, whatever the hook writes, and the
    preset's own hook trains a warm start for a minute or more (CI's newcomer stage runs it)."""
    data, run_dir = tmp_path / "data", tmp_path / "run"
    cmd = [*launcher(2), "--preset", "cpu-demo-smoke", "--run-dir", str(run_dir), "--train.prepare-dir", str(data),
           "--train.prepare", "tests.runtime.quick_prepare:prepare",
           "--model.checkpoint", f"{data}/warm_start", "--executions.dataset.path", f"{data}/tasks.jsonl",
           "--train.steps", "1"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert (data / "warm_start" / "config.json").exists()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 1 and summary["error"] is None
    assert summary["execution_outcomes"].get("completed", 0) > 0, summary["execution_outcomes"]


@pytest.mark.multirank
@pytest.mark.jobs
def test_the_log_says_how_far_the_run_is_and_its_end_lines_match_summary_json(finished_run):
    """A step's one progress line (step k of N, executions, reward so far, ETA), and end lines whose
    counts are summary.json's and metrics.jsonl's, computed here from those files."""
    import re

    log, run = finished_run.log, finished_run.dir
    summary = json.loads((run / "summary.json").read_text())
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    pat = re.compile(r"step (\d+)/(\d+) \| executions (\d+) done, (\d+) running \| reward (\S+) \(mean so far (\S+)\)"
                     r".* \| [\d.]+s/step, ETA (\S+)")
    found = [m for m in map(pat.search, log.splitlines()) if m]
    assert [int(m[1]) for m in found] == list(range(1, finished_run.steps + 1)), log[-4000:]
    assert all(int(m[2]) == finished_run.steps for m in found)
    assert found[-1][7] == "done" and re.fullmatch(r"\d+s|\d+m\d\ds", found[0][7]), [m[0] for m in found]
    every = [r for row in rows for r in row["rewards"] if r is not None]
    assert float(found[-1][6]) == pytest.approx(sum(every) / len(every), abs=5e-4)
    outcomes = summary["execution_outcomes"]
    assert f"executions: {sum(outcomes.values())} (" in log
    t = summary["reward_trend"]
    k = t["k_steps"]
    first_groups = sum(len([g for g in row["group_rewards"] if g]) for row in rows[:k])
    first_execs = sum(len(g) for row in rows[:k] for g in row["group_rewards"] if g)
    assert f"fitted rise {t['fitted_rise']:+.3f} over {summary['steps']} steps" in log
    assert f"{first_execs} executions in {first_groups} groups vs" in log
