"""Dispatch and staleness math (docs/design.md §2, §7; paper appendix A). Pure: ints and floats only.

Vocabulary. A *group* is one query run N times (N executions). A training step consumes B
groups. A *burst* is μ consecutive steps, after which the policy is published. Versions count
optimizer steps, so the published versions are 0, μ, 2μ, ... For a consumed group:

    v_d = latest *published* version when the group was dispatched
    v_t = the version just before the step that consumes it  (= the step index s, 0-based)
    d   = v_t − v_d                                          (staleness, ≥ 0)

Boundary dispatch (what Gyre and its baselines use): at start (φ+μ)·B groups, then μ·B right
after each publish; φ is the *extra* dispatch in batch units (φ·B an integer). Whatever the
completion order, E[d] = φ + (μ − 1)/2. Continuous dispatch keeps Q groups in the system and
matches it at Q_c = (φ + 1)·B; Little's law gives the step-time ratio T_c/T_b. Derivations and
their tests: docs/theory.md §1–4.

Example::

    >>> boundary_dispatch_plan(phi=0.5, mu=3, batch_groups=4, bursts=3)
    [(0, 14), (3, 12), (6, 12)]
    >>> expected_staleness(0.5, 3)
    1.5
    >>> fifo_boundary_staleness(phi=1, mu=2, batch_groups=1, steps=6)
    [0, 1, 2, 1, 2, 1]
"""

from __future__ import annotations

import math
from fractions import Fraction

__all__ = [
    "phi_groups",
    "initial_dispatch_executions",
    "burst_dispatch_executions",
    "boundary_dispatch_plan",
    "dispatch_version_of_group",
    "staleness",
    "expected_staleness",
    "fifo_boundary_staleness",
    "continuous_expected_staleness",
    "continuous_matched_inflight",
    "mean_groups_in_system_at_steps",
    "littles_law_step_time",
    "step_time_ratio_continuous_over_boundary",
    "matched_step_time_ratio",
    "phi_mu_for_staleness",
]


def _as_fraction(x: float, name: str) -> Fraction:
    f = Fraction(x).limit_denominator(10_000)
    if abs(float(f) - float(x)) > 1e-9:
        raise ValueError(f"{name}={x!r} is not a simple fraction")
    return f


def phi_groups(phi: float, batch_groups: int) -> int:
    """φ·B as an exact int: the groups dispatched beyond μ·B at start. Raises if not integral.

    >>> phi_groups(0.5, 16)
    8
    """
    if batch_groups < 1:
        raise ValueError(f"batch_groups (B) must be >= 1, got {batch_groups}")
    if phi < 0:
        raise ValueError(f"phi must be >= 0, got {phi}")
    f = _as_fraction(phi, "phi") * batch_groups
    if f.denominator != 1:
        raise ValueError(f"phi·B must be an integer (phi={phi}, B={batch_groups} gives {float(f)})")
    return int(f)


def _check_mu(mu: int) -> None:
    if not isinstance(mu, int) or mu < 1:
        raise ValueError(f"mu (steps per burst) must be an int >= 1, got {mu!r}")


def initial_dispatch_executions(phi: float, mu: int, n_per_group: int, batch_groups: int) -> int:
    """(φ + μ)·N·B executions dispatched at start."""
    _check_mu(mu)
    if n_per_group < 1:
        raise ValueError(f"n_per_group (N) must be >= 1, got {n_per_group}")
    return (phi_groups(phi, batch_groups) + mu * batch_groups) * n_per_group


def burst_dispatch_executions(mu: int, n_per_group: int, batch_groups: int) -> int:
    """μ·N·B executions dispatched right after each publish."""
    _check_mu(mu)
    return mu * n_per_group * batch_groups


def boundary_dispatch_plan(phi: float, mu: int, batch_groups: int, bursts: int) -> list[tuple[int, int]]:
    """[(published version at dispatch, groups dispatched)] for the start and the first
    `bursts − 1` publishes: [(0, (φ+μ)B), (μ, μB), (2μ, μB), ...]."""
    _check_mu(mu)
    first = phi_groups(phi, batch_groups) + mu * batch_groups
    return [(0, first)] + [(b * mu, mu * batch_groups) for b in range(1, bursts)]


def dispatch_version_of_group(g: int, phi: float, mu: int, batch_groups: int) -> int:
    """v_d of the g-th dispatched group (0-based, in dispatch order) under boundary dispatch."""
    _check_mu(mu)
    first = phi_groups(phi, batch_groups) + mu * batch_groups
    if g < first:
        return 0
    return mu * (1 + (g - first) // (mu * batch_groups))


def staleness(v_t: int, v_d: int) -> int:
    """d = v_t − v_d for one consumed sample; negative staleness is a bookkeeping bug."""
    d = v_t - v_d
    if d < 0:
        raise ValueError(f"negative staleness: consumed at v_t={v_t} but dispatched at v_d={v_d}")
    return d


def expected_staleness(phi: float, mu: int) -> float:
    """E[d] = φ + (μ − 1)/2 under boundary dispatch (long-run mean, any completion order)."""
    _check_mu(mu)
    if phi < 0:
        raise ValueError(f"phi must be >= 0, got {phi}")
    return float(phi) + (mu - 1) / 2


def phi_mu_for_staleness(target: float, mu: int) -> float:
    """φ giving E[d] = target for a burst length μ (raises if it would be negative)."""
    phi = target - (mu - 1) / 2
    if phi < 0:
        raise ValueError(f"E[d]={target} is unreachable with mu={mu}: needs phi={phi} < 0")
    return phi


def fifo_boundary_staleness(phi: float, mu: int, batch_groups: int, steps: int) -> list[int]:
    """Exact d of every group consumed in steps 0..steps−1 when groups are consumed in dispatch
    order (every group ready in time). Length steps·B. Its mean tends to φ + (μ−1)/2; the
    first burst is a transient (all its groups have v_d = 0)."""
    out = []
    for g in range(steps * batch_groups):
        out.append(staleness(g // batch_groups, dispatch_version_of_group(g, phi, mu, batch_groups)))
    return out


def continuous_expected_staleness(q_groups: int, batch_groups: int, mu: int, interpolated: bool = False) -> float:
    """E[d] under continuous dispatch with Q groups in the system before every step.

    Every consumed group is replaced at once. Little's law in version time: after step s the
    system holds Q − B groups dispatched at versions ≤ s, each of which adds 1 to the staleness
    of its group for every version it waits, so E[d_interp] = (Q − B)/B with v_d = the current
    (possibly unpublished) version. With v_d = the latest published version, a dispatch made
    after step s sees version μ·⌊(s+1)/μ⌋, lagging by (s+1) mod μ, which averages (μ−1)/2.
    """
    _check_mu(mu)
    if q_groups < batch_groups:
        raise ValueError(f"q_groups (Q={q_groups}) must be >= B={batch_groups}: a step needs B groups in the system")
    base = q_groups / batch_groups - 1.0
    return base if interpolated else base + (mu - 1) / 2


def continuous_matched_inflight(phi: float, mu: int, batch_groups: int) -> int:
    """Q_c such that continuous dispatch (published v_d, same μ) has the boundary E[d]: (φ+1)·B."""
    _check_mu(mu)
    return phi_groups(phi, batch_groups) + batch_groups


def mean_groups_in_system_at_steps(phi: float, mu: int, batch_groups: int) -> float:
    """Boundary dispatch: groups in the system right before each step, averaged over a burst.

    Before step s = jμ + i there are (φ + μ − i)·B, so the mean is (φ + (μ+1)/2)·B = (E[d]+1)·B.
    """
    _check_mu(mu)
    return (phi_groups(phi, batch_groups) / batch_groups + (mu + 1) / 2) * batch_groups


def littles_law_step_time(batch_groups: int, mean_sojourn: float, mean_in_system: float) -> float:
    """T = B·W/L̄: step time implied by Little's law (W = mean dispatch→consumption time,
    L̄ = time-average number of groups dispatched and not yet consumed)."""
    if mean_in_system <= 0:
        raise ValueError(f"mean_in_system must be > 0, got {mean_in_system}")
    return batch_groups * mean_sojourn / mean_in_system


def step_time_ratio_continuous_over_boundary(
    sojourn_c: float, in_system_c: float, sojourn_b: float, in_system_b: float
) -> float:
    """T_c/T_b = (W_c/W_b)·(L̄_b/L̄_c) (Little's law applied to each policy; same B)."""
    if sojourn_b <= 0 or in_system_c <= 0:
        raise ValueError("sojourn_b and in_system_c must be > 0")
    return (sojourn_c / sojourn_b) * (in_system_b / in_system_c)


def matched_step_time_ratio(phi: float, mu: int) -> float:
    """Closed-form T_c/T_b at matched E[d] assuming equal sojourn W and step-boundary averages
    of the in-system count: (φ + (μ+1)/2)/(φ + 1). Equals 1 for μ = 1."""
    _check_mu(mu)
    if phi < 0 or math.isnan(phi):
        raise ValueError(f"phi must be >= 0, got {phi}")
    return (phi + (mu + 1) / 2) / (phi + 1)
