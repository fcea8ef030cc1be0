"""The simulator (driving the real ElasticScheduler) reproduces the dispatch theory of
gyre/dispatch.py over >= 10k steps: boundary E[d], continuous-dispatch E[d], Little's law."""

from __future__ import annotations

import pytest

from gyre import dispatch as D
from gyre.scheduler import SchedulerConfig
from gyre.sim.config import ClusterConfig, SimConfig, TrainingModel
from gyre.sim.durations import HierarchicalLogNormal
from gyre.sim.engine import Simulation

STEPS = 10_000
# groups finish in a random order: query and execution spread, no cap in practice
DUR = HierarchicalLogNormal(m=0.0, sigma_q=0.6, sigma_e=0.4, cap_h=50.0)


def _run(phi, mu, dispatch="boundary", seed=0, B=2):
    cfg = SimConfig(
        scheduler=SchedulerConfig(
            mode="async", async_train_cells=1, streaming=True, phi=phi, mu=mu, n_per_group=1,
            batch_groups=B, dispatch=dispatch, tick_s=1e7, cell_concurrency=10_000,
        ),
        cluster=ClusterConfig(num_cells=2),
        training=TrainingModel(cell_hours_per_step=0.01, optimizer_s=1.0, param_send_s=0.0, tokens_scale=False),
        steps=STEPS,
        seed=seed,
    )
    return Simulation(cfg, DUR, f"{dispatch} phi={phi} mu={mu}").run()


@pytest.mark.parametrize("phi,mu", [(1, 1), (0, 3), (0.5, 3), (1, 2), (2, 1), (1.5, 2)])
def test_simulated_staleness_matches_closed_form(phi, mu):
    res = _run(phi, mu, seed=int(phi * 10 + mu))
    assert len(res.staleness) == STEPS * 2
    assert abs(res.mean_staleness - D.expected_staleness(phi, mu)) <= 0.01, res.mean_staleness


@pytest.mark.parametrize("phi,mu", [pytest.param(0.5, 3, marks=pytest.mark.slow), (1, 2), pytest.param(0, 3, marks=pytest.mark.slow)])
def test_continuous_dispatch_and_littles_law(phi, mu):
    B = 2
    b = _run(phi, mu, "boundary", seed=5)
    c = _run(phi, mu, "continuous", seed=5)
    q = D.continuous_matched_inflight(phi, mu, B)
    assert abs(c.mean_staleness - D.continuous_expected_staleness(q, B, mu)) <= 0.01
    assert abs(c.mean_staleness - b.mean_staleness) <= 0.02  # matched E[d]
    stats = {}
    for name, r in (("b", b), ("c", c)):
        T = r.total_h / STEPS
        W = sum(r.group_sojourn_h) / len(r.group_sojourn_h)
        L = r.groups_in_system_area_h / r.total_h
        assert D.littles_law_step_time(B, W, L) == pytest.approx(T, rel=0.01), name
        stats[name] = (T, W, L)
    (Tb, Wb, Lb), (Tc, Wc, Lc) = stats["b"], stats["c"]
    assert D.step_time_ratio_continuous_over_boundary(Wc, Lc, Wb, Lb) == pytest.approx(Tc / Tb, rel=0.02)
    # bursts with front-loaded dispatch keep more groups in flight at the same staleness
    assert Lb > Lc and Tc > Tb
