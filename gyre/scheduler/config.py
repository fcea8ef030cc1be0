"""Scheduler configuration (nested into the run config as `scheduler`: `--scheduler.mode ...`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from gyre import dispatch


@dataclass(kw_only=True)
class SchedulerConfig:
    """Elastic scheduler: boundary dispatch, water level, supply check, bursts (docs/design.md §2–3)."""

    mode: Literal["gyre", "colocate", "async"] = "gyre"
    """gyre: cells enter training one by one, core first, by the water-level rule. colocate: all
    cells switch together when the burst's batch is ready (with --scheduler.streaming also as
    soon as every outstanding execution fits in the standalone pool and the supply check holds). async: a fixed split, cells
    0..async-train-cells−1 train, the rest roll out."""
    phi: float = 0.5
    """φ: extra dispatch in batch units (φ·B must be an integer). E[d] = φ + (μ−1)/2."""
    mu: int = 3
    """μ: optimizer steps per burst; the policy is published after each burst."""
    cell_concurrency: int = 8
    """C_e: concurrent executions one rollout cell is counted for in the water level (a standalone
    pool engine counts the same: the runtime's C_s is pool engines · C_e)."""
    n_per_group: int = 16
    """N: executions per query (one group)."""
    batch_groups: int = 16
    """B: groups consumed by one optimizer step."""
    dispatch: Literal["boundary", "continuous"] = "boundary"
    """boundary: (φ+μ)·B groups at start, μ·B after each publish. continuous (for the theory
    checks): (φ+1)·B at start and B after every step, i.e. Q_c = (φ+1)·B groups in the system
    before each step, which matches the boundary E[d] (gyre/dispatch.py)."""
    rho_min: float = 0.25
    """Supply check: at least ρ_min·B (and at least one) ready, unassigned groups ..."""
    tau: int = 2
    """... for τ consecutive control ticks before the next cell may enter training."""
    tick_s: float = 30.0
    """Control period in seconds: the water level and the supply check are evaluated each tick."""
    streaming: bool = True
    """Streaming training: a step starts on the groups that are ready and takes the rest as they
    arrive (oldest dispatch version first). Off: a step starts only when all B groups are ready."""
    async_train_cells: int = 2
    """async mode: number of cells (a prefix, core first) that only train."""
    serial_join: bool = True
    """gyre mode: at most one cell switching to training at a time (cells enter serially)."""

    def validate(self, num_cells: int | None = None) -> None:
        """Raise ValueError naming the field on inconsistent settings."""
        if self.cell_concurrency < 1:
            raise ValueError(f"scheduler.cell_concurrency (C_e) must be >= 1, got {self.cell_concurrency}")
        if self.mu < 1:
            raise ValueError(f"scheduler.mu must be >= 1, got {self.mu}")
        if self.n_per_group < 1:
            raise ValueError(f"scheduler.n_per_group must be >= 1, got {self.n_per_group}")
        if self.batch_groups < 1:
            raise ValueError(f"scheduler.batch_groups must be >= 1, got {self.batch_groups}")
        try:
            dispatch.phi_groups(self.phi, self.batch_groups)
        except ValueError as e:
            raise ValueError(f"scheduler.phi: {e}") from None
        if not 0 <= self.rho_min <= 1:
            raise ValueError(f"scheduler.rho_min must be in [0, 1], got {self.rho_min}")
        if self.tau < 0:
            raise ValueError(f"scheduler.tau must be >= 0, got {self.tau}")
        if self.tick_s <= 0:
            raise ValueError(f"scheduler.tick_s must be > 0, got {self.tick_s}")
        if num_cells is not None:
            if num_cells < 1:
                raise ValueError(f"num_cells must be >= 1, got {num_cells}")
            if self.mode == "async" and not 1 <= self.async_train_cells < num_cells:
                raise ValueError(
                    f"scheduler.async_train_cells must be in [1, K−1] = [1, {num_cells - 1}], got {self.async_train_cells}"
                )

    @property
    def expected_staleness(self) -> float:
        """E[d] = φ + (μ−1)/2 for this configuration."""
        return dispatch.expected_staleness(self.phi, self.mu)
