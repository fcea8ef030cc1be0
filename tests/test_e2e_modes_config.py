"""benchmarks/e2e_modes.py compares modes only if they are what it says: every mode parses as a
real run configuration at matched E[d] = 1, and the timing window holds whole periods of every
mode's step pattern (bursts of μ steps; the long/short pairs of the φ = 1 baselines)."""

import importlib.util
import math
from pathlib import Path

import pytest

from gyre.config import parse_config

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def e2e():
    spec = importlib.util.spec_from_file_location("e2e_modes", ROOT / "benchmarks" / "e2e_modes.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_every_mode_parses_at_matched_staleness(e2e):
    for variant, (mode, phi, mu, streaming) in e2e.MODES.items():
        name = f"{variant}@2" if variant in e2e.SPLIT_MODES else variant
        cfg = parse_config(["--scheduler.batch-groups", "4", *e2e.run_args(name)]).scheduler
        assert (cfg.mode, cfg.phi, cfg.mu, cfg.streaming) == (mode, phi, mu, streaming), variant
        assert cfg.phi + (cfg.mu - 1) / 2 == pytest.approx(1.0), variant  # E[d], docs/theory.md
        if variant in e2e.SPLIT_MODES:
            assert cfg.async_train_cells == 2


def test_the_window_holds_whole_periods_of_every_mode(e2e):
    period = math.lcm(2, *(mu for _, _, mu, _ in e2e.MODES.values()))
    assert e2e.WINDOW_PERIOD % period == 0


def test_plan_flags_become_a_mode_run_as_given():
    spec = importlib.util.spec_from_file_location("e2e_modes_plan", ROOT / "benchmarks" / "e2e_modes.py")
    mod = importlib.util.module_from_spec(spec)  # a fresh copy: set_plan_flags adds a mode to MODES
    spec.loader.exec_module(mod)
    flags = "--scheduler.phi 0.5 --scheduler.mu 2 --scheduler.rho-min 0 --scheduler.tau 0 --scheduler.no-serial-join"
    fields = mod.set_plan_flags(flags)
    assert fields == {"phi": 0.5, "mu": 2, "rho-min": 0.0, "tau": 0, "serial-join": False}
    cfg = parse_config(["--scheduler.batch-groups", "4", "--scheduler.tau", "1", *mod.run_args(mod.PLAN_MODE)]).scheduler
    assert (cfg.mode, cfg.phi, cfg.mu, cfg.rho_min, cfg.tau, cfg.serial_join) == ("gyre", 0.5, 2, 0.0, 0, False)
    assert mod.MODES[mod.PLAN_MODE] == ("gyre", 0.5, 2, True)
    with pytest.raises(SystemExit, match="parallel.cell-size"):
        mod.set_plan_flags("--scheduler.phi 0 --scheduler.mu 3 --parallel.cell-size 8")
    with pytest.raises(SystemExit, match="phi"):
        mod.set_plan_flags("--scheduler.mu 3")


def test_calibration_check_reads_each_runs_flags_as_gyre_run_does():
    """benchmarks/calibration_check.py predicts each mode from the flags e2e_modes recorded for it:
    they must give the scheduler fields that `gyre.run` itself parses from the same flags."""
    spec = importlib.util.spec_from_file_location("e2e_modes_calib", ROOT / "benchmarks" / "e2e_modes.py")
    e2e = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(e2e)
    e2e.set_plan_flags("--scheduler.phi 0.5 --scheduler.mu 2 --scheduler.rho-min 0 --scheduler.tau 0 --scheduler.no-serial-join")
    spec = importlib.util.spec_from_file_location("calibration_check", ROOT / "benchmarks" / "calibration_check.py")
    cc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cc)
    names = [f"{v}@2" if v in e2e.SPLIT_MODES else v for v in e2e.MODES]
    held = {"runs": {n: " ".join(e2e.run_args(n)) for n in names}}
    for name in names:
        got = cc.mode_settings(held, name)
        want = parse_config(["--scheduler.batch-groups", "4", *e2e.run_args(name)]).scheduler
        assert got, name
        for field, value in got.items():
            assert getattr(want, field) == value, (name, field)
        assert want.mode == got.get("mode", "gyre"), name
