"""gyre.sim.plan: the search finds the optimum of a case small enough to compute by hand.

Every execution lasts exactly 1 h (σ ≈ 0), rollout slots are plentiful and training, switches
and updates are (nearly) free. Then every burst is one wave of executions: dispatch μ·B groups,
they all end 1 h later, the μ steps train in seconds and the next μ·B are dispatched. A step
takes 3600/μ s whatever φ is, so the best configuration at E[d] = φ + (μ−1)/2 ≤ D is φ = 0 and
the largest μ with (μ−1)/2 ≤ D: μ = 1 (3600 s) at D = 0, μ = 3 (1200 s) at D = 1, μ = 4
(900 s, the search's largest μ) at D = 1.5.
"""

from __future__ import annotations

import math

import pytest

from gyre.sim.plan import Candidate, Planner, search, staleness_pairs
from gyre.sim.profile import FORMAT, Profile


def _profile() -> Profile:
    free = {"value": 0.0, "lo": 0.0, "hi": 0.0, "n": 0}
    return Profile.from_dict({
        "format": FORMAT, "name": "one-hour",
        "cluster": {"gpus_per_node": 1, "num_cells": 4, "nodes_per_cell": 1, "cell_concurrency": 64},
        "scheduler": {"n_per_group": 2, "batch_groups": 2, "tick_s": 5.0},
        "training": {"reference_nodes": 1},
        "costs": {"cell_hours_per_step": {"value": 0.0005, "lo": 0.0005, "hi": 0.0005, "n": 0},
                  "optimizer_s": free, "param_send_s": free, "switch_to_train_s": free, "switch_to_rollout_s": free},
        "durations": {"source": "lognormal", "m": 0.0, "sigma_q": 0.0, "sigma_e": 1e-9, "cap_h": 5.0},
    })


@pytest.mark.parametrize("max_d, mu, step_s", [(0.0, 1, 3600.0), (1.0, 3, 1200.0), (1.5, 4, 900.0)])
def test_search_finds_the_hand_computed_optimum(max_d, mu, step_s):
    planner = Planner(_profile(), steps=12, seeds=[0])
    best, scored = search(planner, total_nodes=4, max_staleness=max_d, cell_nodes=[1], keep=2, finalists=2,
                          pool=False, thresholds=[(0.25, 2, True)])
    top = best[0]
    assert (top.cand.phi, top.cand.mu) == (0.0, mu)
    assert top.cand.staleness <= max_d
    assert all(s.cand.staleness <= max_d for s in scored)
    # 3600/μ plus the supply check's two 5 s ticks and a few seconds of training per burst
    assert step_s <= top.step_s <= step_s * 1.04
    # the baselines publish every step (μ = 1, φ = E[d]): at most 1 + φ waves of B groups an hour
    bound = 3600.0 / (1.0 + top.cand.staleness)
    assert top.colocate_s >= bound * 0.99 and top.async_s >= bound * 0.99
    assert top.colocate_s > top.step_s or max_d == 0.0


def test_staleness_pairs_are_exactly_those_within_the_bound():
    pairs = staleness_pairs(1.0, batch_groups=4)
    expect = {(q / 4, mu) for mu in (1, 2, 3, 4) for q in range(13) if q / 4 + (mu - 1) / 2 <= 1.0}
    assert set(pairs) == expect
    assert (0.0, 3) in pairs and (0.5, 2) in pairs and (1.0, 1) in pairs and (0.25, 3) not in pairs
    # φ·B must be whole: B = 2 leaves out the quarter steps
    assert all(math.isclose(p * 2, round(p * 2)) for p, _ in staleness_pairs(1.5, batch_groups=2))


def test_run_flags_name_the_configuration():
    c = Candidate(nodes_per_cell=2, num_cells=7, pool_cells=1, phi=0.5, mu=2, rho_min=0.0, tau=0, serial_join=False)
    flags = c.run_flags(gpus_per_node=8, ref_nodes=4, ref_ce=144, tick_s=30.0).split()
    assert flags[flags.index("--parallel.cell-size") + 1] == "16"
    assert flags[flags.index("--parallel.standalone-ranks") + 1] == "16"
    assert flags[flags.index("--scheduler.cell-concurrency") + 1] == "72"  # C_e scales with the cell's nodes
    assert flags[flags.index("--scheduler.mu") + 1] == "2" and "--scheduler.no-serial-join" in flags


def test_bad_input_is_refused_by_name(tmp_path, capsys):
    from gyre.plan import main  # the command, through its front (gyre/plan.py)
    from gyre.sim.profile import ProfileError

    path = tmp_path / "p.json"
    _profile().save(str(path))
    assert main(["--profile", str(path), "--gpus", "3", "--gpus-per-node", "2", "--png", ""]) == 2
    assert "--gpus 3" in capsys.readouterr().err
    assert main(["--profile", str(path), "--gpus", "4", "--cell-nodes", "one", "--png", ""]) == 2
    assert "--cell-nodes" in capsys.readouterr().err
    raw = _profile().to_dict()
    raw["costs"]["optimizer_s"] = {"value": 5.0, "lo": 6.0, "hi": 7.0}
    with pytest.raises(ProfileError, match="costs.optimizer_s"):
        Profile.from_dict(raw)
    raw["costs"] = {"optimiser_s": {"value": 1.0}}
    with pytest.raises(ProfileError, match="optimiser_s"):
        Profile.from_dict(raw)
