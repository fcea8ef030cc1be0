"""`python -m gyre.eval`: the statistics against published values, the task and checkpoint choice,
and one real evaluation (the finished tiny run's checkpoint served by the built-in engine behind the
proxy, the tiny harness as subprocesses, the command evaluator) whose figures are recomputed here
from the execution rows and the evaluator's own rule."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, strategies as st

from gyre.eval import difference_interval, resolve_checkpoint, select_tasks, split_file, summarize, wilson
from gyre.executions.tasks import Task

ROOT = Path(__file__).resolve().parents[1]


def test_wilson_and_newcombe_against_published_values():
    # Newcombe (1998a), single proportion, 81/263: Wilson 0.2553 to 0.3662
    low, high = wilson(81, 263)
    assert (round(low, 4), round(high, 4)) == (0.2553, 0.3662)
    # Newcombe (1998b), difference 56/70 − 48/80 = 0.2000, method 10: 0.0524 to 0.3339
    d, low, high = difference_interval(48, 80, 56, 70)
    assert (round(d, 4), round(low, 4), round(high, 4)) == (0.2, 0.0524, 0.3339)
    assert wilson(0, 10)[0] == 0.0 and wilson(10, 10)[1] == pytest.approx(1.0)


@given(n=st.integers(1, 500), data=st.data())
def test_wilson_is_the_score_tests_acceptance_region(n, data):
    """The interval's ends are where the score test's statistic equals z: (p̂ − p)² = z² p(1 − p) / n."""
    k = data.draw(st.integers(0, n))
    z = 1.959964
    low, high = wilson(k, n)
    p = k / n
    assert low <= p <= high
    for end in (low, high):
        if 0 < end < 1:
            assert (p - end) ** 2 == pytest.approx(z * z * end * (1 - end) / n, rel=1e-9, abs=1e-12)


def test_summary_counts_a_missing_reward_as_a_fail():
    s = summarize([1.0, 0.0, None, 1.0, 0.5], pass_at=1.0)
    assert (s["executions"], s["passed"], s["no_reward"]) == (5, 2, 1) and s["pass_rate"] == 0.4
    assert s["mean_reward"] == pytest.approx(2.5 / 4)
    assert summarize([0.5, 0.6], pass_at=0.5)["passed"] == 2


def _task(i: int, split: str | None) -> Task:
    meta = {"split": split} if split else {}
    return Task.from_json({"task_id": f"t{i}", "instruction": "x", "evaluator": {"command": ["true"]}, "metadata": meta})


def test_the_split_is_the_tasks_metadata_and_an_unknown_one_names_those_there():
    tasks = [_task(0, "train"), _task(1, "heldout"), _task(2, "train"), _task(3, "heldout")]
    assert [t.task_id for t in select_tasks(tasks, "heldout", None)] == ["t1", "t3"]
    assert [t.task_id for t in select_tasks(tasks, None, 3)] == ["t0", "t1", "t2"]
    with pytest.raises(SystemExit, match=r"splits \['heldout', 'train'\]"):
        select_tasks(tasks, "test", None)


def test_a_split_the_dataset_lacks_is_read_from_its_file_beside_the_dataset(tmp_path):
    """`--preset smollm2 --split heldout`: the preset's dataset is train.jsonl; heldout.jsonl lies beside it."""
    def write(name: str, tasks: list[Task]) -> str:
        (tmp_path / name).write_text("".join(json.dumps({"task_id": t.task_id, "instruction": "x",
                                                         "evaluator": {"command": ["true"]},
                                                         "metadata": t.metadata}) + "\n" for t in tasks))
        return str(tmp_path / name)

    train = write("train.jsonl", [_task(0, "train"), _task(1, "train")])
    assert split_file(train, "heldout") == train  # nothing beside it: select_tasks then names the splits there
    held = write("heldout.jsonl", [_task(2, "heldout")])
    assert split_file(train, "heldout") == held
    assert split_file(train, "train") == train and split_file(train, None) == train
    both = write("both.jsonl", [_task(3, "train"), _task(4, "heldout")])
    assert split_file(both, "heldout") == both  # the dataset's own tasks of the split come first


@pytest.mark.jobs  # finished_run: a real tiny job, shared
def test_a_run_directory_means_its_newest_complete_checkpoint(finished_run):
    path, run = resolve_checkpoint(str(finished_run.dir))
    assert path.name == "step_000002" and run == finished_run.dir.resolve()
    step1 = finished_run.dir / "checkpoints" / "step_000001"
    assert resolve_checkpoint(str(step1)) == (step1, finished_run.dir.resolve())
    with pytest.raises(SystemExit, match="no config.json"):
        resolve_checkpoint(str(finished_run.dir / "metrics.jsonl"))


@pytest.mark.jobs
def test_an_evaluation_runs_the_harness_through_the_proxy_and_scores_every_execution(finished_run, tmp_path):
    tasks = tmp_path / "tasks.jsonl"
    rows = [json.loads(x) for x in finished_run.tasks.read_text().splitlines() if x.strip()]
    with tasks.open("w") as f:  # the run's tasks, half of them a held-out split
        for i, r in enumerate(rows):
            f.write(json.dumps({**r, "metadata": {"split": "heldout" if i % 2 else "train"}}) + "\n")
    out = tmp_path / "eval.json"
    proc = subprocess.run([sys.executable, "-m", "gyre.eval", "--model.preset", "tiny", "--executions.dataset.path",
                           str(tasks), "--executions.runner.sandbox", "none", "--checkpoint", str(finished_run.dir),
                           "--split", "heldout", "--samples", "3", "--pass-at", "0.5", "--out", str(out)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})  # importable from the run's own directory
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    figures = json.loads(proc.stdout.strip().splitlines()[-1])  # the last line: one JSON object
    saved = json.loads(out.read_text())
    detail = saved.pop("executions_detail")
    assert saved == figures
    heldout = [r["task_id"] for i, r in enumerate(rows) if i % 2]
    assert sorted({d["task_id"] for d in detail}) == sorted(heldout) and len(detail) == 3 * len(heldout)
    assert all(d["outcome"] == "completed" and d["reward"] is not None for d in detail)
    passed = sum(d["reward"] >= 0.5 for d in detail)
    assert (figures["executions"], figures["passed"]) == (len(detail), passed)
    assert figures["checkpoint"].endswith("step_000002")
    # Wilson by the closed form of the score test's quadratic (not gyre.eval.wilson)
    n, p, z = len(detail), passed / len(detail), 1.959964
    a, b, c = 1 + z * z / n, -(2 * p + z * z / n), p * p
    root = math.sqrt(max(0.0, b * b - 4 * a * c))
    assert figures["pass_ci95_low"] == pytest.approx(max(0.0, (-b - root) / (2 * a)), abs=1e-9)
    assert figures["pass_ci95_high"] == pytest.approx(min(1.0, (-b + root) / (2 * a)), abs=1e-9)
