"""`python -m gyre.sim [--help]`: simulate one scheduler configuration (and optionally the
paper's ablation variants) on a cluster of elastic cells with long-tailed executions.

Examples::

    python -m gyre.sim                                       # Gyre E0 setting, 12 steps
    python -m gyre.sim --scheduler.mode colocate --scheduler.no-streaming
    python -m gyre.sim --compare                             # Table-1-like comparison
    python -m gyre.sim --durations.source csv --durations.path my_runs.csv --steps 48

Calibration and prediction (docs/theory.md §5; `gyre.sim.calibrate`, `gyre.sim.profile`)::

    python -m gyre.sim --calibrate RUN_DIR [RUN_DIR ...] --out profile.json   # fit costs from a run
    python -m gyre.sim --profile profile.json --scheduler.mode async --scheduler.phi 1 --scheduler.mu 1
                                           # predicted s/step (90 % interval), E[d], training fractions

The planner over such a profile is `python -m gyre.plan --help`.
"""

from __future__ import annotations

import logging
import sys
import time

import tyro

from gyre.sim.config import SimConfig
from gyre.sim.durations import NL2REPO_122B, DurationModel, EmpiricalDurations, HierarchicalLogNormal
from gyre.sim.engine import Simulation
from gyre.sim.report import ascii_timeline, format_cumulative, format_run, table, write_outputs
from gyre.sim.variants import DESCRIPTIONS, PAPER_HOURS, describe, run_variants

logger = logging.getLogger(__name__)


def build_durations(cfg: SimConfig) -> DurationModel:
    d = cfg.durations
    if d.source == "preset":
        return {"nl2repo-122b": NL2REPO_122B}[d.preset]
    if d.source == "lognormal":
        return HierarchicalLogNormal(d.m, d.sigma_q, d.sigma_e, d.cap_h)
    if not d.path:
        raise ValueError(f"--durations.path is required with --durations.source {d.source}")
    return EmpiricalDurations.from_csv(d.path) if d.source == "csv" else EmpiricalDurations.from_run_dir(d.path)


def run(cfg: SimConfig) -> int:
    durations = build_durations(cfg)
    t0 = time.perf_counter()
    res = Simulation(cfg, durations, cfg.scheduler.mode).run()
    print(f"config: {describe(cfg)}, B={cfg.scheduler.batch_groups}, N={cfg.scheduler.n_per_group}, "
          f"E[d] target {cfg.scheduler.expected_staleness:.3f}")
    print(format_run(res))
    print(ascii_timeline(res))
    if cfg.out_dir:
        write_outputs(res, cfg.out_dir, {"config": describe(cfg)})
        print(f"wrote {cfg.out_dir}/result.json, events.jsonl, timeline.png")
    if cfg.compare:
        results = run_variants(cfg, durations)
        by_name = {k: v[0] for k, v in results.items()}
        if cfg.steps != 12:
            print(f"(the paper's hours are for 12 steps; this run has {cfg.steps})")
        print(table(by_name, PAPER_HOURS, descriptions=DESCRIPTIONS))
        print(format_cumulative(by_name))
        for k, (_, c, n) in results.items():
            print(f"  {k}: {describe(c)} (best of {n})")
    print(f"simulated in {time.perf_counter() - t0:.1f} s wall")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--calibrate" in argv:
        from gyre.sim.calibrate import main as calibrate_main

        return calibrate_main([a for a in argv if a != "--calibrate"])
    if "--profile" in argv or any(a.startswith("--profile=") for a in argv):
        from gyre.sim.profile import predict_main

        return predict_main(argv)
    cfg = tyro.cli(SimConfig, args=argv, description=__doc__)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        cfg.scheduler.validate(cfg.cluster.num_cells)
        return run(cfg)
    except (ValueError, FileNotFoundError) as e:
        print(f"gyre.sim: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
