"""The health check: a run whose executions give nothing to train on stops, with the diagnosis."""

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gyre.executions.evaluator import Attempt, Outcome, RewardResult, RewardStatus
from gyre.executions.health import HealthMonitor, classify
from gyre.executions.runner import ExecutionResult

# (outcome, reward status, calls) → the reason it gave nothing, or None when it is useful
KINDS = {
    "ok": (Outcome.COMPLETED, RewardStatus.VALID, 5, None),
    "timeout_partial": (Outcome.TIMED_OUT, RewardStatus.VALID, 3, None),
    "crash": (Outcome.CRASHED, RewardStatus.PLACEHOLDER, 2, "crashed"),
    "launch": (Outcome.LAUNCH_FAILED, RewardStatus.PLACEHOLDER, 0, "launch_failed"),
    "eval": (Outcome.COMPLETED, RewardStatus.EXCLUDED, 4, "evaluator_failed"),
    "silent": (Outcome.COMPLETED, RewardStatus.VALID, 0, "no_model_calls"),
    "cancelled": (Outcome.CANCELLED, RewardStatus.VALID, 1, None),
}


def _result(kind: str, i: int, root: Path) -> tuple[ExecutionResult, int]:
    outcome, status, calls, _ = KINDS[kind]
    d = root / f"e{i}"
    reward = RewardResult(f"e{i}", status, None if status is RewardStatus.EXCLUDED else 0.0,
                          attempts=[Attempt(False, 0.1, error="evaluator printed nothing")] if status is RewardStatus.EXCLUDED else [])
    r = ExecutionResult(f"e{i}", "g", "t", 0, 0, outcome, 1 if outcome is Outcome.CRASHED else 0, 0.0, 1.0, d, d / "workspace",
                        error="FileNotFoundError: no such harness" if outcome is Outcome.LAUNCH_FAILED else "",
                        reward=reward)
    return r, calls


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_each_way_of_giving_nothing_is_classified(kind, tmp_path):
    r, calls = _result(kind, 0, tmp_path)
    failure = classify(r, calls)
    expected = KINDS[kind][3] if kind != "cancelled" else None
    assert (failure.reason if failure else None) == expected


def test_the_message_quotes_the_first_failures_stderr_tail_and_path(tmp_path):
    mon = HealthMonitor(window=3, stop_fraction=1.0)
    results = [_result(k, i, tmp_path) for i, k in enumerate(["crash", "launch", "crash"])]
    (tmp_path / "e0").mkdir()
    (tmp_path / "e0" / "stderr.log").write_text("".join(f"line {n}\n" for n in range(30)) +
                                                "ModuleNotFoundError: No module named 'openai'\n")
    assert mon.observe(*results[0]) is None and mon.observe(*results[1]) is None
    msg = mon.observe(*results[2])
    assert msg is not None
    assert "3 of the last 3 executions gave nothing to train on (2 crashed, 1 launch_failed)" in msg
    assert "execution e0, crashed: exited with status 1" in msg
    assert str(tmp_path / "e0" / "stderr.log") in msg and "No module named 'openai'" in msg
    assert "line 18" not in msg and "line 19" in msg  # the tail: last 12 lines only
    assert mon.counts == {"crashed": 2, "launch_failed": 1}


@settings(max_examples=150, deadline=None)
@given(kinds=st.lists(st.sampled_from(sorted(KINDS)), max_size=40), window=st.integers(1, 8),
       fraction=st.sampled_from([0.25, 0.5, 0.75, 1.0, 1.5]))
def test_it_trips_exactly_when_the_last_window_is_bad_enough(kinds, window, fraction, tmp_path_factory):
    """Against an independent count: ignore cancelled ones, look at the last `window` judged
    executions, trip when at least fraction·window of them failed (never when fraction > 1)."""
    root = tmp_path_factory.mktemp("h")
    mon = HealthMonitor(window, fraction)
    judged: list[bool] = []  # failed?
    for i, kind in enumerate(kinds):
        tripped = mon.observe(*_result(kind, i, root)) is not None
        if kind != "cancelled":
            judged.append(KINDS[kind][3] is not None)
        last = judged[-window:]
        expected = kind != "cancelled" and len(last) == window and sum(last) >= fraction * window
        assert tripped == expected


def test_bad_settings_name_the_field():
    with pytest.raises(ValueError, match="executions.health.window"):
        HealthMonitor(0, 1.0)
    with pytest.raises(ValueError, match="executions.health.stop_fraction"):
        HealthMonitor(4, 0.0)


# ---------------------------------------------------------------- an evaluator that never works (issue 53, item 5)

EVAL_KINDS = {  # kind → (outcome, reward status, refused?)
    "scored": (Outcome.COMPLETED, RewardStatus.VALID, False),
    "failed": (Outcome.COMPLETED, RewardStatus.EXCLUDED, False),
    "timed_out_failed": (Outcome.TIMED_OUT, RewardStatus.EXCLUDED, False),
    "refused": (Outcome.COMPLETED, RewardStatus.EXCLUDED, True),  # a workspace link: the harness's doing
    "placeholder": (Outcome.CRASHED, RewardStatus.PLACEHOLDER, False),  # never evaluated
}


def _evaluated(kind: str, evaluator: str, i: int, root: Path) -> ExecutionResult:
    outcome, status, refused = EVAL_KINDS[kind]
    d = root / f"e{i}"
    reward = RewardResult(f"e{i}", status, None if status is RewardStatus.EXCLUDED else 0.0,
                          [Attempt(False, 0.1, error=f"error of e{i}")] if status is RewardStatus.EXCLUDED else [],
                          {"refused": "a link"} if refused else {}, evaluator=evaluator if kind != "placeholder" else "")
    return ExecutionResult(f"e{i}", "g", f"task-{evaluator}", 0, 0, outcome, 1 if outcome is Outcome.CRASHED else 0,
                           0.0, 1.0, d, d / "workspace", reward=reward)


@settings(max_examples=150, deadline=None)
@given(seq=st.lists(st.tuples(st.sampled_from(sorted(EVAL_KINDS)), st.sampled_from(["a", "b"])), max_size=30),
       k=st.integers(0, 4))
def test_an_evaluator_stops_the_run_exactly_when_its_first_k_evaluations_all_failed(seq, k, tmp_path_factory):
    """Against an independent count per evaluator: a failure that is not a refused workspace counts
    until the evaluator's first valid reward; the K-th such failure trips (K = 0: never). The
    window check is out of reach (a window longer than the run)."""
    root = tmp_path_factory.mktemp("ev")
    mon = HealthMonitor(window=1000, stop_fraction=1.0, evaluator_window=k)
    scored: set[str] = set()
    failures = {"a": 0, "b": 0}
    for i, (kind, name) in enumerate(seq):
        msg = mon.observe(_evaluated(kind, name, i, root), 3)
        counted = kind in ("failed", "timed_out_failed") and name not in scored
        if kind == "scored":
            scored.add(name)
        failures[name] += counted
        expected = counted and k > 0 and failures[name] >= k
        assert (msg is not None) == expected, (i, kind, name, msg)
        if expected:
            assert msg.startswith(f"evaluator {name} failed on each of its first {failures[name]} evaluations")
            assert f"error of e{i}" in msg and f"task task-{name}" in msg


def test_an_evaluator_failing_in_its_sandbox_stops_the_run_while_the_other_tasks_score(tmp_path, monkeypatch):
    """Real executions through the runner (harness `true`), one task whose command evaluator
    scores and one whose script imports a module it can reach only outside the evaluator sandbox:
    every execution of that task is excluded, the other task keeps the window from ever filling
    with failures, so before this the run went on training on half its tasks with warnings only.
    Now its third evaluation stops the run, naming the evaluator and quoting its stderr."""
    import asyncio
    import sys

    from gyre.executions.config import EvaluatorConfig, RunnerConfig
    from gyre.executions.evaluator import Evaluator
    from gyre.executions.runner import HarnessRunner
    from gyre.executions.sandbox import bwrap_works
    from gyre.executions.tasks import EvaluatorSpec, ExecutionSpec, Task

    if not bwrap_works():
        pytest.skip("bubblewrap not usable here")
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "health_lib_53.py").write_text("REWARD = 1.0\n")
    monkeypatch.setenv("PYTHONPATH", str(lib))  # passed into the sandbox; the directory is not bound there
    script = tmp_path / "kit" / "check.py"
    script.parent.mkdir()
    script.write_text("from health_lib_53 import REWARD\nprint(REWARD)\n")
    broken = Task(task_id="broken", instruction="x", harness=["true"],
                  evaluator=EvaluatorSpec("command", [sys.executable, str(script)]))
    good = Task(task_id="good", instruction="x", harness=["true"], evaluator=EvaluatorSpec("command", ["sh", "-c", "echo 1"]))
    evaluator = Evaluator(EvaluatorConfig(max_attempts=2, retry_backoff_s=0.0, timeout_s=60), RunnerConfig(sandbox="bwrap"))
    runner = HarnessRunner(RunnerConfig(run_dir=str(tmp_path / "runs"), sandbox="none"), evaluator)

    async def main():
        out = []
        for i in range(3):
            for task in (good, broken):
                out.append(await runner.dispatch(ExecutionSpec(f"{task.task_id}.{i}", task, f"{task.task_id}.g{i}")))
        return out

    results = asyncio.run(main())
    assert [r.reward.status for r in results] == [RewardStatus.VALID, RewardStatus.EXCLUDED] * 3
    before = HealthMonitor(window=4, stop_fraction=1.0)  # the window check alone: what used to run
    assert [before.observe(r, 1) for r in results] == [None] * 6
    mon = HealthMonitor(window=4, stop_fraction=1.0, evaluator_window=3)
    said = [mon.observe(r, 1) for r in results]
    assert said[:5] == [None] * 5 and said[5] is not None
    msg = said[5]
    assert msg.startswith(f"evaluator {sys.executable} {script} failed on each of its first 3 evaluations and has "
                          f"never given a reward (task broken); stopping the run"), msg
    assert str(tmp_path / "runs" / "broken.2" / "result.json") in msg and "failed 2 attempt(s)" in msg
    assert "ModuleNotFoundError: No module named 'health_lib_53'" in msg  # its stderr
    saved = json.loads((tmp_path / "runs" / "broken.2" / "result.json").read_text())
    assert saved["reward"]["evaluator"] == f"{sys.executable} {script}"


def test_a_bad_evaluator_window_names_the_field():
    with pytest.raises(ValueError, match="executions.health.evaluator_window"):
        HealthMonitor(1, 1.0, evaluator_window=-1)
