"""The runner's wall-clock timeout in the simulator (`SimConfig.wall_timeout_h`): an execution
ends at dispatch + the limit whether it is running, queued or paused, hand-computed on one cell."""

from __future__ import annotations

import numpy as np
import pytest

from gyre.scheduler import SchedulerConfig
from gyre.sim.config import ClusterConfig, SimConfig, TrainingModel
from gyre.sim.engine import Simulation

H = 3600.0
TICK_H = 0.01


class Scripted:
    """Group g lasts hours[g] (one execution per group), in dispatch order."""

    def __init__(self, hours: list[float]) -> None:
        self.hours, self.next = hours, 0

    def sample_group(self, rng: np.random.Generator, n: int) -> np.ndarray:
        h = self.hours[self.next]
        self.next += 1
        return np.full(n, h * H)


def _run(hours: list[float], timeout_h: float, *, train_h: float = 5.0, kv_recompute_h: float = 0.0,
         tokens_scale: bool = False):
    """Colocate on one cell of one slot, φ = 1 (both groups dispatched at t = 0), μ = 1, every
    switch, optimizer and evaluation free: only executions and training take time."""
    cfg = SimConfig(
        scheduler=SchedulerConfig(mode="colocate", phi=1, mu=1, n_per_group=1, batch_groups=1, streaming=False,
                                  tick_s=TICK_H * H, tau=1, rho_min=1.0, cell_concurrency=1),
        cluster=ClusterConfig(num_cells=1, nodes_per_cell=4, kv_recompute_s=kv_recompute_h * H),
        training=TrainingModel(cell_hours_per_step=train_h, reference_nodes=4, scaling_exponent=1.0, tokens_scale=tokens_scale,
                               optimizer_s=0.0, param_send_s=0.0, switch_to_train_s=0.0, switch_to_rollout_s=0.0, eval_s=0.0),
        steps=2, seed=0, wall_timeout_h=timeout_h)
    sim = Simulation(cfg, Scripted([1.0] * 512))  # the mean-duration sample
    sim.durations = Scripted(hours + [100.0] * 8)  # groups dispatched after a publish: 100 h each
    return sim.run()


def test_a_paused_execution_is_cut_at_its_deadline():
    """Group 0 (1 h) runs, group 1 (10 h) waits for the slot, starts at 1 h and is paused at once
    when the cell trains step 0 (1 h → 6 h). Without a timeout it resumes at 6 h with all 10 h left,
    ends at 16 h and step 1 ends at 21 h; with a 4 h limit it is cut at 4 h while paused, so step 1 trains right
    after step 0 and ends at 11 h."""
    free = _run([1.0, 10.0], 0.0)
    cut = _run([1.0, 10.0], 4.0)
    # cut: group 1 at 4 h, and group 2 (dispatched at 6 h, paused at once by step 1) at 10 h
    assert free.timed_out_executions == 0 and cut.timed_out_executions == 2
    assert cut.paused_executions >= 1
    assert free.step_end_h == pytest.approx([6.0, 21.0], abs=3 * TICK_H)
    assert cut.step_end_h == pytest.approx([6.0, 11.0], abs=3 * TICK_H)


def test_running_and_queued_executions_are_cut_at_their_deadline():
    """Both groups last 10 h; group 1 waits in the queue for the only slot. A 4 h limit ends the
    running one and the queued one (never started) at 4 h: steps end at 9 h and 14 h instead of
    15 h and 30 h."""
    free = _run([10.0, 10.0], 0.0)
    cut = _run([10.0, 10.0], 4.0)
    assert cut.timed_out_executions == 3  # and group 2, dispatched at 9 h, paused, cut at 13 h
    assert free.step_end_h == pytest.approx([15.0, 30.0], abs=3 * TICK_H)
    assert cut.step_end_h == pytest.approx([9.0, 14.0], abs=3 * TICK_H)


def test_a_deadline_after_the_execution_ended_changes_nothing():
    free = _run([1.0, 2.0], 0.0)
    late = _run([1.0, 2.0], 50.0)
    assert late.timed_out_executions == 0 and late.step_end_h == free.step_end_h


def test_a_cut_execution_trains_only_the_work_it_did_not_its_owed_recompute():
    """Training cost ∝ duration (tokens_scale), a pause owes 0.5 h of prefix recompute. Group 1
    (10 h) is paused the moment it starts (1 h) and cut at 4 h having done no work: it trains
    for 0 h, so step 1 ends when step 0 does (6 h). Its remaining time (10.5 h) includes the
    recompute it owes; counting that as work undone gave it −0.5 h of training."""
    cut = _run([1.0, 10.0], 4.0, kv_recompute_h=0.5, tokens_scale=True)
    assert cut.timed_out_executions >= 1 and cut.paused_executions >= 1
    # step 0: group 0 (1 h of work, the mean) trains 5 h from 1 h; step 1: group 1, 0 h of work
    assert cut.step_end_h == pytest.approx([6.0, 6.0], abs=3 * TICK_H)


def test_a_rounding_error_never_schedules_an_event_in_the_past():
    """A paused execution's time left is its duration minus the pieces it ran, a float that can end
    a hair below the time already reached. Its finish was then pushed into the past and the run
    stopped with "SimClock cannot go back in time". Seen as `python -m gyre.plan --max-staleness
    1.5` failing on a profile calibrated from the CPU e2e runs: Colocate, φ 1.5, μ 1, seed 0, with
    that profile's point costs (below, rounded as stored)."""
    from dataclasses import replace

    from gyre.sim.plan import Candidate, Planner
    from gyre.sim.profile import Profile

    prof = Profile.from_dict({
        "format": "gyre-sim-profile/1", "name": "e2e seed 0",
        "cluster": {"num_cells": 4, "nodes_per_cell": 1, "cell_concurrency": 8, "standalone_concurrency": 0},
        "scheduler": {"n_per_group": 4, "batch_groups": 4, "tick_s": 0.2, "rho_min": 0.25, "tau": 1, "phi": 0.0,
                      "mu": 3, "mode": "gyre", "streaming": True},
        "training": {"reference_nodes": 1}, "wall_timeout_h": 0.008033256047222293,
        "costs": {k: {"value": v} for k, v in {
            "cell_hours_per_step": 0.0042540591519226656, "optimizer_s": 0.06022777434995987,
            "param_send_s": 0.020104227483125216, "switch_to_train_s": 0.12564647003442775,
            "switch_to_rollout_s": 0.22160104947928025, "eval_s": 0.20568217789581114,
            "reroute_s": 3.071020553400002}.items()},
        "durations": {"source": "lognormal", "m": -5.515710959093317, "sigma_q": 0.07521791333347795,
                      "sigma_e": 0.43793720293502014, "cap_h": 0.008033256047222293,
                      "hard_frac": 0.034722222222222224, "hard_median_h": 0.008033256047222293},
    })
    planner = Planner(prof, seeds=[0])
    colocate = Candidate(1, 4, 0, 1.5, 1, tau=2, mode="colocate")
    step_s, _, staleness = planner.run(colocate, 0)
    assert step_s > 0 and staleness == pytest.approx(1.5, abs=0.2)
    assert planner.run(replace(colocate, mode="gyre", phi=0.0, mu=4), 0)[0] > 0
