"""Every launch into a run directory is an attempt of its own (real torchrun jobs, 2 ranks, each
resuming a copy of the shared finished run: tests/conftest.py `finished_run`).

Resuming twice from one checkpoint used to relaunch executions under the ids the first resume
had used (ids depended only on the seed and the start version): every launch failed with
FileExistsError, became a 0-reward placeholder, and the steps trained on nothing while the
summary looked normal; metrics.jsonl got a second row for each step.

A group evaluated but not in the checkpoint resumed is trained again from its results, not run
again: on the resume past a truncated checkpoint in tests/faults/test_checkpoints.py (one launch
for both).
"""

import json

import pytest

from tests.jobs import RUNS, log_of, rows, run_to_end

pytestmark = [pytest.mark.multirank, pytest.mark.jobs]


def test_resuming_twice_from_one_checkpoint_trains_on_real_rewards_and_keeps_one_row_per_step(finished_run, tmp_path):
    tasks, run = finished_run.tasks, finished_run.copy_of(tmp_path / "run")
    ck = run / "checkpoints" / "step_000002"
    for _ in range(2):  # the same checkpoint, twice: the second resume also replaces steps 2 and 3's rows
        again = run_to_end(RUNS["resume_twice"].command(tasks, run, "--train.resume-from", str(ck)), tmp_path)
        assert again.returncode == 0, log_of(again)[-4000:]
        assert "FileExistsError" not in log_of(again)
        summary = json.loads((run / "summary.json").read_text())
        # Executions ran for real: none became a placeholder, and some scored above zero.
        assert set(summary["execution_outcomes"]) == {"completed"}, summary["execution_outcomes"]
        assert summary["failed_executions"] == {}

    metrics = rows(run / "metrics.jsonl")
    assert [r["step"] for r in metrics] == [0, 1, 2, 3]  # once each: the second resume cut the first's rows
    assert any(r["reward_mean"] > 0 for r in metrics)
    attempts = json.loads((run / "run.json").read_text())["attempts"]
    assert [(a["attempt"], a["start_version"]) for a in attempts] == [(0, 0), (1, 2), (2, 2)]
    assert all(a["resumed_from"] == str(ck.resolve()) for a in attempts[1:])
    ids = sorted(p.name for p in (run / "executions").iterdir())
    # Every attempt's executions are its own: <task>.a<attempt>.g<k>.<i>, none reused.
    assert {i.split(".")[1] for i in ids} == {"a0", "a1", "a2"}, ids
    for attempt in ("a1", "a2"):  # each resume ran and scored its own executions
        results = [json.loads((run / "executions" / i / "result.json").read_text()) for i in ids
                   if i.split(".")[1] == attempt]
        assert len(results) >= 2 and all(r["outcome"] == "completed" and r["reward"]["status"] == "valid"
                                         for r in results), results

