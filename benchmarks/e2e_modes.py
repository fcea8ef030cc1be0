"""Gyre vs Colocate vs Async, end to end on this machine (issue: elastic scheduler).

Each mode is one real run — `torchrun --standalone --nproc-per-node 4 -m gyre.run --job train` —
on the same long-tailed workload (examples/longtail: seeded log-normal execution times with a
timeout tail, model calls through the proxy, tool time as sleeps), the same seed, the same
cells and the same matched expected staleness E[d] = φ + (μ−1)/2 = 1:

    gyre      φ = 0.5, μ = 2   cells enter training one by one by the water level, streaming
    colocate  φ = 1,   μ = 1   all cells switch together when the step's batch is ready
    async     φ = 1,   μ = 1   a fixed split: cell 0 trains, cells 1..3 roll out

Time per step is measured over steps 1..S−1 (step 0 includes start-up), from each run's
metrics.jsonl; measured staleness comes from the run's summary. Results go to
benchmarks/results/e2e_modes.json; the last line printed is one JSON object of the figures.

    python benchmarks/e2e_modes.py              # ~10-15 min on 2 cores
    python benchmarks/e2e_modes.py --steps 4    # quicker, noisier
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODES = {
    "gyre": ["--scheduler.mode", "gyre", "--scheduler.phi", "0.5", "--scheduler.mu", "2"],
    "colocate": ["--scheduler.mode", "colocate", "--scheduler.phi", "1", "--scheduler.mu", "1"],
    "async": ["--scheduler.mode", "async", "--scheduler.phi", "1", "--scheduler.mu", "1",
              "--scheduler.async-train-cells", "1"],
}


def run_mode(mode: str, tasks: Path, out: Path, args: argparse.Namespace) -> dict:
    run_dir = out / mode
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", "-m", "gyre.run",
           "--job", "train", "--run-dir", str(run_dir), "--seed", str(args.seed), "--model.preset", "tiny",
           "--executions.dataset.path", str(tasks), "--executions.runner.max-concurrency", "64",
           "--executions.evaluator.concurrency", "4",
           "--scheduler.n-per-group", str(args.n), "--scheduler.batch-groups", str(args.b),
           "--scheduler.tick-s", "0.2", "--scheduler.tau", "1", "--scheduler.rho-min", "0.5",
           "--train.steps", str(args.steps), "--train.max-tokens", "4096", "--train.cell-concurrency", str(args.c_e),
           "--train.drain-at-end-s", "0", *MODES[mode]]
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout)
    (out / f"{mode}.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise SystemExit(f"{mode} run failed (rc {proc.returncode}); log: {out / f'{mode}.log'}\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((run_dir / "summary.json").read_text())
    per_step = (rows[-1]["time_s"] - rows[0]["time_s"]) / (len(rows) - 1)
    return {
        "step_s": per_step,
        "wall_s": time.time() - t0,
        "step_times_s": [r["step_time_s"] for r in rows],
        "staleness_mean": summary["measured_staleness_mean"],
        "train_fraction": summary["train_fraction"],
        "reroutes": summary["reroutes"],
        "execution_outcomes": summary["execution_outcomes"],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--n", type=int, default=4, help="N executions per group")
    p.add_argument("--b", type=int, default=2, help="B groups per step")
    p.add_argument("--c-e", type=int, default=6, help="C_e, one cell's rollout concurrency in the water level")
    p.add_argument("--time-scale", type=float, default=4e-4, help="longtail durations × this (1 h → 1.44 s)")
    p.add_argument("--turns-mean", type=float, default=4.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--modes", default="gyre,colocate,async")
    args = p.parse_args()

    from examples.longtail.task import make_tasks

    out = Path(tempfile.mkdtemp(prefix="gyre-e2e-modes-"))
    tasks = out / "tasks.jsonl"
    with tasks.open("w") as f:
        for t in make_tasks(64, seed=args.seed, time_scale=args.time_scale,
                            extra_args=["--turns-mean", str(args.turns_mean), "--max-tokens", "16"]):
            f.write(json.dumps(t) + "\n")

    results = {}
    for mode in args.modes.split(","):
        print(f"running {mode} ...", flush=True)
        results[mode] = run_mode(mode, tasks, out, args)
        r = results[mode]
        print(f"  {mode:9s} {r['step_s']:.2f} s/step  staleness {r['staleness_mean']:.2f}  "
              f"train fraction {r['train_fraction']}  reroutes {r['reroutes']}", flush=True)

    figures = {f"{m}_step_s": round(r["step_s"], 3) for m, r in results.items()}
    if "gyre" in results:
        for m in results:
            if m != "gyre":
                figures[f"speedup_vs_{m}"] = round(results[m]["step_s"] / results["gyre"]["step_s"], 3)
    figures.update({f"{m}_staleness": r["staleness_mean"] for m, r in results.items()})
    print()
    print(f"{'mode':10s} {'s/step':>8s} {'E[d] measured':>14s}")
    for m, r in results.items():
        print(f"{m:10s} {r['step_s']:8.2f} {r['staleness_mean']:14.2f}")
    for k, v in figures.items():
        if k.startswith("speedup"):
            print(f"{k}: {v:.2f}x (goal ≥ 1.3x)")

    import torch

    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    record = {
        "benchmark": "e2e_modes",
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "versions": {"torch": torch.__version__},
        "commit": commit,
        "config": vars(args),
        "modes": {m: " ".join(MODES[m]) for m in results},
        "results": results,
        "figures": figures,
        "left_out": "GPU backends (SGLang, Megatron) — CPU engine and actor with the tiny model; "
                    "switch costs are CPU-scale (ms), not the paper's ~8.5 s / ~3.5 s",
    }
    dest = ROOT / "benchmarks" / "results" / "e2e_modes.json"
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps(record, indent=2))
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
