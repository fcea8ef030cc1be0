"""Evaluator: retries within a budget, hung attempts killed, exclusion, reward validation,
the built-in partial-progress evaluator, and the timed-out-half-done acceptance check."""

from __future__ import annotations

import asyncio
import math
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from gyre.executions.config import EvaluatorConfig, RunnerConfig
from gyre.executions.evaluator import Evaluator, Outcome, RewardStatus, expected_files, parse_reward, parse_reward_line
from gyre.executions.runner import HarnessRunner
from gyre.executions.tasks import EvaluatorSpec, Task

from tests.executions.helpers import spec, wait_dead, write_script


def evaluate(cfg: EvaluatorConfig, task: Task, ws: Path, outcome=Outcome.COMPLETED):
    return asyncio.run(Evaluator(cfg).evaluate("e0", task, ws, outcome))


def test_hanging_python_evaluator_is_killed_retried_then_excluded(tmp_path, monkeypatch):
    markers = tmp_path / "markers"
    markers.mkdir()
    monkeypatch.setenv("GYRE_TEST_MARKER_DIR", str(markers))
    task = Task(task_id="h", instruction="x",
                evaluator=EvaluatorSpec("python", "tests.executions.helpers:eval_hang", {"seconds": 60}))
    # unsandboxed: the markers are written outside the workspace (tests/executions/test_evaluator_sandbox.py
    # has the sandboxed hang)
    cfg = EvaluatorConfig(timeout_s=2.0, max_attempts=2, retry_backoff_s=0.0, sandbox="none")
    t0 = time.monotonic()
    res = evaluate(cfg, task, tmp_path)
    assert time.monotonic() - t0 < 30  # not the 2 × 60 s the evaluator would sleep
    assert res.status is RewardStatus.EXCLUDED and res.reward is None
    assert len(res.attempts) == 2 and not any(a.ok for a in res.attempts)
    assert all("exceeded" in a.error for a in res.attempts)
    pids = [int(p.read_text()) for p in markers.iterdir()]
    # Each attempt ran in its own child process (a very loaded machine may kill one before it
    # got as far as writing its marker) and every one that ran was killed.
    assert 1 <= len(pids) <= 2
    assert wait_dead(pids) == []


def test_hanging_command_evaluator_excluded(tmp_path):
    task = Task(task_id="h", instruction="x", evaluator=EvaluatorSpec("command", ["sleep", "60"]))
    res = evaluate(EvaluatorConfig(timeout_s=0.3, max_attempts=3, retry_backoff_s=0.0), task, tmp_path)
    assert res.status is RewardStatus.EXCLUDED and len(res.attempts) == 3


def test_transient_failure_is_retried(tmp_path):
    counter = tmp_path / "count"
    task = Task(task_id="f", instruction="x",
                evaluator=EvaluatorSpec("python", "tests.executions.helpers:eval_flaky", {"counter": str(counter)}))
    res = evaluate(EvaluatorConfig(max_attempts=3, retry_backoff_s=0.0), task, tmp_path)
    assert res.status is RewardStatus.VALID and res.reward == 0.25
    assert [a.ok for a in res.attempts] == [False, True]
    assert "transient evaluator failure" in res.attempts[0].error
    assert res.detail["calls"] == 2 and counter.read_text() == "2"


def test_invalid_rewards_count_as_failures(tmp_path):
    bad = Task(task_id="b", instruction="x", evaluator=EvaluatorSpec("python", "tests.executions.helpers:eval_out_of_range"))
    res = evaluate(EvaluatorConfig(max_attempts=2, retry_backoff_s=0.0), bad, tmp_path)
    assert res.status is RewardStatus.EXCLUDED
    assert "[0, 1]" in res.attempts[0].error
    nan = Task(task_id="n", instruction="x", evaluator=EvaluatorSpec("python", lambda ws, t: float("nan")))
    assert evaluate(EvaluatorConfig(max_attempts=1), nan, tmp_path).status is RewardStatus.EXCLUDED


def test_command_evaluator_reads_last_line_in_workspace(tmp_path):
    (tmp_path / "a.txt").write_text("x")
    cmd = [sys.executable, "-c", "import os; print('log line'); print(0.75 if os.path.exists('a.txt') else 0.0)"]
    task = Task(task_id="c", instruction="x", evaluator=EvaluatorSpec("command", cmd))
    res = evaluate(EvaluatorConfig(), task, tmp_path)
    assert res.status is RewardStatus.VALID and res.reward == 0.75
    failing = Task(task_id="c2", instruction="x", evaluator=EvaluatorSpec("command", [sys.executable, "-c", "raise SystemExit(2)"]))
    res = evaluate(EvaluatorConfig(max_attempts=1), failing, tmp_path)
    assert res.status is RewardStatus.EXCLUDED and "status 2" in res.attempts[0].error


def test_placeholder_only_for_outright_failures(tmp_path):
    task = Task(task_id="p", instruction="x", evaluator=EvaluatorSpec("python", lambda ws, t: 0.5))
    for outcome, status in [(Outcome.COMPLETED, RewardStatus.VALID), (Outcome.TIMED_OUT, RewardStatus.VALID),
                            (Outcome.CANCELLED, RewardStatus.VALID), (Outcome.CRASHED, RewardStatus.PLACEHOLDER),
                            (Outcome.LAUNCH_FAILED, RewardStatus.PLACEHOLDER)]:
        res = evaluate(EvaluatorConfig(), task, tmp_path, outcome)
        assert res.status is status
        assert res.reward == (0.5 if status is RewardStatus.VALID else 0.0)
    res = evaluate(EvaluatorConfig(on_crash="evaluate"), task, tmp_path, Outcome.LAUNCH_FAILED)
    assert res.status is RewardStatus.PLACEHOLDER  # nothing ever ran: nothing to evaluate


def test_parse_reward_forms():
    assert parse_reward(1) == (1.0, {})
    assert parse_reward({"reward": 0.5, "n": 3}) == (0.5, {"n": 3})
    for bad in (True, "0.5", None, -0.01, 1.0001, math.inf, {"score": 1}):
        with pytest.raises(ValueError):
            parse_reward(bad)
    assert parse_reward_line("noise\nGYRE_REWARD {\"reward\": 0.2}\ntrailing 7\n")[0] == 0.2
    assert parse_reward_line("a\n0.3\n\n")[0] == 0.3
    with pytest.raises(ValueError, match="not a number"):
        parse_reward_line("done!")


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["ok", "wrong", "missing"]), st.text("abc", min_size=1, max_size=4)), min_size=1, max_size=8))
def test_expected_files_is_fraction_correct(tmp_path_factory, files):
    ws = tmp_path_factory.mktemp("ws")
    want, n_ok = {}, 0
    for i, (kind, content) in enumerate(files):
        want[f"d/f{i}.txt"] = content
        if kind != "missing":
            (ws / "d").mkdir(exist_ok=True)
            (ws / "d" / f"f{i}.txt").write_text(content if kind == "ok" else content + "x")
        n_ok += kind == "ok"
    out = expected_files(ws, None, want)
    assert out["reward"] == n_ok / len(files) and len(out["correct"]) == n_ok


def test_timed_out_half_done_scores_between_empty_and_complete(tmp_path):
    """Acceptance: a harness that writes 6 answer files one per 0.3 s, stopped by a 1.0 s timeout,
    scores strictly between an empty workspace and a complete one."""
    answers = {f"ans/{k}.txt": str(v) for k, v in zip("abcdef", [3, 1, 4, 1, 5, 9])}
    script = write_script(tmp_path, "slow_writer.py", """
        import json, os, sys, time
        answers = json.loads(sys.argv[1])
        os.makedirs("ans", exist_ok=True)
        for path, value in answers.items():
            time.sleep(0.3)
            open(path, "w").write(value)
    """)
    import json
    ev = EvaluatorSpec("python", "gyre.executions.evaluator:expected_files", {"files": answers})
    task = Task(task_id="half", instruction="write the answers", evaluator=ev, timeout_s=1.0,
                harness=[sys.executable, str(script), json.dumps(answers)])
    runner = HarnessRunner(RunnerConfig(run_dir=str(tmp_path / "runs"), kill_grace_s=0.2), Evaluator(EvaluatorConfig()))

    async def main():
        return await runner.dispatch(spec(task, "e0"))

    res = asyncio.run(main())
    assert res.outcome is Outcome.TIMED_OUT
    empty = tmp_path / "empty"
    empty.mkdir()
    full = tmp_path / "full"
    for p, v in answers.items():
        (full / p).parent.mkdir(parents=True, exist_ok=True)
        (full / p).write_text(v)
    r_empty = evaluate(EvaluatorConfig(), task, empty).reward
    r_full = evaluate(EvaluatorConfig(), task, full).reward
    assert (r_empty, r_full) == (0.0, 1.0)
    assert res.reward.status is RewardStatus.VALID
    assert r_empty < res.reward.reward < r_full
