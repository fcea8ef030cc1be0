"""Does the README's main job learn, robustly? Five seeds of the CPU demo, one after another.

Each seed is README command 1's job exactly (`torchrun --standalone --nproc-per-node 4 -m gyre.run
--preset cpu-demo`) with `--seed S`, all sharing the prepared data (runs/cpu-demo/data: tasks
and the warm start, made by the first run if missing). The demo's data order depends on timing
(which harness finishes first decides which groups a step trains on), so the runs also differ
by the machine's load: 4 ranks and up to 8 harness processes share 2 cores. The load average is
sampled every 5 s during each run and recorded beside its figures.

Per seed, from the run's summary.json (`reward_trend`, a 95 % bootstrap over whole groups):
    fitted rise   the least-squares line of group-mean reward on step, last step minus first
    first → last  mean reward of the first and the last quarter of the steps
The goal (issue "The main job works for a newcomer"): the fitted rise's interval excludes zero in
at least 4 of 5 seeds. `--out benchmarks/results/demo_learning.json` writes the results file (machine,
versions, config, commit, every run); the last line printed is one JSON object of the figures.

    python benchmarks/demo_learning.py                  # 5 seeds, ~6 min each on 2 cores
    python benchmarks/demo_learning.py --seeds 0 --preset cpu-demo-smoke   # a quick check
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.provenance import OUT_HELP, provenance, write_results  # noqa: E402


def run_seed(preset: str, seed: int, run_dir: Path, extra: list[str]) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", "-m", "gyre.run",
           "--preset", preset, "--seed", str(seed), "--run-dir", str(run_dir), *extra]
    loads: list[float] = []
    done = threading.Event()

    def sample() -> None:
        while not done.wait(5.0):
            loads.append(os.getloadavg()[0])

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.time()
    log = run_dir.with_suffix(".log")
    with open(log, "w") as f:
        rc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, check=False).returncode
    wall = time.time() - t0
    done.set()
    out = {"seed": seed, "rc": rc, "wall_s": round(wall, 1), "load_mean": round(sum(loads) / len(loads), 2) if loads else None,
           "run_dir": str(run_dir), "log": str(log), "command": " ".join(cmd)}
    summary_path = run_dir / "summary.json"
    if rc != 0 or not summary_path.exists():
        out["error"] = f"exit {rc}; see {log}"
        return out
    s = json.loads(summary_path.read_text())
    t = s["reward_trend"]
    out.update(steps=s["steps"], run_wall_s=round(s["wall_s"], 1), outcomes=s["execution_outcomes"],
               aborted_calls=s["aborted_calls"], staleness=s["measured_staleness_mean"],
               fitted_rise=t["fitted_rise"], rise_ci95=[t["fitted_rise_ci95_low"], t["fitted_rise_ci95_high"]],
               first_mean=t["first_mean"], last_mean=t["last_mean"], diff_ci95=[t["ci95_low"], t["ci95_high"]],
               excludes_zero=t["fitted_rise_ci95_low"] > 0)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    ap.add_argument("--preset", default="cpu-demo")
    ap.add_argument("--out", help=OUT_HELP)
    ap.add_argument("--runs-dir", default="", help="where the runs go (default: a temporary directory)")
    ap.add_argument("extra", nargs="*", help="more gyre.run flags, after --")
    args = ap.parse_args(argv)

    dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                                text=True, check=False).stdout.strip())
    runs_dir = Path(args.runs_dir or tempfile.mkdtemp(prefix="gyre-demo-learning-"))
    runs_dir.mkdir(parents=True, exist_ok=True)
    print(f"{len(args.seeds)} runs of --preset {args.preset} into {runs_dir}", flush=True)
    results = []
    for seed in args.seeds:
        r = run_seed(args.preset, seed, runs_dir / f"seed{seed}", args.extra)
        results.append(r)
        if "error" in r:
            print(f"seed {seed}: FAILED ({r['error']})", flush=True)
            continue
        print(f"seed {seed}: fitted rise {r['fitted_rise']:+.3f} [{r['rise_ci95'][0]:+.3f}, {r['rise_ci95'][1]:+.3f}]  "
              f"first->last quarter {r['first_mean']:.3f} -> {r['last_mean']:.3f}  wall {r['wall_s']:.0f} s  "
              f"load {r['load_mean']}", flush=True)

    ok = [r for r in results if "error" not in r]
    excluding = sum(r["excludes_zero"] for r in ok)
    figures = {"preset": args.preset, "seeds": args.seeds, "runs_ok": len(ok),
               "rise_ci_excludes_zero": excluding, "of": len(args.seeds),
               "fitted_rise": [round(r["fitted_rise"], 3) for r in ok],
               "rise_ci95_low": [round(r["rise_ci95"][0], 3) for r in ok],
               "first_mean": [round(r["first_mean"], 3) for r in ok], "last_mean": [round(r["last_mean"], 3) for r in ok],
               "wall_s": [r["wall_s"] for r in ok], "load_mean": [r["load_mean"] for r in ok]}
    print(f"fitted rise's 95 % interval excludes zero in {excluding} of {len(args.seeds)} seeds (goal: 4 of 5)")
    write_results(args.out, {**provenance(), "git_dirty": dirty,
                             "config": {"preset": args.preset, "extra": args.extra, "seeds": args.seeds},
                             "runs": results, "figures": figures})
    return 0 if len(ok) == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
