"""Every launch into a run directory is an attempt of its own (real torchrun jobs, 2 ranks, each
resuming a copy of the shared finished run: tests/conftest.py `finished_run`).

Resuming twice from one checkpoint used to relaunch executions under the ids the first resume
had used (ids depended only on the seed and the start version): every launch failed with
FileExistsError, became a 0-reward placeholder, and the steps trained on nothing while the
summary looked normal; metrics.jsonl got a second row for each step.
"""

import json

import pytest

from tests.jobs import gyre, log_of, rows

pytestmark = [pytest.mark.multirank, pytest.mark.jobs]


def test_resuming_twice_from_one_checkpoint_trains_on_real_rewards_and_keeps_one_row_per_step(finished_run, tmp_path):
    tasks, run = finished_run.tasks, finished_run.copy_of(tmp_path / "run")
    ck = run / "checkpoints" / "step_000002"
    for _ in range(2):  # the same checkpoint, twice: the second resume also replaces steps 2 and 3's rows
        again = gyre(tmp_path, tasks, "--run-dir", str(run), "--train.resume-from", str(ck), steps=4)
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


def test_a_group_evaluated_but_not_in_the_checkpoint_is_trained_again_without_running_it_again(finished_run, tmp_path):
    tasks, run = finished_run.tasks, finished_run.copy_of(tmp_path / "run")
    step1 = rows(run / "metrics.jsonl")[1]
    # Resume from version 1: the group step 1 trained is not in that checkpoint, but its
    # executions were evaluated (results and TITO are in the run directory).
    again = gyre(tmp_path, tasks, "--run-dir", str(run), "--train.resume-from",
                 str(run / "checkpoints" / "step_000001"), steps=2)
    assert again.returncode == 0, log_of(again)[-4000:]
    assert not [p for p in (run / "executions").iterdir() if ".a1." in p.name]  # nothing ran again
    summary = json.loads((run / "summary.json").read_text())
    assert summary["carried_over_groups"] == 1 and summary["lost_in_flight"] == 0
    redo = rows(run / "metrics.jsonl")
    assert [r["step"] for r in redo] == [0, 1]
    assert redo[1]["rewards"] == step1["rewards"] and len(step1["rewards"]) == 2  # the same two executions
    assert redo[1]["staleness"] == step1["staleness"] == [0]  # v_d kept: sampled at version 1, trained at step 1
