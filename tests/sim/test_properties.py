"""Scheduler invariants on random small clusters and configurations (hypothesis), checked by
replaying the event log of a simulated run."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gyre.scheduler import SchedulerConfig
from gyre.sim.config import ClusterConfig, SimConfig, TrainingModel
from gyre.sim.durations import HierarchicalLogNormal
from gyre.sim.engine import Simulation

DUR = HierarchicalLogNormal(m=-1.0, sigma_q=0.5, sigma_e=0.6, cap_h=2.0)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    mode=st.sampled_from(["gyre", "colocate", "async"]),
    streaming=st.booleans(),
    K=st.integers(2, 4),
    C_e=st.sampled_from([4, 8, 32]),
    C_s=st.sampled_from([0, 8]),
    N=st.integers(1, 3),
    B=st.integers(1, 3),
    phi_units=st.integers(0, 2),
    mu=st.integers(1, 3),
    seed=st.integers(0, 1000),
    wall_timeout_h=st.sampled_from([0.0, 0.3, 1.0]),  # DUR's executions run up to 2 h
)
def test_invariants_on_the_event_log(mode, streaming, K, C_e, C_s, N, B, phi_units, mu, seed, wall_timeout_h):
    steps = 2 * mu
    cfg = SimConfig(
        scheduler=SchedulerConfig(mode=mode, streaming=streaming, n_per_group=N, batch_groups=B,
                                  phi=phi_units, mu=mu, async_train_cells=1, tau=1, rho_min=0.5, cell_concurrency=C_e),
        cluster=ClusterConfig(num_cells=K, standalone_concurrency=C_s),
        training=TrainingModel(cell_hours_per_step=0.05),
        steps=steps,
        seed=seed,
        wall_timeout_h=wall_timeout_h,
    )
    res = Simulation(cfg, DUR, mode).run()
    roles = ["rollout"] * K
    ready: dict[int, int] = {}  # ready, unassigned group -> version
    per_step: dict[int, int] = {}
    dispatched = finished = 0
    for ev in res.log:
        if ev.kind == "dispatch":
            dispatched += ev["n_groups"] * N
        elif ev.kind == "exec_finish":
            finished += 1
            assert finished <= dispatched
        elif ev.kind == "switch_to_train":
            c = ev["cell"]
            assert roles[c] == "rollout"
            if mode != "colocate":
                # the training set stays a prefix: every lower cell is already out of rollout
                assert all(r != "rollout" for r in roles[:c])
            if mode == "gyre":
                assert ev["w"] <= ev["C_R"] and ev["supply_ticks"] >= 1
            roles[c] = "to_train"
        elif ev.kind == "switch_done":
            roles[ev["cell"]] = ev["role"]
        elif ev.kind == "switch_to_rollout":
            roles[ev["cell"]] = "to_rollout"
        elif ev.kind == "group_ready":
            ready[ev["group"]] = ev["version"]
        elif ev.kind == "assign":
            v = ready.pop(ev["group"])
            assert v == ev["version"] and ev["d"] == ev["step"] - v >= 0
            assert all(v <= other for other in ready.values()), "oldest dispatch version first"
            per_step[ev["step"]] = per_step.get(ev["step"], 0) + 1
        elif ev.kind == "optimizer_step":
            assert per_step.get(ev["step"], 0) == B
            assert 0 in ev["cells"]
    assert all(per_step[s] == B for s in range(steps))  # (step `steps` may have begun)
    if mode == "gyre":
        assert res.paused_executions == 0
