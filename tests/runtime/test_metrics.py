"""metrics.jsonl and the role timeline PNG are well formed."""

import json
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gyre.runtime.cell import CellState
from gyre.runtime.outputs import MetricsWriter, plot_role_timeline, read_metrics


def test_metrics_jsonl_round_trip_and_nan(tmp_path):
    w = MetricsWriter(str(tmp_path / "m" / "metrics.jsonl"))
    w.write({"step": 1, "loss": 0.5, "bad": float("nan"), "nested": {"x": float("inf")}})
    w.write({"step": 2, "loss": 0.25})
    w.close()
    rows = read_metrics(str(tmp_path / "m" / "metrics.jsonl"))
    assert rows == [{"step": 1, "loss": 0.5, "bad": None, "nested": {"x": None}}, {"step": 2, "loss": 0.25}]
    for line in open(tmp_path / "m" / "metrics.jsonl"):
        json.loads(line)  # strict JSON, one object per line


def test_timeline_png_and_fractions(tmp_path):
    R, T, J, P = CellState.ROLLOUT, CellState.TRAIN, CellState.JOINING, CellState.PUBLISHING
    ivs = {0: [(R, 0, 10), (T, 10, 30), (P, 30, 32), (R, 32, 40)], 1: [(R, 0, 20), (J, 20, 25), (T, 25, 30), (R, 30, 40)]}
    path = tmp_path / "timeline.png"
    fr = plot_role_timeline(ivs, str(path))
    assert fr[0] == pytest.approx(22 / 40) and fr[1] == pytest.approx(10 / 40)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    assert width > 400 and height > 100


def test_reward_trend_hand_values():
    from gyre.runtime.outputs import reward_trend

    rows = [{"rewards": [0.0, 0.0]}, {"rewards": [0.0, 0.5]}, {"rewards": [0.5, 1.0]}, {"rewards": [1.0, 1.0]}]
    t = reward_trend(rows, 2, resamples=2000)
    assert t["first_mean"] == 0.125 and t["last_mean"] == 0.875 and t["diff"] == 0.75
    assert 0 < t["ci95_low"] <= 0.75 <= t["ci95_high"] <= 1.0
    flat = [{"rewards": [0.0, 1.0]}] * 4
    t = reward_trend(flat, 2, resamples=2000)
    assert t["diff"] == 0 and t["ci95_low"] < 0 < t["ci95_high"]  # no rise: the interval straddles 0
    with pytest.raises(ValueError):
        reward_trend(rows, 3)


@settings(max_examples=20, deadline=None)
@given(st.lists(st.floats(0, 1), min_size=16, max_size=16), st.integers(3, 6))
def test_reward_trend_resamples_whole_groups(group_means, n):
    """Executions of a group share a task: with identical rewards inside each group, resampling
    groups must give the same point estimate and a wider interval than pretending the N
    executions were independent (about sqrt(N) wider)."""
    import numpy as np

    from gyre.runtime.outputs import reward_trend

    groups = [[m] * n for m in group_means]
    grouped = [{"rewards": sum(groups[4 * i:4 * i + 4], []), "group_rewards": groups[4 * i:4 * i + 4]} for i in range(4)]
    flat = [{"rewards": r["rewards"]} for r in grouped]
    g, f = reward_trend(grouped, 2, resamples=4000), reward_trend(flat, 2, resamples=4000)
    assert g["unit"] == "group" and f["unit"] == "execution"
    assert g["diff"] == pytest.approx(f["diff"]) and g["n_first"] == f["n_first"] == 8 * n
    if min(np.std(group_means[:8]), np.std(group_means[8:])) > 0.1:
        assert g["ci95_high"] - g["ci95_low"] > 1.2 * (f["ci95_high"] - f["ci95_low"])


def test_reward_trend_fitted_rise_matches_float64_least_squares():
    """fitted_rise is the slope of reward on step times (steps − 1): compared with numpy's
    polyfit on the per-group means (equal group sizes), and its interval covers it."""
    import numpy as np

    from gyre.runtime.outputs import reward_trend

    rng = np.random.default_rng(3)
    rows = []
    for step in range(10):
        groups = [list(np.clip(0.2 + 0.05 * step + rng.normal(0, 0.1, 4), 0, 1)) for _ in range(3)]
        rows.append({"rewards": sum(groups, []), "group_rewards": groups})
    t = reward_trend(rows, 2, resamples=3000)
    xs = [i for i, r in enumerate(rows) for _ in r["group_rewards"]]
    ys = [float(np.mean(g)) for r in rows for g in r["group_rewards"]]
    assert t["fitted_rise"] == pytest.approx(np.polyfit(xs, ys, 1)[0] * 9, rel=1e-9)
    assert t["fitted_rise_ci95_low"] < t["fitted_rise"] < t["fitted_rise_ci95_high"]
    assert t["fitted_rise_ci95_low"] > 0  # a true rise of 0.45 over the run, noise 0.05 per group mean
    flat = [{"rewards": r["rewards"], "group_rewards": [[0.5] * 4] * 3} for r in rows]
    f = reward_trend(flat, 2, resamples=500)
    assert f["fitted_rise"] == 0 and f["fitted_rise_ci95_low"] == 0 == f["fitted_rise_ci95_high"]