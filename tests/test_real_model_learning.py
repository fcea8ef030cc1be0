"""benchmarks/real_model_learning.py's judgement, on hand-made evaluations (the benchmark itself
trains for ~15 min a seed; it is run by hand, its results in benchmarks/results/): the held-out
before/after with Newcombe's interval, the two measurements' agreement, and the goal's count."""

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.real_model_learning import agree, before_after, report  # noqa: E402


def test_before_after_is_the_pass_rates_and_newcombes_interval_of_their_difference():
    got = before_after({"passed": 15, "executions": 128}, {"passed": 100, "executions": 128})
    assert got["before"] == round(15 / 128, 4) and got["after"] == round(100 / 128, 4)
    assert got["diff"] == round(85 / 128, 4) and got["excludes_zero"]
    low, high = got["diff_ci95"]
    assert low < 85 / 128 < high and 0 < low and high < 1
    flat = before_after({"passed": 15, "executions": 128}, {"passed": 18, "executions": 128})
    assert flat["diff_ci95"][0] < 0 < flat["diff_ci95"][1] and not flat["excludes_zero"]


def test_two_measurements_agree_when_each_difference_lies_in_the_others_interval():
    a = {"diff": 0.60, "diff_ci95": [0.50, 0.70]}
    assert agree(a, {"diff": 0.55, "diff_ci95": [0.40, 0.65]})
    assert not agree(a, {"diff": 0.45, "diff_ci95": [0.30, 0.62]})  # 0.45 outside a's interval
    assert not agree(a, {"diff": 0.52, "diff_ci95": [0.45, 0.58]})  # a's 0.60 outside b's


def test_the_goal_needs_both_rises_in_two_seeds_and_the_results_file_is_written_after_each(tmp_path, capsys):
    def run(seed, heldout, rise):
        ev = before_after({"passed": 15, "executions": 128}, {"passed": 100 if heldout else 20, "executions": 128})
        return {"seed": seed, "train_wall_s": 900.0, "train_load_mean": 2.0, "fitted_rise_excludes_zero": rise,
                "gyre_eval": ev}

    args = argparse.Namespace(out=str(tmp_path / "r.json"))

    base = {"pass_rate": 15 / 128}
    for runs, met in (([run(0, True, False), run(1, True, True)], False),
                      ([run(0, True, True), run(1, False, True), run(2, True, True)], True)):
        report(runs, base, args, 0.0)
        figures = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert figures["goal_met"] is met and figures["seeds"] == len(runs)
        assert json.loads(Path(args.out).read_text())["figures"] == figures
