"""Trajectory-processor options (store, selection, materialization). The lead wires this into
`gyre/config.py`; `TrainConfig.j_max / max_tokens / normalize_std` may instead be passed
straight to `materialize_step`."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True)
class TrajectoryConfig:
    """TITO store and trajectory processing (docs/design.md §4–6)."""

    store_dir: str = "tito"
    """Directory (under run_dir) of the per-execution TITO store files, `<execution_id>.tito`."""
    store_fsync: bool = False
    """fsync after every appended record (durable across machine crashes, slower)."""
    store_delta_window: int = 4
    """Recent records a store writer compares each input with to store only the new suffix (0: verbatim)."""
    j_max: int = 5
    """J_max: trajectories selected per execution; 0 means unlimited (docs/design.md §5)."""
    max_tokens: int = 4096
    """Tokens per packed micro-step; an execution is kept in one micro-step when it fits."""
    normalize_std: bool = True
    """Divide group-relative advantages by the group's reward std (population std)."""
    skip_zero_advantage: bool = False
    """Leave executions with A_i = 0 (all-equal groups) out of the step: no tokens, not in |E|."""

    @property
    def j_max_or_none(self) -> int | None:
        return None if self.j_max == 0 else self.j_max

    def __post_init__(self) -> None:
        if self.j_max < 0:
            raise ValueError(f"trajectory.j_max must be >= 0 (0 = unlimited), got {self.j_max}")
        if self.max_tokens < 2:
            raise ValueError(f"trajectory.max_tokens must be >= 2, got {self.max_tokens}")
        if self.store_delta_window < 0:
            raise ValueError(f"trajectory.store_delta_window must be >= 0, got {self.store_delta_window}")
