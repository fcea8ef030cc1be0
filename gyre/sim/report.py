"""Outputs of the simulator: summaries, the Table-1-like comparison, the role timeline."""

from __future__ import annotations

import json
import os

import numpy as np

from gyre.sim.engine import SimResult


def summary(res: SimResult) -> dict:
    """Headline numbers of one run (JSON-able)."""
    cum = list(np.round(res.step_end_h, 4))
    return {
        "label": res.label,
        "total_h": round(res.total_h, 4),
        "step_times_h": [round(x, 4) for x in res.step_times_h],
        "cumulative_h": cum,
        "mean_staleness": round(res.mean_staleness, 4),
        "idle_gpu_fraction": round(res.idle_gpu_fraction, 4),
        "train_role_idle_fraction": round(res.train_idle_fraction, 4),
        "rollout_slot_utilization": round(res.rollout_slot_hours / max(res.capacity_slot_hours, 1e-12), 4),
        "cell_training_fraction": [round(res.role_fraction(c), 4) for c in range(res.num_cells)],
        "paused_executions": res.paused_executions,
    }


def format_run(res: SimResult) -> str:
    s = summary(res)
    lines = [
        f"{res.label}: {s['total_h']:.2f} h for {len(res.step_end_h)} steps, measured E[d] = {s['mean_staleness']:.3f}",
        f"  idle GPU fraction {s['idle_gpu_fraction']:.3f} (training-role idle {s['train_role_idle_fraction']:.3f}, "
        f"rollout slot utilization {s['rollout_slot_utilization']:.3f}), paused executions {s['paused_executions']}",
        "  step times (h): " + " ".join(f"{x:.2f}" for x in s["step_times_h"]),
        "  training-role fraction per cell: " + " ".join(f"{x:.2f}" for x in s["cell_training_fraction"]),
    ]
    return "\n".join(lines)


def ascii_timeline(res: SimResult, width: int = 72) -> str:
    """Cells × time: '.' rollout, '#' training, '>' / '<' switching (paper Fig. 6a)."""
    glyph = {"rollout": ".", "train": "#", "to_train": ">", "to_rollout": "<"}
    end = res.total_h
    rows = []
    for c, ivs in enumerate(res.role_intervals):
        row = []
        for i in range(width):
            t = (i + 0.5) * end / width
            role = next((r for a, b, r in ivs if a <= t < b), ivs[-1][2] if ivs else "rollout")
            row.append(glyph[role])
        rows.append(f"cell {c:2d} |{''.join(row)}|")
    rows.append(f"        0{'':>{width - 8}}{end:7.2f} h")
    return "\n".join(rows)


def table(results: dict[str, SimResult], paper_hours: dict[str, float], ref: str = "E0",
          descriptions: dict[str, str] | None = None) -> str:
    """Rows: variant, sim hours, paper hours, time/ref for both (speedup of ref over it)."""
    descriptions = descriptions or {}
    sim_ref, paper_ref = results[ref].total_h, paper_hours.get(ref)
    head = f"{'var':4s} {'description':34s} {'sim h':>7s} {'paper h':>8s} {'sim x':>6s} {'paper x':>8s} {'E[d]':>6s} {'idle':>6s}"
    lines = [head, "-" * len(head)]
    for name, res in sorted(results.items(), key=lambda kv: kv[1].total_h):
        ph = paper_hours.get(name)
        px = f"{ph / paper_ref:8.3f}" if ph and paper_ref else f"{'-':>8s}"
        lines.append(
            f"{name:4s} {descriptions.get(name, res.label)[:34]:34s} {res.total_h:7.2f} "
            f"{(f'{ph:8.2f}' if ph else f'{chr(45):>8s}')} {res.total_h / sim_ref:6.3f} {px} "
            f"{res.mean_staleness:6.3f} {res.idle_gpu_fraction:6.3f}"
        )
    return "\n".join(lines)


def plot_timeline(res: SimResult, path: str) -> None:
    """Role timeline PNG (cells × hours), like the paper's Fig. 6a."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"rollout": "#8fb8de", "train": "#e07b39", "to_train": "#555555", "to_rollout": "#999999"}
    fig, ax = plt.subplots(figsize=(10, 0.45 * len(res.role_intervals) + 1.2))
    for c, ivs in enumerate(res.role_intervals):
        for a, b, r in ivs:
            ax.barh(c, b - a, left=a, color=colors[r], height=0.8, linewidth=0)
    for t in res.step_end_h:
        ax.axvline(t, color="k", lw=0.4, alpha=0.4)
    ax.set_yticks(range(len(res.role_intervals)))
    ax.set_yticklabels([f"cell {c}" for c in range(len(res.role_intervals))])
    ax.invert_yaxis()
    ax.set_xlabel("hours (vertical lines: optimizer steps)")
    ax.set_title(f"{res.label}: roles (blue rollout, orange train)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(res: SimResult, out_dir: str, extra: dict | None = None) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "result.json"), "w") as fh:
        json.dump({**summary(res), **(extra or {})}, fh, indent=1)
    res.log.write_jsonl(os.path.join(out_dir, "events.jsonl"))
    plot_timeline(res, os.path.join(out_dir, "timeline.png"))


def cumulative_speedups(results: dict[str, SimResult], ref: str = "E0") -> dict[str, list[float]]:
    """Per step k: cumulative time of each variant / cumulative time of `ref` (paper Fig. 7)."""
    r = results[ref].step_end_h
    return {
        name: [round(b / a, 3) for a, b in zip(r, res.step_end_h)]
        for name, res in results.items()
        if name != ref
    }


def format_cumulative(results: dict[str, SimResult], ref: str = "E0") -> str:
    lines = [f"cumulative speedup of {ref} over each variant, per step:"]
    for name, sp in cumulative_speedups(results, ref).items():
        lines.append(f"  {name:4s} " + " ".join(f"{x:5.2f}" for x in sp))
    return "\n".join(lines)
