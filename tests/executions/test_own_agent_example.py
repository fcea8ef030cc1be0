"""The "train your own agent" recipe (docs/train-your-own-agent.md, examples/own_agent/) as a
newcomer runs it: make_tasks.py, then the documented torchrun command (2 ranks instead of 4, 2
steps), from a fresh working directory. Plus the evaluator's partial credit against values
worked out by hand."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from examples.own_agent.evaluate import evaluate, score
from tests.executions.helpers import assert_trained
from tests.jobs import RUNS

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "own_agent"

@pytest.mark.parametrize("got, want, reward", [
    ("olleh", "olleh", 1.0),
    # "hello" for "olleh": 1 letter in place (the middle l), 5 of 5 letters shared, same length:
    # 0.6·1/5 + 0.2·5/5 + 0.2·1 = 0.52
    ("hello", "olleh", 0.52),
    # "olle" for "olleh": L = 5, 4 in place, 4 shared, length off by 1: 0.6·4/5 + 0.2·4/5 + 0.2·4/5 = 0.8
    ("olle", "olleh", 0.8),
    # "xyz" for "olleh": nothing in place or shared; length 1 − 2/5: 0.2·3/5 = 0.12
    ("xyz", "olleh", 0.12),
    # "ollehXXXXX" (10 chars): 5 in place, 5 shared, length 1 − 5/10: 0.6·0.5 + 0.2·0.5 + 0.2·0.5 = 0.5
    ("ollehXXXXX", "olleh", 0.5),
    ("", "olleh", 0.0),
])
def test_partial_credit_matches_hand_computed_values(got, want, reward):
    assert score(got, want) == pytest.approx(reward)


def test_evaluate_reads_answer_txt_strips_it_and_scores_a_missing_file_zero(tmp_path):
    assert evaluate(tmp_path, None, expected="olleh") == {"reward": 0.0, "answer": None}
    (tmp_path / "answer.txt").write_text("  hello \n")
    assert evaluate(tmp_path, None, expected="olleh") == {"reward": pytest.approx(0.52), "answer": "hello"}


def test_make_tasks_writes_loadable_tasks_with_the_word_in_the_workspace(tmp_path):
    from gyre.executions.tasks import Dataset

    subprocess.run([sys.executable, str(EXAMPLE / "make_tasks.py"), "--out", str(tmp_path / "tasks.jsonl")], check=True,
                   capture_output=True)
    ds = Dataset.from_jsonl(tmp_path / "tasks.jsonl")
    assert len(ds) == 16
    for task in ds.tasks:
        word = task.files["word.txt"].strip()
        assert task.evaluator.kwargs == {"expected": word[::-1]}
        assert task.evaluator.target == "examples.own_agent.evaluate:evaluate"


@pytest.mark.multirank
@pytest.mark.jobs
def test_the_documented_command_trains_two_steps_on_the_example(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    tasks = tmp_path / "runs" / "own-agent" / "tasks.jsonl"
    subprocess.run([sys.executable, str(EXAMPLE / "make_tasks.py"), "--out", str(tasks)], check=True, cwd=tmp_path,
                   env=env, capture_output=True)
    run = tmp_path / "runs" / "own-agent" / "run1"
    # The command of docs/train-your-own-agent.md, with 2 ranks, 2 steps and small groups (the
    # builder's: N 2, B 1, μ 1, φ 0, a 5 s drain).
    cmd = RUNS["own_agent_example"].command(tasks, run, "--executions.runner.harness-command", "{python}",
                                            str(EXAMPLE / "harness.py"))
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-5000:]

    summary = assert_trained(run, steps=2)
    assert summary["calls"] > 0
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]

    # Every completed execution left its logs, its answer and a valid reward.
    results = [json.loads(p.read_text()) for p in (run / "executions").glob("*/result.json")]
    completed = [r for r in results if r["outcome"] == "completed"]
    assert completed
    for r in completed:
        d = run / "executions" / r["execution_id"]
        assert (d / "stdout.log").read_text().startswith("turns="), (d / "stderr.log").read_text()[-2000:]
        assert (d / "workspace" / "answer.txt").exists()
        assert r["reward"]["status"] == "valid" and 0.0 <= r["reward"]["reward"] <= 1.0
        assert (run / "tito" / f"{r['execution_id']}.tito").exists()
