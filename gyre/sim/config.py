"""Simulator configuration (tyro): `python -m gyre.sim --help`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from gyre.scheduler.config import SchedulerConfig


@dataclass(kw_only=True)
class ClusterConfig:
    """Cells and the pool (the paper's 122B setting: 8 cells × 4 nodes; one cell's concurrency C_e,
    144 there, is the scheduler's `--scheduler.cell-concurrency`)."""

    num_cells: int = 8
    """K: elastic cells (cell 0 is the core)."""
    nodes_per_cell: int = 4
    """Nodes per cell (GPU-budget accounting and reporting only)."""
    standalone_concurrency: int = 0
    """C_s: concurrency of the standalone rollout pool (0 = no pool)."""
    standalone_nodes: int = 0
    """Nodes of the standalone pool (GPU-budget accounting only)."""
    kv_recompute_s: float = 600.0
    """Extra time a *paused* execution needs when it resumes: its engine released the KV cache
    for training, so its long prefix is recomputed (Gyre migrates or keeps it; it never pauses)."""
    reroute_s: float = 0.0
    """Delay of each in-flight call of a cell that drains to train (docs/design.md §3): the
    prefix recompute on its new engine, or a KV migration - the measured figures of
    `benchmarks/reroute_bench.py` via `reroute_s_from_bench`. 0: rerouting is free."""


@dataclass(kw_only=True)
class TrainingModel:
    """Training time: a step's work is shared by the cells that train it, micro-step by micro-step."""

    cell_hours_per_step: float = 3.0
    """Compute of one average step (B groups) on a single cell of reference_nodes nodes, in hours."""
    reference_nodes: int = 4
    """Cell size that cell_hours_per_step refers to."""
    scaling_exponent: float = 0.9
    """A cell of n nodes trains (n/reference_nodes)^exponent times as fast as a reference cell
    (1.0 = linear; below 1: one replica spread over more nodes communicates more)."""
    tokens_scale: bool = True
    """Micro-step work ∝ its execution's duration (tokens grow with time); off: all equal."""
    optimizer_s: float = 120.0
    """Gradient reduction over the prefix group + clip + optimizer update on the core."""
    param_send_s: float = 60.0
    """Non-final step of a burst: the core sends the new parameters to the satellites."""
    switch_to_train_s: float = 8.52
    """Rollout → training switch latency (paper: 8.52 s mean)."""
    switch_to_rollout_s: float = 3.46
    """Training → rollout switch latency (paper: 3.46 s mean)."""
    eval_s: float = 0.0
    """Delay from a group's last execution ending to the group being scored and ready."""


@dataclass(kw_only=True)
class DurationConfig:
    """Where execution durations come from."""

    source: Literal["preset", "lognormal", "csv", "run-dir"] = "preset"
    """preset: a fitted model (--durations.preset); lognormal: the parameters below; csv / run-dir:
    measured groups from --durations.path, resampled whole."""
    preset: Literal["nl2repo-122b"] = "nl2repo-122b"
    """Fitted to NL2RepoBench, 122B: exec mean 1.93 h, query mean 2.96 h, 9.51 % > 4 h, 6.25 % timeouts."""
    path: str = ""
    """CSV file (group,duration_s[,timed_out]) or run directory (executions.csv / .jsonl, else the
    events.jsonl a gyre.run run directory holds)."""
    m: float = 0.5
    """lognormal: log-hours location m."""
    sigma_q: float = 0.4
    """lognormal: per-query spread σ_q."""
    sigma_e: float = 0.4
    """lognormal: per-execution spread σ_e."""
    cap_h: float = 5.0
    """lognormal: harness timeout cap in hours."""


@dataclass(kw_only=True)
class SimConfig:
    """Discrete-event simulation of Gyre / Colocate / Async on a cluster of elastic cells."""

    scheduler: SchedulerConfig = field(default_factory=lambda: SchedulerConfig(batch_groups=32, cell_concurrency=144))
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    training: TrainingModel = field(default_factory=TrainingModel)
    durations: DurationConfig = field(default_factory=DurationConfig)
    steps: int = 12
    """Optimizer steps to simulate."""
    seed: int = 0
    """Seed of the duration draws (same seed ⇒ same groups in every mode)."""
    compare: bool = False
    """Also run the paper's ablation variants (A0 A3 C0 C2 E0 E1 E2) on the same cluster and print a table."""
    out_dir: str = ""
    """If set: write result.json, events.jsonl and timeline.png here."""
    wall_timeout_h: float = 0.0
    """The runner's wall-clock limit per execution, counted from its dispatch (0 = off: the
    duration law's cap bounds an execution's *work* only). With it, an execution still queued or
    paused at its deadline is cut there, as the real runner kills a harness on wall time; its
    training work then scales with the work it did."""
    max_sim_hours: float = 1e6
    """Abort a run whose simulated clock passes this (a stalled configuration)."""


def reroute_s_from_bench(path: str, context: int, mode: str = "migrate", transport: str = "gloo") -> float:
    """A reroute's measured latency (seconds, pause → first token elsewhere) at `context` tokens
    from benchmarks/results/reroute_bench.json: `mode` 'migrate' (over `transport`) or 'recompute'."""
    import json

    with open(path) as f:
        figures = json.load(f)["figures"]
    key = f"{transport}_{context}_migrate_latency_s" if mode == "migrate" else f"recompute_{context}_latency_s"
    value = figures.get(key)
    if value is None:
        have = sorted(k for k, v in figures.items() if k.endswith("latency_s") and v is not None)
        raise KeyError(f"{path}: no {key} (measured: {have})")
    return float(value)
