"""Run outputs: `metrics.jsonl` (one JSON object per optimizer step), the role timeline PNG
(cells × time by role, the paper's Fig. 6a, beside each cell's training fraction, Fig. 6b), the
reward trend, and the experiment trackers (`Trackers`: copies of the rows for TensorBoard / W&B;
with none on, a null object). `gyre.runtime.records` decides what is written when.
"""

from __future__ import annotations

import glob
import json
import logging
import math
import os
from typing import Any, Callable, Iterable, Protocol

from gyre.runtime.cell import CellState

logger = logging.getLogger(__name__)

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


def reroute_fields(records: list[Any]) -> dict[str, Any]:
    """metrics.jsonl fields for the reroutes since the previous row (`Router.take_reroutes`):
    how many continued by KV migration and by recompute, the tokens recomputed, the KV bytes
    moved, the mean latency (pause on the source → first token elsewhere) of each, and the
    migrations that fell back to recompute."""
    def mean(xs: list[float]) -> float | None:
        return sum(xs) / len(xs) if xs else None

    mig = [r for r in records if r.mode == "migrate"]
    rec = [r for r in records if r.mode == "recompute"]
    return {"reroutes_migrated": len(mig), "reroutes_recomputed": len(rec),
            "reroute_tokens_recomputed": sum(r.tokens_recomputed for r in records),
            "reroute_bytes_moved": sum(r.bytes_moved for r in records),
            "migration_fallbacks": sum(r.fallback is not None for r in records),
            "reroute_latency_s_migrated": mean([r.latency_s for r in mig if r.latency_s >= 0]),
            "reroute_latency_s_recomputed": mean([r.latency_s for r in rec if r.latency_s >= 0])}


def read_metrics(path: str) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def train_fractions(intervals: dict[int, Iterable[tuple[CellState, float, float]]]) -> dict[int, float]:
    """Each cell's training-time fraction.

    >>> train_fractions({0: [(CellState.ROLLOUT, 0.0, 3.0), (CellState.TRAIN, 3.0, 4.0)], 1: []})
    {0: 0.25, 1: 0.0}
    """
    from gyre.runtime.cell import TRAIN_STATES

    out = {}
    for c in sorted(intervals):
        ivs = list(intervals[c])
        total = sum(b - a for _, a, b in ivs)
        out[c] = sum(b - a for s, a, b in ivs if s in TRAIN_STATES) / total if total > 0 else 0.0
    return out


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

    cells = sorted(intervals)
    ivs = {c: list(intervals[c]) for c in cells}
    t0 = min((a for c in cells for _, a, _ in ivs[c]), default=0.0)
    fractions = train_fractions(ivs)

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
    """Did the reward rise? The mean reward of the first `k` steps against the last `k` (`rows`:
    metrics.jsonl records with `rewards`, and `group_rewards`), their difference with a 95 %
    bootstrap interval, and `fitted_rise`: the least-squares slope of reward on step times
    (steps − 1), with its interval. With `group_rewards`, whole groups are resampled (a cluster
    bootstrap: a group's executions share a task); otherwise single executions are."""
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
            "n_first": sum(map(len, first)), "n_last": sum(map(len, last)), "k_steps": k,
            "groups_first": len(first) if by_group else None, "groups_last": len(last) if by_group else None,
            "fitted_rise": rise, "fitted_rise_ci95_low": float(rise_lo), "fitted_rise_ci95_high": float(rise_hi)}


# ----------------------------------------------------------------------------- trackers
def flatten_numeric(row: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """The numeric fields of a metrics.jsonl row as flat tags, nested dicts joined with `/`; bools
    as 0/1; lists, nulls, non-finite floats, strings and the top-level `step` (the x-axis) skipped.

    >>> flatten_numeric({"step": 3, "loss": 0.5, "cell_time_s": {"0": {"train": 1.5}}, "rewards": [1, 0]})
    {'loss': 0.5, 'cell_time_s/0/train': 1.5}
    """
    out: dict[str, float] = {}
    for k, v in row.items():
        if not prefix and k == "step":
            continue
        tag = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten_numeric(v, tag + "/"))
        elif isinstance(v, bool):
            out[tag] = float(v)
        elif isinstance(v, (int, float)) and math.isfinite(v):
            out[tag] = float(v)
    return out


class Tracker(Protocol):
    """One experiment tracker: a copy of the metrics rows and the run's figures."""

    def log(self, row: dict[str, Any], step: int) -> None: ...

    def image(self, name: str, png_path: str, step: int) -> None: ...

    def close(self, failed: bool) -> None: ...


class TensorBoardTracker:
    """Scalars and images through `torch.utils.tensorboard.SummaryWriter` (needs `tensorboard`).

    `fresh`: delete earlier event files in `log_dir` first, as a fresh run replaces
    metrics.jsonl (a resumed run appends a new event file; its steps count on)."""

    def __init__(self, log_dir: str, fresh: bool = True) -> None:
        from torch.utils.tensorboard import SummaryWriter

        if fresh:
            for old in glob.glob(os.path.join(log_dir, "events.out.tfevents.*")):
                os.remove(old)
        self.log_dir = log_dir
        self._w = SummaryWriter(log_dir=log_dir)

    def log(self, row: dict[str, Any], step: int) -> None:
        for tag, v in flatten_numeric(row).items():
            self._w.add_scalar(tag, v, global_step=step)
        self._w.flush()  # a running run is readable in TensorBoard step by step

    def image(self, name: str, png_path: str, step: int) -> None:
        import matplotlib.image as mpimg

        img = mpimg.imread(png_path)  # [H, W, 4] float RGBA in [0, 1] for a PNG
        self._w.add_image(name, img[..., :3], global_step=step, dataformats="HWC")
        self._w.flush()

    def close(self, failed: bool) -> None:
        self._w.close()


class WandbTracker:
    """A Weights & Biases run (needs `wandb`): the config once, each row at `step=` the
    optimizer step, images as `wandb.Image`. `mode="offline"` writes only under `dir`
    (`wandb sync DIR/wandb/offline-run-*` uploads it later)."""

    def __init__(self, *, project: str, name: str, group: str, run_dir: str, config: dict[str, Any],
                 mode: str = "offline") -> None:
        import wandb

        self._wandb = wandb
        self._run = wandb.init(project=project, name=name, group=group, dir=run_dir, config=config, mode=mode)

    def log(self, row: dict[str, Any], step: int) -> None:
        self._run.log(flatten_numeric(row), step=step)

    def image(self, name: str, png_path: str, step: int) -> None:
        self._run.log({name: self._wandb.Image(png_path)}, step=step)

    def close(self, failed: bool) -> None:
        self._run.finish(exit_code=1 if failed else 0)


class Trackers:
    """Fan-out to the run's trackers; with none, a null object. A tracker that raises is logged
    once and dropped (metrics.jsonl holds the row; a tracker's hiccup must not end a long run).
    `close` is idempotent, so every exit path may call it."""

    def __init__(self, trackers: Iterable[Tracker] = ()) -> None:
        self._trackers = list(trackers)
        self._closed = False

    def __len__(self) -> int:
        return len(self._trackers)

    def _each(self, what: str, *args: Any) -> None:
        for t in list(self._trackers):
            try:
                getattr(t, what)(*args)
            except Exception:
                logger.exception("tracker %s failed in %s; it is dropped for the rest of the run "
                                 "(metrics.jsonl is unaffected)", type(t).__name__, what)
                self._trackers.remove(t)

    def log(self, row: dict[str, Any], step: int) -> None:
        self._each("log", row, step)

    def image(self, name: str, png_path: str, step: int) -> None:
        self._each("image", name, png_path, step)

    def close(self, failed: bool) -> None:
        if not self._closed:
            self._closed = True
            self._each("close", failed)


def make_trackers(tc: Any, run_dir: str, *, name: str, group: str, config: dict[str, Any],
                  fresh: bool) -> Trackers:
    """The trackers `tc` (a `gyre.config.TrackingConfig`) switches on, writing under `run_dir`.
    The packages were checked at config time (`gyre.config_checks.check_train_config`)."""
    trackers: list[Tracker] = []
    if tc.tensorboard:
        trackers.append(TensorBoardTracker(os.path.join(run_dir, "tensorboard"), fresh=fresh))
    if tc.wandb:
        trackers.append(WandbTracker(project=tc.wandb_project, name=tc.wandb_name or name, group=group,
                                     run_dir=run_dir, config=config, mode=tc.wandb_mode))
    return Trackers(trackers)


def truncate_jsonl(path: str | os.PathLike, keep_until: Callable[[list[dict[str, Any]]], int]) -> int:
    """Cut a JSONL file back to its first `keep_until(rows)` rows, atomically (a temporary file
    renamed over it); a torn last line (a crash while writing it) is dropped too. Returns how
    many rows were dropped; a missing file is left missing."""
    if not os.path.exists(path):
        return 0
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                rows.append(json.loads(line)) if line.strip() else None
            except json.JSONDecodeError:
                break  # torn: nothing after it was written whole
    keep = keep_until(rows)
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        for row in rows[:keep]:
            f.write(json.dumps(row, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return len(rows) - keep


def write_text(path: "os.PathLike[str] | str", text: str) -> None:
    """Write `text` so that `path` holds the old file or the whole new one, never a part; the
    temporary (beside `path`, named by this process) is removed when the write fails."""
    head, name = os.path.split(os.fspath(path))
    tmp = os.path.join(head, f".{name}.tmp{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def write_json(path: "os.PathLike[str] | str", data: Any, indent: int = 2) -> None:
    """`data` as JSON, written whole or not at all (`write_text`)."""
    write_text(path, json.dumps(data, indent=indent, default=str))


def metrics_until(version: int) -> Callable[[list[dict[str, Any]]], int]:
    """For `truncate_jsonl` on metrics.jsonl: the rows of steps 0..version−1 (a resume from the
    checkpoint of `version` trains step `version` next; rows past it belong to steps whose update
    the checkpoint does not hold)."""
    def keep(rows: list[dict[str, Any]]) -> int:
        return next((i for i, r in enumerate(rows) if r.get("step", -1) >= version), len(rows))
    return keep


def events_until(version: int) -> Callable[[list[dict[str, Any]]], int]:
    """For `truncate_jsonl` on events.jsonl: every event up to the `step_done` of step version−1
    (nothing when version is 0)."""
    def keep(rows: list[dict[str, Any]]) -> int:
        if version == 0:
            return 0
        ends = [i for i, r in enumerate(rows) if r.get("kind") == "step_done" and r.get("step") == version - 1]
        return ends[-1] + 1 if ends else len(rows)
    return keep


def append_events(log: Any, path: str, *, attempt: int, start_version: int) -> None:
    """Append an attempt's scheduler events to events.jsonl after an `attempt` line (earlier
    attempts' events stay, cut back to the resumed version by `truncate_jsonl`)."""
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(json.dumps({"t": log.events[0].t if log.events else 0.0, "kind": "attempt", "attempt": attempt,
                             "version": start_version}) + "\n")
        for e in log.events:
            fh.write(json.dumps({"t": e.t, "kind": e.kind, **e.data}) + "\n")
