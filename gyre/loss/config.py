"""The loss's own settings (docs/design.md §6): clip range, IS-weight cap, and what |E| counts.

The actors read ε and C from here and pass the three numbers to `gyre.loss.gspo_loss`, which
takes them without defaults (these are the only ones); the controller reads `denominator` to
turn a step's execution counts into the one gradient factor the core applies before clipping
(`grad_scale`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["LossConfig"]


@dataclass(kw_only=True)
class LossConfig:
    """Execution-level GSPO (docs/design.md §6)."""

    eps_low: float = 0.005
    """Clip: an execution with A < 0 is gated off when its ratio s_i < 1 − eps_low."""
    eps_high: float = 0.005
    """Clip: an execution with A > 0 is gated off when its ratio s_i > 1 + eps_high."""
    cap: float = 5.0
    """C: token importance weights are min(exp(δ_t), C)."""
    denominator: Literal["valid", "nominal"] = "valid"
    """|E| in loss = −(1/|E|)·Σ_i …. 'valid': the step's executions with a valid reward (scored,
    or a harness-failure placeholder at reward 0; evaluation failures are excluded), as in
    docs/design.md §6. 'nominal': B·N, every dispatched execution, whether it got a reward or not
    (a step with excluded executions then takes a smaller step). Either way a group is packed
    with the nominal B·N, because a streaming step packs groups before it knows the others; the
    core rescales the summed gradient by B·N / valid before clipping (see `grad_scale`)."""

    def __post_init__(self) -> None:
        if not (self.eps_low >= 0 and self.eps_high >= 0):
            raise ValueError(f"loss.eps_low and loss.eps_high must be >= 0, got {self.eps_low}, {self.eps_high}")
        if not self.cap > 0:
            raise ValueError(f"loss.cap must be > 0, got {self.cap}")
        if self.denominator not in ("valid", "nominal"):
            raise ValueError(f"loss.denominator must be 'valid' or 'nominal', got {self.denominator!r}")

    def grad_scale(self, *, nominal: int, valid: int) -> float | None:
        """Factor on a step's gradient packed with |E| = `nominal`, so that it is the gradient of the
        loss under this convention; None when the step has no valid execution (no update).

        The loss is linear in 1/|E|, so packing with B·N and multiplying by B·N / valid once is
        exact. Example: B·N = 8 with 2 executions excluded → 8/6 under 'valid', 1 under 'nominal'.
        """
        if nominal < 1 or not 0 <= valid <= nominal:
            raise ValueError(f"need nominal >= 1 and 0 <= valid <= nominal, got nominal={nominal}, valid={valid}")
        if valid == 0:
            return None
        return nominal / valid if self.denominator == "valid" else 1.0
