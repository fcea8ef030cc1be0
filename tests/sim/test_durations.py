"""Duration models (the fitted NL2RepoBench preset, measured durations from CSV / run dir) and
the `python -m gyre.sim` CLI."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import numpy as np
import pytest

from gyre.sim.__main__ import main
from gyre.sim.config import SimConfig
from gyre.sim.durations import (
    HOUR,
    NL2REPO_122B,
    NL2REPO_122B_TARGETS,
    EmpiricalDurations,
    HierarchicalLogNormal,
    sample_stats,
)
from gyre.sim.engine import Simulation


def test_preset_reproduces_the_four_paper_statistics_within_5_percent():
    # Monte Carlo, independent of the quadrature the fit used
    d = NL2REPO_122B.sample(np.random.default_rng(123), 40_000, 16)
    got = sample_stats(d, cap_h=NL2REPO_122B.cap_h)
    for key, target in NL2REPO_122B_TARGETS.items():
        assert got[key] == pytest.approx(target, rel=0.05), (key, got[key], target)


def test_hand_checked_lognormal_without_query_effect():
    # σ_q = 0, no cap in practice: mean = exp(m + σ²/2)
    model = HierarchicalLogNormal(m=0.0, sigma_q=0.0, sigma_e=0.5, cap_h=1e6)
    d = model.sample(np.random.default_rng(0), 20_000, 4) / HOUR
    assert d.mean() == pytest.approx(np.exp(0.125), rel=0.01)
    with pytest.raises(ValueError):
        HierarchicalLogNormal(m=0.0, sigma_q=0.1, sigma_e=0.0, cap_h=1.0)


def test_empirical_from_csv_and_run_dir(tmp_path):
    csv = tmp_path / "d.csv"
    csv.write_text("group,duration_s\na,10\na,20\nb,100\nb,300\n")
    model = EmpiricalDurations.from_csv(str(csv))
    rng = np.random.default_rng(0)
    seen = {tuple(sorted(model.sample_group(rng, 2))) for _ in range(50)}
    assert seen == {(10.0, 20.0), (100.0, 300.0)}  # whole groups, never mixed
    run = tmp_path / "run"
    run.mkdir()
    (run / "executions.jsonl").write_text(
        "\n".join(json.dumps(r) for r in [{"group": 1, "start": 5, "end": 15}, {"group": 1, "start": 0, "end": 40}])
    )
    assert sorted(EmpiricalDurations.from_run_dir(str(run)).sample_group(rng, 2)) == [10.0, 40.0]
    bad = tmp_path / "bad.csv"
    bad.write_text("query,duration_s\na,1\n")
    with pytest.raises(ValueError, match="'group'"):
        EmpiricalDurations.from_csv(str(bad))
    with pytest.raises(FileNotFoundError):
        EmpiricalDurations.from_run_dir(str(tmp_path))


def test_durations_from_a_runs_event_log(tmp_path):
    """A run directory holding only the scheduler's event log: durations are recovered exactly."""
    cfg = SimConfig(steps=2)
    cfg.scheduler.batch_groups = 4
    cfg.cluster.num_cells = 2
    model = HierarchicalLogNormal(m=0.0, sigma_q=0.3, sigma_e=0.3, cap_h=5.0)
    sim = Simulation(cfg, model, "gyre")
    sim.run()
    sim.log.write_jsonl(str(tmp_path / "events.jsonl"))
    measured = EmpiricalDurations.from_run_dir(str(tmp_path))
    finished = {g for g, left in sim.group_left.items() if left == 0}
    truth = sorted(sorted(sim.ex_dur[e] for e in sim.group_execs[g]) for g in finished)
    got = sorted(sorted(g.tolist()) for g in measured.groups if len(g) == cfg.scheduler.n_per_group)
    assert len(got) == len(truth) and np.allclose(np.array(got), np.array(truth))


def test_cli_runs_and_writes_outputs(tmp_path, capsys):
    out = tmp_path / "o"
    assert main(["--steps", "3", "--scheduler.batch-groups", "8", "--cluster.num-cells", "4", "--out-dir", str(out)]) == 0
    text = capsys.readouterr().out
    assert "measured E[d]" in text and "cell  0 |" in text
    result = json.loads((out / "result.json").read_text())
    assert len(result["step_times_h"]) == 3 and (out / "timeline.png").stat().st_size > 1000
    assert (out / "events.jsonl").read_text().count("\n") > 100


def test_cli_bad_input_is_a_clear_error(capsys):
    assert main(["--durations.source", "csv"]) == 2
    assert "--durations.path is required" in capsys.readouterr().err
    assert main(["--scheduler.phi", "0.3"]) == 2  # φ·B = 9.6 is not an integer
    assert "scheduler.phi" in capsys.readouterr().err


def test_cli_help():
    r = subprocess.run([sys.executable, "-m", "gyre.sim", "--help"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "--scheduler.mode" in r.stdout and "--durations.source" in r.stdout


def test_32_node_48_step_simulation_is_fast():
    t = time.process_time()
    res = Simulation(SimConfig(steps=48), NL2REPO_122B, "E0").run()
    assert time.process_time() - t < 30  # CPU seconds: "well under a minute"
    assert len(res.step_end_h) == 48 and res.paused_executions == 0
    assert abs(res.mean_staleness - 1.5) < 0.1  # 48 steps: start transient still visible
