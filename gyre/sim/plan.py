"""The planner: the best scheduler configuration for a workload and a GPU budget, by simulation.

    python -m gyre.plan --profile gyre/sim/profiles/paper_table1.json --gpus 256 --max-staleness 1
    python -m gyre.plan --profile my_run_profile.json --gpus 4 --gpus-per-node 1 --png frontier.png

The simulator (the same `ElasticScheduler` the runtime drives) over a profile's costs searches
the cell size, a standalone pool, φ and μ with E[d] = φ + (μ−1)/2 ≤ --max-staleness, and the
water level's thresholds, in three rounds, against the paper's Colocate and Async at matched E[d]
(gyre/sim/variants.py). How to read its table and what it assumes: docs/planning.md, docs/theory.md §5.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass, field, replace
from typing import Callable

from gyre.sim.config import SimConfig
from gyre.sim.engine import Simulation
from gyre.sim.profile import Profile, ProfileError, duration_model, with_costs

THRESHOLDS = [(0.25, 2, True), (0.0, 0, True), (0.0, 0, False), (0.5, 2, True), (0.25, 1, True), (0.25, 2, False)]
"""(ρ_min, τ, serial_join) tried in round 2; the first is the design's default."""


@dataclass(frozen=True)
class Candidate:
    """One configuration the planner can recommend."""

    nodes_per_cell: int
    num_cells: int
    pool_cells: int
    phi: float
    mu: int
    rho_min: float = 0.25
    tau: int = 2
    serial_join: bool = True
    mode: str = "gyre"
    async_train_cells: int = 0

    @property
    def staleness(self) -> float:
        return self.phi + (self.mu - 1) / 2

    def sim_config(self, base: SimConfig, ref_nodes: int, ref_ce: int) -> SimConfig:
        ce = max(1, round(ref_ce * self.nodes_per_cell / ref_nodes))
        sc = replace(base.scheduler, mode=self.mode, phi=self.phi, mu=self.mu, rho_min=self.rho_min, tau=self.tau,
                     serial_join=self.serial_join, streaming=self.mode == "gyre", cell_concurrency=ce,
                     async_train_cells=self.async_train_cells or base.scheduler.async_train_cells)
        cl = replace(base.cluster, num_cells=self.num_cells, nodes_per_cell=self.nodes_per_cell,
                     standalone_concurrency=self.pool_cells * ce, standalone_nodes=self.pool_cells * self.nodes_per_cell)
        return replace(base, scheduler=sc, cluster=cl)

    def run_flags(self, gpus_per_node: int, ref_nodes: int, ref_ce: int, tick_s: float) -> str:
        """The `gyre.run` flags of this configuration (cell size in ranks = GPUs)."""
        ce = max(1, round(ref_ce * self.nodes_per_cell / ref_nodes))
        size = self.nodes_per_cell * gpus_per_node
        flags = [f"--scheduler.mode {self.mode}", f"--scheduler.phi {self.phi:g}", f"--scheduler.mu {self.mu}",
                 f"--parallel.cell-size {size}", f"--scheduler.cell-concurrency {ce}"]
        if self.pool_cells:
            flags.append(f"--parallel.standalone-ranks {self.pool_cells * size}")
        if self.mode == "gyre":
            flags += [f"--scheduler.rho-min {self.rho_min:g}", f"--scheduler.tau {self.tau}", f"--scheduler.tick-s {tick_s:g}",
                      "--scheduler.streaming"]
            if not self.serial_join:
                flags.append("--scheduler.no-serial-join")
        else:
            flags.append("--scheduler.no-streaming")
        if self.mode == "async":
            flags.append(f"--scheduler.async-train-cells {self.async_train_cells}")
        return " ".join(flags)

    def describe(self) -> str:
        pool = f"+pool {self.pool_cells}x{self.nodes_per_cell}" if self.pool_cells else ""
        if self.mode != "gyre":
            extra = f" split {self.async_train_cells}" if self.mode == "async" else ""
            return f"{self.mode} {self.num_cells}x{self.nodes_per_cell}{pool} phi={self.phi:g} mu={self.mu}{extra}"
        thr = f" rho={self.rho_min:g} tau={self.tau}{'' if self.serial_join else ' parallel-join'}"
        return f"gyre {self.num_cells}x{self.nodes_per_cell}{pool} phi={self.phi:g} mu={self.mu}{thr}"


@dataclass
class Scored:
    cand: Candidate
    step_s: float  # predicted seconds per step, mean over the seeds
    idle: float  # GPU idle fraction
    measured_staleness: float
    seeds: int
    colocate_s: float | None = None
    async_s: float | None = None
    extra: dict = field(default_factory=dict)


def staleness_pairs(max_staleness: float, batch_groups: int, max_mu: int = 4) -> list[tuple[float, int]]:
    """(φ, μ) with E[d] = φ + (μ−1)/2 ≤ max_staleness, φ a multiple of 0.25 (and φ·B whole)."""
    out = []
    for mu in range(1, max_mu + 1):
        for q in range(0, 13):
            phi = q * 0.25
            if phi + (mu - 1) / 2 <= max_staleness + 1e-9 and abs(phi * batch_groups - round(phi * batch_groups)) < 1e-9:
                out.append((phi, mu))
    return out


def structures(total_nodes: int, cell_nodes: list[int], pairs: list[tuple[float, int]], pool: bool = True) -> list[Candidate]:
    out = []
    for s in cell_nodes:
        for pool_cells in ((0, 1) if pool else (0,)):
            k = (total_nodes - pool_cells * s) // s
            if k < 2 or k * s + pool_cells * s != total_nodes:
                continue
            out += [Candidate(s, k, pool_cells, phi, mu) for phi, mu in pairs]
    return out


class Planner:
    """Scores candidates with the simulator at the profile's point costs (cached)."""

    def __init__(self, profile: Profile, steps: int | None = None, seeds: list[int] | None = None) -> None:
        self.profile = profile
        self.base = profile.sim_config()
        if steps:
            self.base = replace(self.base, steps=steps)
        self.point = profile.point()
        self.durations = duration_model(self.point["durations"])
        self.ref_nodes = profile.cluster.get("nodes_per_cell", self.base.cluster.nodes_per_cell)
        self.ref_ce = self.base.scheduler.cell_concurrency  # the profile's cluster.cell_concurrency (Profile.sim_config)
        self.seeds = seeds or [0, 1]
        self.cache: dict[tuple[Candidate, int], tuple[float, float, float]] = {}
        self.evaluated = 0

    def run(self, cand: Candidate, seed: int) -> tuple[float, float, float]:
        key = (cand, seed)
        if key not in self.cache:
            cfg = replace(with_costs(cand.sim_config(self.base, self.ref_nodes, self.ref_ce), self.point), seed=seed)
            res = Simulation(cfg, self.durations, cand.mode).run()
            self.cache[key] = (res.total_h * 3600.0 / cfg.steps, res.idle_gpu_fraction, res.mean_staleness)
            self.evaluated += 1
        return self.cache[key]

    def score(self, cand: Candidate, seeds: list[int]) -> Scored:
        rs = [self.run(cand, s) for s in seeds]
        return Scored(cand, sum(r[0] for r in rs) / len(rs), sum(r[1] for r in rs) / len(rs),
                      sum(r[2] for r in rs) / len(rs), len(rs))

    def baselines(self, sc: Scored, seeds: list[int]) -> None:
        """Colocate and Async (μ = 1, φ = E[d], half the cells train) on the candidate's cells."""
        c = sc.cand
        k = c.num_cells + c.pool_cells  # the baselines use the pool's nodes as cells
        d = c.staleness
        colo = Candidate(c.nodes_per_cell, k, 0, d, 1, mode="colocate")
        asyn = Candidate(c.nodes_per_cell, k, 0, d, 1, mode="async", async_train_cells=max(1, k // 2))
        sc.colocate_s = self.score(colo, seeds).step_s
        sc.async_s = self.score(asyn, seeds).step_s


def search(planner: Planner, total_nodes: int, max_staleness: float, cell_nodes: list[int], *, keep: int = 4,
           finalists: int = 5, pool: bool = True, thresholds: list[tuple[float, int, bool]] | None = None,
           progress: Callable[[str], None] | None = None) -> tuple[list[Scored], list[Scored]]:
    """Three rounds (module docstring). Returns (finalists best first, every configuration scored)."""
    say = progress or (lambda _m: None)
    pairs = staleness_pairs(max_staleness, planner.base.scheduler.batch_groups)
    if not pairs:
        raise ValueError(f"--max-staleness {max_staleness}: no (phi, mu) reaches it (E[d] >= 0)")
    cands = structures(total_nodes, cell_nodes, pairs, pool)
    if not cands:
        raise ValueError(f"{total_nodes} nodes cannot be cut into >= 2 cells of {cell_nodes} nodes")
    first = planner.seeds[:1]
    say(f"round 1: {len(cands)} structures on seed {first[0]}")
    r1 = sorted((planner.score(c, first) for c in cands), key=lambda s: s.step_s)
    thresholds = thresholds if thresholds is not None else THRESHOLDS
    r2_cands = [replace(s.cand, rho_min=r, tau=t, serial_join=j) for s in r1[:keep] for r, t, j in thresholds]
    say(f"round 2: {len(r2_cands)} threshold settings of the best {min(keep, len(r1))} on seeds {planner.seeds}")
    r2 = sorted((planner.score(c, planner.seeds) for c in dict.fromkeys(r2_cands)), key=lambda s: s.step_s)
    best, seen = [], set()
    for s in r2:  # settings that simulate identically (a knob that never bit) are shown once, the first
        key = (round(s.step_s, 3), round(s.idle, 4), s.cand.staleness)
        if key not in seen:
            seen.add(key)
            best.append(s)
    best = best[:finalists]
    say(f"round 3: baselines at matched E[d] for {len(best)} finalists and the frontier")
    for s in best:
        planner.baselines(s, planner.seeds)
    return best, r1 + r2


def frontier(planner: Planner, scored: list[Scored]) -> list[Scored]:
    """The fastest configuration at each E[d] level, on every seed, with its baselines."""
    by_d: dict[float, Scored] = {}
    for s in scored:  # scored on more seeds first (round 2 over round 1), then faster
        cur = by_d.get(s.cand.staleness)
        if cur is None or (-s.seeds, s.step_s) < (-cur.seeds, cur.step_s):
            by_d[s.cand.staleness] = s
    out = [planner.score(s.cand, planner.seeds) for _, s in sorted(by_d.items())]
    for s in out:
        planner.baselines(s, planner.seeds)
    return out


def format_table(best: list[Scored], planner: Planner, gpus_per_node: int) -> str:
    head = f"{'#':>2s} {'configuration':48s} {'s/step':>8s} {'h/step':>7s} {'vs C':>6s} {'vs A':>6s} {'E[d]':>5s} {'meas':>5s} {'idle':>5s}"
    lines = [head, "-" * len(head)]
    tick = planner.base.scheduler.tick_s
    for i, s in enumerate(best, 1):
        vc = f"{s.colocate_s / s.step_s:6.3f}" if s.colocate_s else f"{'-':>6s}"
        va = f"{s.async_s / s.step_s:6.3f}" if s.async_s else f"{'-':>6s}"
        lines.append(f"{i:2d} {s.cand.describe():48s} {s.step_s:8.1f} {s.step_s / 3600:7.3f} {vc} {va} "
                     f"{s.cand.staleness:5.2f} {s.measured_staleness:5.2f} {s.idle:5.3f}")
    lines.append("")
    for i, s in enumerate(best, 1):
        lines.append(f"{i:2d} gyre.run flags: {s.cand.run_flags(gpus_per_node, planner.ref_nodes, planner.ref_ce, tick)}")
    return "\n".join(lines)


def plot_frontier(scored: list[Scored], best: list[Scored], path: str, title: str) -> None:
    """`best`: the points whose baselines are drawn (`frontier`'s output)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    xs = [s.cand.staleness for s in scored]
    ax.scatter(xs, [s.step_s / 3600 for s in scored], s=10, color="#bbbbbb", label="configurations tried")
    front: dict[float, float] = {}
    for s in scored:
        front[s.cand.staleness] = min(front.get(s.cand.staleness, math.inf), s.step_s / 3600)
    fx = sorted(front)
    fy, run_min = [], math.inf
    for x in fx:  # a point is on the frontier if nothing at lower or equal E[d] is faster
        run_min = min(run_min, front[x])
        fy.append(run_min)
    ax.step(fx, fy, where="post", color="#e07b39", label="best gyre at E[d] <= x")
    for s in best:
        if s.colocate_s:
            ax.scatter([s.cand.staleness], [s.colocate_s / 3600], marker="s", color="#555555")
        if s.async_s:
            ax.scatter([s.cand.staleness], [s.async_s / 3600], marker="^", color="#1f77b4")
    ax.scatter([], [], marker="s", color="#555555", label="Colocate (mu=1)")
    ax.scatter([], [], marker="^", color="#1f77b4", label="Async (mu=1)")
    ax.set_xlabel("E[d] = phi + (mu-1)/2")
    ax.set_ylabel("predicted hours per step")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m gyre.plan", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", required=True, help="profile JSON (python -m gyre.sim --calibrate, or written by hand)")
    ap.add_argument("--gpus", type=int, required=True, help="GPUs (ranks) in the budget")
    ap.add_argument("--gpus-per-node", type=int, default=None,
                    help="GPUs per node (default: the profile's cluster.gpus_per_node, else 8)")
    ap.add_argument("--max-staleness", type=float, default=1.5, help="largest E[d] = phi + (mu-1)/2 allowed")
    ap.add_argument("--cell-nodes", default="",
                    help="cell sizes in nodes to try, comma separated (default: the profile's, half and double)")
    ap.add_argument("--no-pool", action="store_true", help="do not try a standalone rollout pool")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="seeds of rounds 2 and 3")
    ap.add_argument("--steps", type=int, default=0, help="steps per simulated run (default: the profile's, 12)")
    ap.add_argument("--keep", type=int, default=4, help="structures carried into round 2")
    ap.add_argument("--top", type=int, default=5, help="configurations printed")
    ap.add_argument("--png", default="plan_frontier.png", help="speed-staleness frontier plot ('' = none)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else list(argv))
    try:
        prof = Profile.load(args.profile)
        gpn = args.gpus_per_node or int(prof.cluster.get("gpus_per_node", 8))
        if args.gpus < 1 or gpn < 1 or args.gpus % gpn:
            raise ValueError(f"--gpus {args.gpus} must be a positive multiple of --gpus-per-node {gpn}")
        nodes = args.gpus // gpn
        ref = int(prof.cluster.get("nodes_per_cell", 1))
        if args.cell_nodes:
            try:
                cell_nodes = sorted({int(x) for x in args.cell_nodes.split(",")})
            except ValueError:
                raise ValueError(f"--cell-nodes {args.cell_nodes!r}: comma-separated whole numbers expected") from None
        else:
            cell_nodes = sorted({x for x in (ref // 2 if ref % 2 == 0 else ref, ref, 2 * ref) if x >= 1})
        planner = Planner(prof, args.steps or None, args.seeds)
        best, scored = search(planner, nodes, args.max_staleness, cell_nodes, keep=args.keep, finalists=args.top,
                              pool=not args.no_pool, progress=lambda m: print(m, flush=True))
    except (ProfileError, ValueError, FileNotFoundError) as e:
        print(f"gyre.plan: error: {e}", file=sys.stderr)
        return 2
    print(f"\nprofile {prof.name}: {args.gpus} GPUs = {nodes} nodes x {gpn}, E[d] <= {args.max_staleness:g}, "
          f"B={planner.base.scheduler.batch_groups}, N={planner.base.scheduler.n_per_group}, {planner.base.steps} steps "
          f"per run, seeds {args.seeds}; {planner.evaluated} simulations")
    print("s/step: predicted mean over the run (start-up included); vs C / vs A: Colocate's / Async's s/step over it "
          "at the same E[d]; meas: E[d] measured in the run (the first burst is a transient)")
    print(format_table(best, planner, gpn))
    if args.png:
        front = frontier(planner, scored)
        print("\nfrontier (fastest per E[d], seeds " + " ".join(map(str, args.seeds)) + "):")
        for s in front:
            print(f"  E[d] {s.cand.staleness:4.2f}: {s.step_s / 3600:6.3f} h/step  {s.colocate_s / s.step_s:5.2f}x Colocate  "
                  f"{s.async_s / s.step_s:5.2f}x Async  {s.cand.describe()}")
        plot_frontier(scored, front, args.png, f"{prof.name}: {args.gpus} GPUs")
        print(f"frontier plot: {args.png}")
    return 0
