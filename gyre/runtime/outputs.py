"""Run outputs: `metrics.jsonl` (one JSON object per optimizer step) and the role timeline PNG
(cells × time coloured by role, like the paper's Fig. 6a, next to each cell's training-time
fraction, Fig. 6b)."""

from __future__ import annotations

import json
import math
import os
from typing import Any, Iterable

from gyre.runtime.cell import CellState

ROLE_COLOURS = {
    CellState.ROLLOUT: "#4c9be8",
    CellState.DRAINING: "#f2c14e",
    CellState.JOINING: "#f28e2b",
    CellState.TRAIN: "#d1495b",
    CellState.PUBLISHING: "#8e44ad",
    CellState.RESUMING: "#59a14f",
}


class MetricsWriter:
    """Appends one JSON line per record and flushes it, so a crash loses at most the line being
    written. Non-finite floats are written as null (JSON has no NaN)."""

    def __init__(self, path: str) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.path = path
        self._f = open(path, "a", encoding="utf-8")

    @staticmethod
    def _clean(v: Any) -> Any:
        if isinstance(v, float) and not math.isfinite(v):
            return None
        if isinstance(v, dict):
            return {k: MetricsWriter._clean(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [MetricsWriter._clean(x) for x in v]
        return v

    def write(self, record: dict[str, Any]) -> None:
        self._f.write(json.dumps(self._clean(record), sort_keys=True) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def read_metrics(path: str) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_role_timeline(
    intervals: dict[int, Iterable[tuple[CellState, float, float]]],
    path: str,
    title: str = "Gyre role timeline",
) -> dict[int, float]:
    """Draw cells × time coloured by state, and the training-time fraction per cell.

    intervals: cell → [(state, start, end)] in seconds (any origin). Returns the fractions."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    from gyre.runtime.cell import TRAIN_STATES

    cells = sorted(intervals)
    ivs = {c: list(intervals[c]) for c in cells}
    t0 = min((a for c in cells for _, a, _ in ivs[c]), default=0.0)
    fractions = {}
    for c in cells:
        total = sum(b - a for _, a, b in ivs[c])
        fractions[c] = sum(b - a for s, a, b in ivs[c] if s in TRAIN_STATES) / total if total > 0 else 0.0

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 1.2 + 0.5 * len(cells)), gridspec_kw={"width_ratios": [4, 1]})
    for row, c in enumerate(cells):
        for s, a, b in ivs[c]:
            ax.barh(row, b - a, left=a - t0, color=ROLE_COLOURS[s], edgecolor="none", height=0.8)
    ax.set_yticks(range(len(cells)), [f"cell {c}" + (" (core)" if c == 0 else "") for c in cells])
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    ax.set_title(title)
    ax.legend(handles=[Patch(color=col, label=s.value) for s, col in ROLE_COLOURS.items()],
              loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=len(ROLE_COLOURS), fontsize=8, frameon=False)
    bx.barh(range(len(cells)), [fractions[c] for c in cells], color=ROLE_COLOURS[CellState.TRAIN])
    bx.set_yticks(range(len(cells)), [str(c) for c in cells])
    bx.invert_yaxis()
    bx.set_xlim(0, 1)
    bx.set_xlabel("training-time fraction")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return fractions


def reward_trend(rows: list[dict[str, Any]], k: int, *, resamples: int = 10000, seed: int = 0) -> dict[str, float]:
    """Did the reward rise? Compare the executions' rewards in the first `k` steps with the last `k`.

    Returns the two means, their difference (last − first) and a two-sided 95 % bootstrap
    confidence interval of that difference (explicit seeded generator). When the rows carry
    `group_rewards`, whole groups are resampled (a cluster bootstrap: the N executions of a group
    share a task, so they are not independent draws); otherwise single executions are.
    `rows` are metrics.jsonl records carrying per-step `rewards` (and `group_rewards`).
    Also returns `fitted_rise`: the least-squares slope of reward on step over every step,
    times the number of steps − 1, with its bootstrap interval (uses all the data, not only the
    two windows).
    """
    import numpy as np

    if not 1 <= k <= len(rows) // 2:
        raise ValueError(f"reward_trend: k must be in [1, {len(rows) // 2}] for {len(rows)} steps, got {k}")
    by_group = all("group_rewards" in r for r in rows)

    def clusters(window: list[dict[str, Any]]) -> list[list[float]]:
        if by_group:
            return [[float(x) for x in g] for r in window for g in r["group_rewards"] if g]
        return [[float(x)] for r in window for x in r["rewards"]]

    first, last = clusters(rows[:k]), clusters(rows[-k:])
    if not first or not last:
        raise ValueError("reward_trend: a window has no rewarded executions")
    rng = np.random.default_rng(seed)

    def boot_means(cl: list[list[float]]) -> np.ndarray:
        sums = np.array([sum(c) for c in cl])
        sizes = np.array([len(c) for c in cl], dtype=np.float64)
        idx = rng.integers(0, len(cl), (resamples, len(cl)))
        return sums[idx].sum(1) / sizes[idx].sum(1)

    def mean(cl: list[list[float]]) -> float:
        return sum(map(sum, cl)) / sum(map(len, cl))

    diffs = boot_means(last) - boot_means(first)
    lo, hi = np.quantile(diffs, [0.025, 0.975])

    # All steps at once: the least-squares slope of reward on step (clusters weighted by their
    # size), as the fitted rise over the run, with the same cluster bootstrap.
    pts = [(i, sum(c) / len(c), len(c)) for i, r in enumerate(rows) for c in clusters([r])]
    x, y, w = (np.array(v, dtype=np.float64) for v in zip(*pts))

    def slopes(idx: np.ndarray) -> np.ndarray:
        xx, yy, ww = x[idx], y[idx], w[idx]
        xm = (ww * xx).sum(-1, keepdims=True) / ww.sum(-1, keepdims=True)
        ym = (ww * yy).sum(-1, keepdims=True) / ww.sum(-1, keepdims=True)
        den = (ww * (xx - xm) ** 2).sum(-1)
        return np.where(den > 0, (ww * (xx - xm) * (yy - ym)).sum(-1) / np.where(den > 0, den, 1.0), 0.0)

    span = len(rows) - 1
    rise = float(slopes(np.arange(len(x)))) * span
    rise_lo, rise_hi = np.quantile(slopes(rng.integers(0, len(x), (resamples, len(x)))) * span, [0.025, 0.975])
    return {"first_mean": float(mean(first)), "last_mean": float(mean(last)), "diff": float(mean(last) - mean(first)),
            "ci95_low": float(lo), "ci95_high": float(hi), "unit": "group" if by_group else "execution",
            "n_first": sum(map(len, first)), "n_last": sum(map(len, last)),
            "fitted_rise": rise, "fitted_rise_ci95_low": float(rise_lo), "fitted_rise_ci95_high": float(rise_hi)}
