"""Execution outcomes and group-relative advantages (docs/design.md §5, "Rewards").

An execution ends in one of three outcomes:
  SCORED          the evaluator returned a reward (partial progress counts after a timeout);
  EVAL_FAILED     evaluation failed after its retries: the execution is *excluded* (no reward,
                  no advantage, not in the group statistics, not trained);
  HARNESS_FAILED  the harness failed outright: a zero-reward placeholder that takes part in the
                  group statistics like any scored execution.

Advantages are computed over each group's valid (SCORED or HARNESS_FAILED) executions:
A = r − mean(r), divided by the population standard deviation (ddof 0) when `normalize_std`.
A group whose valid rewards are all equal (or that has one valid execution) yields zero
advantages and is flagged `all_equal` — it contributes no signal. A group with no valid
execution is flagged `empty`.

Example: rewards [1, 0, 0, 1] → mean 0.5, std 0.5 → A = [1, −1, −1, 1];
without std: [0.5, −0.5, −0.5, 0.5].
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

__all__ = ["GroupAdvantages", "Outcome", "OutcomeKind", "compute_advantages", "group_advantages"]


class OutcomeKind(enum.Enum):
    SCORED = "scored"
    EVAL_FAILED = "eval_failed"
    HARNESS_FAILED = "harness_failed"


@dataclass(frozen=True)
class Outcome:
    kind: OutcomeKind
    reward: float | None = None

    def __post_init__(self) -> None:
        if self.kind is OutcomeKind.SCORED:
            if self.reward is None or not math.isfinite(self.reward):
                raise ValueError(f"Outcome.reward must be a finite float for a scored execution, got {self.reward!r}")
        elif self.reward is not None:
            raise ValueError(f"Outcome.reward must be None for {self.kind.value} (got {self.reward!r})")

    @classmethod
    def scored(cls, reward: float) -> "Outcome":
        return cls(OutcomeKind.SCORED, float(reward))

    @classmethod
    def eval_failed(cls) -> "Outcome":
        return cls(OutcomeKind.EVAL_FAILED)

    @classmethod
    def harness_failed(cls) -> "Outcome":
        return cls(OutcomeKind.HARNESS_FAILED)

    @property
    def valid(self) -> bool:
        """Takes part in the group statistics (and in training)."""
        return self.kind is not OutcomeKind.EVAL_FAILED

    @property
    def value(self) -> float | None:
        """The reward used for advantages: the score, 0.0 for a harness failure, None if excluded."""
        if self.kind is OutcomeKind.SCORED:
            return self.reward
        if self.kind is OutcomeKind.HARNESS_FAILED:
            return 0.0
        return None


@dataclass
class GroupAdvantages:
    advantages: np.ndarray  # [N] float64, NaN where excluded
    valid: np.ndarray  # [N] bool
    all_equal: bool  # valid rewards all equal (incl. a single valid one): zero signal
    empty: bool  # no valid execution

    @property
    def num_valid(self) -> int:
        return int(self.valid.sum())


def group_advantages(outcomes: Sequence[Outcome], *, normalize_std: bool = True) -> GroupAdvantages:
    """Advantages of one group of N executions. Returns [N] float64 (NaN for excluded)."""
    if len(outcomes) == 0:
        raise ValueError("group_advantages: a group needs at least one execution")
    valid = np.array([o.valid for o in outcomes], np.bool_)
    adv = np.full(len(outcomes), np.nan, np.float64)
    if not valid.any():
        return GroupAdvantages(adv, valid, all_equal=False, empty=True)
    r = np.array([o.value for o in outcomes if o.valid], np.float64)
    if r.max() == r.min():
        adv[valid] = 0.0
        return GroupAdvantages(adv, valid, all_equal=True, empty=False)
    centred = r - r.mean()
    if normalize_std:
        # std > 0 here: at least two rewards differ, so std >= (max - min) / N.
        centred = centred / r.std()
    adv[valid] = centred
    return GroupAdvantages(adv, valid, all_equal=False, empty=False)


def compute_advantages(groups: Sequence[Sequence[Outcome]], *, normalize_std: bool = True) -> list[GroupAdvantages]:
    """`group_advantages` for each group of a step, in order."""
    return [group_advantages(g, normalize_std=normalize_std) for g in groups]
