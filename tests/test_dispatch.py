"""Dispatch and staleness math (gyre/dispatch.py) against hand-computed values and against an
independent event-driven simulation with seeded random completion orders (written here, not
taken from the code under test)."""

from __future__ import annotations

import heapq
import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gyre import dispatch as D

PAIRS = [(1, 1), (0, 3), (0.5, 3), (1, 2), (2, 1), (1.5, 2), (0, 1), (0.25, 4)]


def test_counts_hand_computed():
    # N=16, B=16, φ=0.5, μ=3: (0.5+3)·16·16 = 896 then 3·16·16 = 768 (the paper's 122B setting).
    assert D.initial_dispatch_executions(0.5, 3, 16, 16) == 896
    assert D.burst_dispatch_executions(3, 16, 16) == 768
    assert D.boundary_dispatch_plan(1, 2, 3, 4) == [(0, 9), (2, 6), (4, 6), (6, 6)]
    assert D.phi_groups(0.25, 8) == 2
    # group 9 is the first dispatched at version 2 when (φ+μ)B = 9, μB = 6
    assert [D.dispatch_version_of_group(g, 1, 2, 3) for g in (0, 8, 9, 14, 15)] == [0, 0, 2, 2, 4]


def test_expected_staleness_values():
    assert D.expected_staleness(1, 1) == 1.0
    assert D.expected_staleness(0, 3) == 1.0
    assert D.expected_staleness(0.5, 3) == 1.5
    assert D.expected_staleness(1, 2) == 1.5
    assert D.phi_mu_for_staleness(1.5, 3) == 0.5
    with pytest.raises(ValueError, match="unreachable"):
        D.phi_mu_for_staleness(0.5, 3)


def test_bad_inputs_name_the_field():
    with pytest.raises(ValueError, match="phi·B must be an integer"):
        D.phi_groups(0.5, 3)
    with pytest.raises(ValueError, match="mu"):
        D.initial_dispatch_executions(1, 0, 4, 4)
    with pytest.raises(ValueError, match="negative staleness"):
        D.staleness(2, 3)
    with pytest.raises(ValueError, match="q_groups"):
        D.continuous_expected_staleness(3, 4, 1)


def test_fifo_schedule_hand_computed():
    # φ=1, μ=2, B=1: groups 0,1,2 at v_d=0 consumed at steps 0,1,2; then pairs at v_d=2,4,...
    assert D.fifo_boundary_staleness(1, 2, 1, 8) == [0, 1, 2, 1, 2, 1, 2, 1]
    # φ=0, μ=1: always fresh
    assert set(D.fifo_boundary_staleness(0, 1, 3, 10)) == {0}


@settings(max_examples=40, deadline=None)
@given(
    phi_num=st.integers(0, 12),
    mu=st.integers(1, 5),
    b=st.sampled_from([1, 2, 4]),
)
def test_fifo_steady_state_mean_is_exact(phi_num, mu, b):
    """After the first burst, the FIFO mean over whole bursts equals φ+(μ−1)/2 exactly."""
    phi = phi_num / 4
    if (phi * b) != int(phi * b):
        return
    warm = math.ceil(phi) + mu + mu  # skip the start transient, whole bursts after it
    warm = ((warm + mu - 1) // mu) * mu
    n_bursts = 20
    d = D.fifo_boundary_staleness(phi, mu, b, warm + n_bursts * mu)[warm * b :]
    assert sum(d) / len(d) == pytest.approx(D.expected_staleness(phi, mu), abs=1e-12)


# ----------------------------------------------------------------------------- independent sim
def _simulate(policy: str, mu: int, b: int, steps: int, rng: random.Random, *, phi: float = 0.0, q: int = 0):
    """Groups take lognormal time (random completion order); a step consumes B ready groups,
    oldest published dispatch version first, as soon as B are ready (training takes no time).
    boundary: (φ+μ)B at start, μB after each publish. continuous: Q at start, B after each step.
    Returns per consumed group (d, d_interp), step times, sojourns and ∫(in system) dt."""
    now = 0.0
    version = 0
    published = 0
    pending: list[tuple[float, int]] = []  # (finish time, gid)
    ready: list[tuple[int, float, int]] = []  # (v_d, finish time, gid)
    info: dict[int, tuple[int, int, float]] = {}  # gid -> (v_d published, v_d interp, t_dispatch)
    gid = 0
    area, last_t, in_sys = 0.0, 0.0, 0
    d, d_interp, sojourn, step_times = [], [], [], []

    def dispatch(n):
        nonlocal gid, in_sys
        for _ in range(n):
            info[gid] = (published, version, now)
            heapq.heappush(pending, (now + rng.lognormvariate(0.0, 1.0), gid))
            gid += 1
        in_sys += n

    dispatch(int(round((phi + mu) * b)) if policy == "boundary" else q)
    while len(step_times) < steps:
        t, g = heapq.heappop(pending)
        area += in_sys * (t - last_t)
        last_t = now = t
        heapq.heappush(ready, (info[g][0], t, g))
        while len(ready) >= b and len(step_times) < steps:
            for _ in range(b):
                vd, _, g2 = heapq.heappop(ready)
                d.append(D.staleness(version, vd))
                d_interp.append(version - info[g2][1])
                sojourn.append(now - info[g2][2])
            in_sys -= b
            version += 1
            step_times.append(now)
            if policy == "continuous":
                if version % mu == 0:
                    published = version
                dispatch(b)
            elif version % mu == 0:
                published = version
                dispatch(mu * b)
    return d, d_interp, step_times, sojourn, area


@pytest.mark.parametrize("phi,mu", PAIRS)
def test_boundary_closed_form_vs_random_completion_orders(phi, mu):
    b, steps = 4, 10_000
    rng = random.Random(1000 + int(phi * 8) * 10 + mu)
    d, _, _, _, _ = _simulate("boundary", mu, b, steps, rng, phi=phi)
    assert len(d) == steps * b
    measured = sum(d) / len(d)
    assert abs(measured - D.expected_staleness(phi, mu)) <= 0.02, (phi, mu, measured)
    # with φ > 0 the random order really matters: staleness is not the FIFO schedule
    # (with φ = 0 every burst consumes exactly its own dispatch, whatever the order)
    if phi > 0:
        assert d != D.fifo_boundary_staleness(phi, mu, b, steps)


@pytest.mark.parametrize("q,b,mu", [(4, 4, 1), (6, 4, 1), (8, 4, 2), (10, 4, 3), (12, 4, 2), (6, 2, 4)])
def test_continuous_dispatch_formula(q, b, mu):
    rng = random.Random(q * 100 + b * 10 + mu)
    d, d_interp, *_ = _simulate("continuous", mu, b, 10_000, rng, q=q)
    assert abs(sum(d) / len(d) - D.continuous_expected_staleness(q, b, mu)) <= 0.02
    assert abs(sum(d_interp) / len(d_interp) - D.continuous_expected_staleness(q, b, mu, interpolated=True)) <= 0.02


@pytest.mark.parametrize("phi,mu", [(0.5, 3), (1, 2), (0, 3)])
def test_matched_continuous_dispatch_has_same_staleness(phi, mu):
    b = 4
    qc = D.continuous_matched_inflight(phi, mu, b)
    assert D.continuous_expected_staleness(qc, b, mu) == pytest.approx(D.expected_staleness(phi, mu))
    d, *_ = _simulate("continuous", mu, b, 10_000, random.Random(7), q=qc)
    assert abs(sum(d) / len(d) - D.expected_staleness(phi, mu)) <= 0.02


@pytest.mark.parametrize("phi,mu", [(0.5, 3), (1, 2)])
def test_littles_law_step_time_and_ratio(phi, mu):
    """T = B·W/L̄ holds on both policies' sample paths; so T_c/T_b = (W_c/W_b)(L̄_b/L̄_c)."""
    b, steps = 4, 10_000
    measured = {}
    for policy in ("boundary", "continuous"):
        kw = dict(phi=phi) if policy == "boundary" else dict(q=D.continuous_matched_inflight(phi, mu, b))
        _, _, times, sojourn, area = _simulate(policy, mu, b, steps, random.Random(11), **kw)
        horizon = times[-1]
        t_step = horizon / steps
        w, lbar = sum(sojourn) / len(sojourn), area / horizon
        assert D.littles_law_step_time(b, w, lbar) == pytest.approx(t_step, rel=0.01), policy
        measured[policy] = (t_step, w, lbar)
    (tb, wb, lb), (tc, wc, lc) = measured["boundary"], measured["continuous"]
    assert D.step_time_ratio_continuous_over_boundary(wc, lc, wb, lb) == pytest.approx(tc / tb, rel=0.02)
    # at matched E[d] bursts keep more groups in flight: boundary steps are faster (μ > 1)
    assert tc / tb > 1.0


def test_mean_in_system_at_steps_matches_counting():
    # φ=0.5, μ=3, B=4: before the steps of a burst 14, 10, 6 groups → mean 10 = (1.5+1)·4
    assert D.mean_groups_in_system_at_steps(0.5, 3, 4) == 10
    assert D.matched_step_time_ratio(0.5, 3) == pytest.approx(2.5 / 1.5)
    assert D.matched_step_time_ratio(2, 1) == 1.0
