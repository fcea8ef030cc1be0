"""The health check: a run whose executions give nothing to train on stops, with the diagnosis."""

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
