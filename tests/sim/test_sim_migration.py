"""The simulator charges each drained cell's in-flight calls the measured reroute cost: recompute
slows a run down, KV migration (measured far cheaper at long context) much less."""

from __future__ import annotations

import json

import pytest

from gyre.sim.config import SimConfig, reroute_s_from_bench
from gyre.sim.durations import NL2REPO_122B
from gyre.sim.engine import Simulation


def run(reroute_s: float):
    cfg = SimConfig(steps=6, seed=3)
    cfg.cluster.reroute_s = reroute_s
    return Simulation(cfg, NL2REPO_122B, "gyre").run()


def test_reroute_cost_enters_the_prediction():
    free, migrate, recompute = run(0.0), run(60.0), run(1800.0)
    assert free.rerouted_calls > 0 and free.reroute_delay_h == 0.0
    # the same drains happen (the scheduler's decisions do not depend on the delay until it
    # changes when executions end); each charged call pays reroute_s
    assert migrate.reroute_delay_h == pytest.approx(migrate.rerouted_calls * 60.0 / 3600.0)
    assert recompute.reroute_delay_h == pytest.approx(recompute.rerouted_calls * 1800.0 / 3600.0)
    assert free.total_h <= migrate.total_h < recompute.total_h


def test_costs_come_from_the_benchmark_file(tmp_path):
    path = tmp_path / "reroute_bench.json"
    path.write_text(json.dumps({"figures": {"gloo_16384_migrate_latency_s": 0.5, "recompute_16384_latency_s": 90.0,
                                            "mooncake_16384_migrate_latency_s": None}}))
    assert reroute_s_from_bench(str(path), 16384) == 0.5
    assert reroute_s_from_bench(str(path), 16384, "recompute") == 90.0
    with pytest.raises(KeyError, match="measured"):
        reroute_s_from_bench(str(path), 16384, transport="mooncake")
