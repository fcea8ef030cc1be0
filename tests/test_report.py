"""`python -m gyre.report RUN_DIR` on hand-written run directories: a finished run (run.json,
metrics.jsonl, summary.json, role_timeline.png), a running one (no summary, no timeline, a torn
last line), and directories that hold no run. The real job's directory is rendered in
tests/runtime/test_tracking.py."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gyre.report import NoRunError, intervals_from_rows, load_run, main, render, trend_line
from gyre.runtime.cell import CellState
from gyre.runtime.outputs import plot_role_timeline, reward_trend

ROOT = Path(__file__).resolve().parents[1]
PNG = b"\x89PNG\r\n\x1a\n"


def _rows() -> list[dict]:
    """Three steps; cell 0 rolls out 2 s then trains 1 s a step, cell 1 only rolls out."""
    rewards = [[0.0, 0.5], [0.5, 0.5], [1.0, 0.5]]
    rows = []
    for s, rw in enumerate(rewards):
        rows.append({"step": s, "version": s + 1, "rewards": rw, "group_rewards": [rw], "reward_mean": sum(rw) / 2,
                     "reward_count": 2, "loss": 0.1 * (s + 1), "clip_frac": 0.01 * s, "staleness_mean": 0.5,
                     "step_time_s": 3.0, "time_s": 3.0 * (s + 1), "grad_norm": 1.0,
                     "cell_time_s": {"0": {"rollout": 2.0 * (s + 1), "train": 1.0 * (s + 1)},
                                     "1": {"rollout": 3.0 * (s + 1)}}})
    return rows


def _write_run(path: Path, finished: bool) -> list[dict]:
    path.mkdir(parents=True)
    config = {"preset": "cpu-demo", "seed": 7, "train": {"steps": 3}, "actor": {"lr": 0.00123}}
    (path / "run.json").write_text(json.dumps({"started": "2026-12-01T10:00:00", "argv": ["gyre.run", "--seed", "7"],
                                               "world_size": 2, "config": config}))
    rows = _rows()
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if finished:
        summary = {"steps": 3, "wall_s": 9.5, "train_fraction": {"0": 0.33, "1": 0.0}, "error": None,
                   "reward_trend": reward_trend(rows, 1, resamples=200)}
        (path / "summary.json").write_text(json.dumps(summary))
        plot_role_timeline({0: [(CellState.ROLLOUT, 0.0, 9.0)], 1: [(CellState.TRAIN, 0.0, 9.0)]},
                           str(path / "role_timeline.png"))
    else:
        with (path / "metrics.jsonl").open("a") as f:
            f.write('{"step": 3, "loss": 0.')  # the line being written right now
    return rows


def test_a_finished_run_renders_its_figures_summary_steps_and_config(tmp_path):
    _write_run(tmp_path / "run", finished=True)
    page = render(tmp_path / "run")
    assert page == tmp_path / "run" / "report" / "report.html"
    for name in ("metrics.png", "role_timeline.png"):
        assert (page.parent / name).read_bytes()[:8] == PNG, name
    # The run's own timeline is used as it is.
    assert (page.parent / "role_timeline.png").read_bytes() == (tmp_path / "run" / "role_timeline.png").read_bytes()
    text = page.read_text()
    assert "finished: 3 steps" in text
    for s in range(3):  # a table row per step: step, version
        assert f"<tr><td>{s}</td><td>{s + 1}</td>" in text
    assert "<th>actor.lr</th><td>0.00123</td>" in text and "<th>train.steps</th><td>3</td>" in text
    assert "<th>reward_trend.fitted_rise</th>" in text and "<th>train_fraction.0</th><td>0.33</td>" in text
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    rise = summary["reward_trend"]["fitted_rise"]
    # the reward trend leads: the line before the figures, and the summary table's first rows
    assert text.index(f"reward: fitted rise {rise:+.3f}") < text.index("<h2>Figures</h2>")
    table = text[text.index("<h2>Summary (summary.json)</h2>"):]
    assert table.index("<th>reward_trend.") < table.index("<th>wall_s</th>")
    assert text.count('src="data:image/png;base64,') == 2  # both figures embedded
    assert "<script" not in text and "http://" not in text and "https://" not in text and "<link" not in text


def test_a_running_run_renders_from_its_rows_alone(tmp_path):
    _write_run(tmp_path / "run", finished=False)
    out = tmp_path / "elsewhere"
    page = render(tmp_path / "run", out)
    assert page == out / "report.html" and not (tmp_path / "run" / "report").exists()
    assert (out / "metrics.png").read_bytes()[:8] == PNG
    assert (out / "role_timeline.png").read_bytes()[:8] == PNG  # drawn from the rows
    text = page.read_text()
    assert "running (or stopped before its end): 3 steps so far" in text  # the torn 4th line skipped
    assert "<tr><td>2</td><td>3</td>" in text and "<th>actor.lr</th><td>0.00123</td>" in text
    assert "Summary" not in text


def test_the_timeline_of_a_running_run_is_the_per_step_time_per_state():
    ivs = intervals_from_rows(_rows())
    R, T = CellState.ROLLOUT, CellState.TRAIN
    assert ivs[0] == [(R, 0.0, 2.0), (T, 2.0, 3.0), (R, 3.0, 5.0), (T, 5.0, 6.0), (R, 6.0, 8.0), (T, 8.0, 9.0)]
    assert ivs[1] == [(R, 0.0, 3.0), (R, 3.0, 6.0), (R, 6.0, 9.0)]
    # A resumed run's clock starts again: its slices follow the first run's.
    resumed = [{"step": 3, "time_s": 2.0, "cell_time_s": {"0": {"rollout": 2.0}}}]
    assert intervals_from_rows(_rows() + resumed)[0][-1] == (R, 9.0, 11.0)


def test_the_trend_line_is_the_fitted_rise_through_the_mean():
    rows = _rows()  # rewards by step: {0, .5}, {.5, .5}, {1, .5}: slope 0.25 a step, mean 0.5 at step 1
    trend = reward_trend(rows, 1, resamples=200)
    assert trend["fitted_rise"] == pytest.approx(0.5)
    xs, ys = trend_line(rows, trend)
    assert xs == [0, 2] and ys == pytest.approx([0.25, 0.75])
    assert trend_line(rows, {}) is None


def test_a_directory_without_a_run_is_a_clear_error(tmp_path, capsys):
    with pytest.raises(NoRunError, match="no such directory"):
        load_run(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    assert main([str(tmp_path / "empty")]) == 2
    err = capsys.readouterr().err
    assert "holds no Gyre run" in err and "run.json" in err and "metrics.jsonl" in err
    assert not (tmp_path / "empty" / "report").exists()


def test_help_explains_the_command():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "COLUMNS": "200"}
    proc = subprocess.run([sys.executable, "-m", "gyre.report", "--help"], capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    for words in ("python -m gyre.report [-h] RUN_DIR [--out STR]", "--out", "report.html", "still running", "metrics.png"):
        assert words in proc.stdout, (words, proc.stdout)


def test_the_page_names_each_launch_of_a_resumable_run(tmp_path):
    """run.json as the runs write it (issue 35 item 5: the page said "started None on None ranks"):
    its `attempts`, each with its start, world size, command and end."""
    from gyre.runtime.attempts import end_attempt, write_manifest

    _write_run(tmp_path / "run", finished=True)
    (tmp_path / "run" / "run.json").unlink()

    assert write_manifest(tmp_path / "run", {"preset": "cpu-demo"}, 4) == 0
    end_attempt(tmp_path / "run", 0, {"steps": 2, "error": "interrupted by SIGTERM"})
    assert write_manifest(tmp_path / "run", {"preset": "cpu-demo"}, 2, start_version=2) == 1
    text = render(tmp_path / "run").read_text()
    assert "None" not in text.split("<h2>")[0], text.split("<h2>")[0]
    assert "<b>run</b> started 20" in text and "on 4 ranks, ended 20" in text and "after 2 steps" in text
    assert "<b>attempt 1</b> started 20" in text and "on 2 ranks, no end recorded" in text


def test_evaluations_beside_the_run_are_shown_base_first(tmp_path):
    _write_run(tmp_path / "run", finished=True)
    (tmp_path / "run" / "eval").mkdir()
    for name, k in (("heldout-step_000003.json", 20), ("heldout-base.json", 6)):
        (tmp_path / "run" / "eval" / name).write_text(json.dumps(
            {"checkpoint": f"/x/{name.split('-', 1)[1][:-5]}", "split": "heldout", "executions": 32, "passed": k,
             "pass_rate": k / 32, "pass_ci95_low": 0.1, "pass_ci95_high": 0.9}))
    (tmp_path / "run" / "eval" / "junk.json").write_text("{")
    text = render(tmp_path / "run").read_text()
    section = text[text.index("<h2>Evaluations"):]
    assert section.index("<td>base</td>") < section.index("<td>step_000003</td>")
    assert "<td>6/32</td><td>0.188</td>" in section and "<td>20/32</td><td>0.625</td>" in section
