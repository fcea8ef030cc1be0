"""Does a profile calibrated on one seed's real runs predict another seed's? (issue: the planner).

Fits one profile (`python -m gyre.sim --calibrate`) from the run directories that
`benchmarks/e2e_modes.py` left for one workload seed (its `runs in DIR` line: `DIR/rep0/<mode>`),
predicts every mode of a held-out seed's `e2e_modes` results with it (the same scheduler settings,
the same timing window: steps 2..S−1, the simulator's seeds 0..5), and prints predicted, measured
and the error of each:

    python benchmarks/e2e_modes.py --seed 0 --modes gyre,colocate,async --repeats 1   # prints "runs in DIR"
    python benchmarks/e2e_modes.py --seed 1 --modes gyre,colocate,async --repeats 1 --out held_out.json
    python benchmarks/calibration_check.py --runs DIR/rep0 --held-out held_out.json

The goal (issue 32) is every mode within 5 %. The profile holds what the runs measured: training
work per step, optimizer / parameter-send / switch / scoring / reroute latencies, and the harness
durations as the runs saw them (exec_start → exec_finish, so an engine's queue is in them). The
results file (`--out`) records machine, versions, commit, the profile and every prediction; the
last line printed is one JSON object of the figures.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.provenance import OUT_HELP, provenance, write_results  # noqa: E402
from gyre.sim.calibrate import calibrate  # noqa: E402
from gyre.sim.profile import duration_model, predict  # noqa: E402

GOAL = 0.05
WINDOW_SKIP = 2  # e2e_modes times steps 2..S−1: the end of step 1 to the end of step S−1


def mode_settings(held_out: dict, name: str) -> dict:
    """The scheduler fields of one `e2e_modes` run, from its recorded flags."""
    toks, out = held_out["runs"][name].split(), {}
    i = 0
    while i < len(toks):
        key = toks[i].removeprefix("--scheduler.").replace("-", "_")
        if key in ("streaming", "no_streaming", "serial_join", "no_serial_join"):
            out[key.removeprefix("no_")] = not key.startswith("no_")
            i += 1
        else:
            out[key] = toks[i + 1]
            i += 2
    types = {"phi": float, "mu": int, "rho_min": float, "tau": int, "tick_s": float, "async_train_cells": int, "mode": str}
    return {k: types[k](v) if k in types else v for k, v in out.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--runs", required=True, help="one seed's e2e_modes run directories: DIR/rep0 (holds gyre, colocate, ...)")
    ap.add_argument("--held-out", required=True, help="the other seed's e2e_modes results JSON")
    ap.add_argument("--fit", default="", help="modes to calibrate from, comma separated (default: every run dir in --runs)")
    ap.add_argument("--seeds", type=int, nargs="+", default=list(range(6)), help="simulator seeds per prediction")
    ap.add_argument("--draws", type=int, default=8, help="simulations over the profile's uncertainty (the interval)")
    ap.add_argument("--out", "--results", dest="out", help=OUT_HELP)
    args = ap.parse_args()

    runs = Path(args.runs)
    fit = [runs / m for m in args.fit.split(",")] if args.fit else sorted(p for p in runs.iterdir() if (p / "events.jsonl").exists())
    if not fit:
        raise SystemExit(f"--runs {runs}: no run directory with events.jsonl in it")
    held = json.loads(Path(args.held_out).read_text())
    steps = int(held["config"]["steps"])
    prof = calibrate([str(p) for p in fit], name=f"seed {json.loads((fit[0] / 'run.json').read_text()).get('seed', '?')} runs")
    base = prof.sim_config()
    rows, figures = [], {}
    for name, res in held["results"].items():
        s = mode_settings(held, name)
        sc = replace(base.scheduler, **{k: v for k, v in s.items() if k != "mode"}, mode=s.get("mode", "gyre"))
        cfg = replace(base, scheduler=sc, steps=steps)
        p = predict(cfg, duration_model, prof.draws(args.draws), prof.point(), args.seeds, WINDOW_SKIP, name)
        measured = res["step_s"]
        err = p.step_s / measured - 1.0
        rows.append({"mode": name, "predicted_s": round(p.step_s, 2), "interval_s": [round(x, 2) for x in p.step_s_interval],
                     "measured_s": round(measured, 3), "error": round(err, 4), "settings": s})
        figures[f"calibration_error_{name.replace('@', '_')}"] = round(err, 4)
    figures["calibration_max_abs_error"] = max(abs(r["error"]) for r in rows)
    figures["calibration_goal"] = GOAL

    print(f"profile from {len(fit)} run(s) ({', '.join(p.name for p in fit)}) of {runs}; held out: {args.held_out} "
          f"(seed {held['config']['seed']}), {steps} steps, window steps {WINDOW_SKIP}..{steps - 1}")
    print(f"{'mode':14s} {'predicted':>10s} {'90% interval':>16s} {'measured':>9s} {'error':>8s}")
    for r in rows:
        lo, hi = r["interval_s"]
        print(f"{r['mode']:14s} {r['predicted_s']:10.2f} {f'[{lo:.2f}, {hi:.2f}]':>16s} {r['measured_s']:9.2f} {r['error']:+8.1%}")
    ok = figures["calibration_max_abs_error"] <= GOAL
    print(f"largest error {figures['calibration_max_abs_error']:.1%} (goal <= {GOAL:.0%}: {'met' if ok else 'NOT met'})")

    record = {
        "benchmark": "calibration_check",
        **provenance("numpy"),
        "config": {**vars(args), "fit_dirs": [str(p) for p in fit], "held_out_commit": held.get("git_commit", held.get("commit")),
                   "held_out_seed": held["config"]["seed"]},
        "profile": prof.to_dict() | {"replicates": f"{len(prof.replicates)} bootstrap replicates (not kept here)"},
        "rows": rows,
        "figures": figures,
    }
    write_results(args.out, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
