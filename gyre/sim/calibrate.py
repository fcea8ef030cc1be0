"""Fit the simulator's costs from a run's files: `python -m gyre.sim --calibrate RUN_DIR [...] [--out P]`.

Reads each run directory's `events.jsonl` (the scheduler's event log, wall-clock seconds),
`metrics.jsonl`, `summary.json` and, when present, `run.json` (the run's config), and writes a
profile (`gyre.sim.profile`, JSON) with every fitted cost, its 90 % bootstrap interval and the
joint bootstrap replicates: the training work per step (``cell_hours_per_step``), optimizer and
parameter-send time, the switches, scoring, reroute latency, and the harness durations (a
hierarchical log-normal with its cap and tail). Per-cell and load fits that the simulator does not
use are reported under ``meta.fits``. Which events each cost is fitted from:
docs/planning.md, "What --calibrate fits".

Not measurable from a Gyre run and kept at the simulator's defaults (``n`` = 0 in the profile):
``kv_recompute_s`` (Gyre never pauses an execution) and ``scaling_exponent`` (one cell size).
"""

from __future__ import annotations

import json
import math
import os
from collections import defaultdict
from typing import Any

import numpy as np

from gyre.sim.config import SimConfig
from gyre.sim.durations import HierarchicalLogNormal
from gyre.sim.profile import FORMAT, Profile, ProfileError

BOOTSTRAP = 200


class CalibrationError(ValueError):
    pass


def _read_jsonl(path: str) -> list[dict]:
    rows = []
    with open(path) as fh:
        for i, line in enumerate(fh):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise CalibrationError(f"{path}:{i + 1}: not JSON ({e})") from None
    return rows


def _read_json(path: str) -> dict:
    if not os.path.exists(path):
        return {}
    with open(path) as fh:
        return json.load(fh)


class RunData:
    """The measurements of one run directory."""

    def __init__(self, path: str) -> None:
        ev_path = os.path.join(path, "events.jsonl")
        if not os.path.exists(ev_path):
            raise CalibrationError(f"{path}: no events.jsonl (a gyre.run run directory is needed)")
        events = _read_jsonl(ev_path)
        last_attempt = max((i for i, e in enumerate(events) if e.get("kind") == "attempt"), default=-1)
        self.events = events[last_attempt + 1:]  # a resumed run: its last attempt only (times restart)
        self.metrics = _read_jsonl(os.path.join(path, "metrics.jsonl")) if os.path.exists(os.path.join(path, "metrics.jsonl")) else []
        self.summary = _read_json(os.path.join(path, "summary.json"))
        self.config = _read_json(os.path.join(path, "run.json")).get("config", {})
        self.sim_result = _read_json(os.path.join(path, "result.json"))  # a simulator's out_dir (gyre.sim --out-dir)
        self.path = path
        self._parse()

    def _parse(self) -> None:
        start: dict = {}
        self.exec_dur: dict[Any, list[float]] = defaultdict(list)  # group -> durations
        self.exec_span: list[tuple[float, float]] = []
        last_finish: dict = {}
        self.eval_s: list[float] = []
        switch_from: dict = {}
        self.switch = {"train": [], "rollout": []}
        claim: dict = {}
        self.item_s: dict[int, list[float]] = defaultdict(list)
        self.step_work: dict[int, float] = defaultdict(float)
        self.items_of_group: dict[Any, int] = defaultdict(int)
        self.step_groups: dict[int, set] = defaultdict(set)
        opt_start: dict = {}
        self.opt = {True: [], False: []}
        self.cells_seen = 0
        for e in self.events:
            k, t = e.get("kind"), e.get("t")
            if k == "exec_start":
                start.setdefault((e["group"], e.get("execution")), []).append(t)
            elif k == "exec_finish":
                q = start.get((e["group"], e.get("execution")))
                if q:
                    t0 = q.pop(0)
                    self.exec_dur[e["group"]].append(t - t0)
                    self.exec_span.append((t0, t))
                last_finish[e["group"]] = t
            elif k == "group_ready" and e["group"] in last_finish:
                self.eval_s.append(t - last_finish[e["group"]])
            elif k in ("switch_to_train", "switch_to_rollout"):
                switch_from[e["cell"]] = (k.rsplit("_", 1)[1], t)
                self.cells_seen = max(self.cells_seen, e["cell"] + 1)
            elif k == "switch_done":
                what = switch_from.pop(e["cell"], None)
                if what and what[0] == e.get("role"):
                    self.switch[what[0]].append(t - what[1])
            elif k == "claim":
                claim[e["cell"]] = (t, e["step"], e["group"], e.get("item", 0))
                self.step_groups[e["step"]].add(e["group"])
                self.items_of_group[e["group"]] = max(self.items_of_group[e["group"]], e.get("item", 0) + 1)
            elif k == "item_done" and e["cell"] in claim:
                t0, step, _, _ = claim.pop(e["cell"])
                self.item_s[e["cell"]].append(t - t0)
                self.step_work[step] += t - t0
            elif k == "optimizer_step":
                opt_start[e["step"]] = (t, bool(e.get("final", True)))
            elif k == "step_done" and e["step"] in opt_start:
                t0, final = opt_start.pop(e["step"])
                self.opt[final].append(t - t0)
        if not self.exec_dur:
            raise CalibrationError(f"{self.path}: events.jsonl has no exec_start/exec_finish pairs")
        end = self.events[-1]["t"] if self.events else 0.0
        # still running when the run ended: (group, time it had run) - long ones are censored timeouts
        self.unfinished = [(g, end - ts) for (g, _), q in start.items() for ts in q]

    def step_work_normalized(self) -> list[float]:
        """Each step's work per second of its executions' mean duration: the simulator scales a
        micro-step's work with its execution's duration / the duration law's mean, and the groups a
        step takes first are the short ones, so the raw mean per step would be low by that selection.
        Multiplied by the fitted law's mean it is the simulator's cell_hours_per_step."""
        out = []
        for step, work in sorted(self.step_work.items()):
            durs = [d for g in self.step_groups.get(step, ()) for d in self.exec_dur.get(g, [])]
            if durs and np.mean(durs) > 0:
                out.append(work / float(np.mean(durs)))
        return out

    def running_load(self) -> tuple[np.ndarray, np.ndarray]:
        """Per execution: (duration, mean number of executions running over its lifetime)."""
        spans = np.array(self.exec_span)
        times = np.concatenate([spans[:, 0], spans[:, 1]])
        delta = np.concatenate([np.ones(len(spans)), -np.ones(len(spans))])
        order = np.argsort(times, kind="stable")
        times, level = times[order], np.cumsum(delta[order])
        cum = np.concatenate([[0.0], np.cumsum(level[:-1] * np.diff(times))])  # ∫ running dt up to times[i]
        integ = np.interp(spans[:, 1], times, cum) - np.interp(spans[:, 0], times, cum)
        dur = spans[:, 1] - spans[:, 0]
        return dur, np.where(dur > 0, integ / np.maximum(dur, 1e-12), 0.0)


def fit_lognormal(groups: list[np.ndarray], cap_s: float) -> dict[str, float]:
    """m, σ_q, σ_e (log-hours) by moments over the executions below the cap, cap_h; groups with at
    least half their executions at the cap form the *hard* class (hard_frac, and hard_median_h
    from the share of them that hit the cap, gyre.sim.durations.HierarchicalLogNormal)."""
    from statistics import NormalDist

    capped = [g >= cap_s * (1 - 1e-6) for g in groups]
    hard = [c.mean() >= 0.5 for c in capped]
    normal = [g for g, h in zip(groups, hard) if not h] or groups
    logs = [np.log(np.maximum(g[g < cap_s * (1 - 1e-6)], 1e-9) / 3600.0) for g in normal]
    logs = [x for x in logs if len(x)]
    if not logs:
        raise CalibrationError("every execution hit the timeout: no duration law can be fitted")
    means = np.array([x.mean() for x in logs])
    within = [((x - x.mean()) ** 2).sum() for x in logs if len(x) > 1]
    dof = sum(len(x) - 1 for x in logs if len(x) > 1)
    var_e = float(sum(within) / dof) if dof else float(np.var(np.concatenate(logs)))
    n_bar = float(np.mean([len(x) for x in logs]))
    var_q = max(float(np.var(means, ddof=1)) - var_e / n_bar, 0.0) if len(means) > 1 else 0.0
    out = {"source": "lognormal", "m": float(means.mean()), "sigma_q": math.sqrt(var_q),
           "sigma_e": max(math.sqrt(var_e), 1e-6), "cap_h": cap_s / 3600.0, "hard_frac": 0.0, "hard_median_h": 0.0}
    if any(hard) and len(normal) < len(groups):
        p = min(float(np.mean([c.mean() for c, h in zip(capped, hard) if h])), 0.999)
        out["hard_frac"] = float(np.mean(hard))
        out["hard_median_h"] = cap_s / 3600.0 * math.exp(out["sigma_e"] * NormalDist().inv_cdf(p))
    return out


def _fit_all(runs: list[RunData], rng: np.random.Generator | None) -> dict[str, Any]:
    """One fit; with rng, of a bootstrap resample (groups, steps and latencies resampled)."""

    def pick(xs: list[float]) -> np.ndarray:
        a = np.asarray(xs, dtype=float)
        if rng is None or len(a) == 0:
            return a
        return a[rng.integers(len(a), size=len(a))]

    work = pick([w for r in runs for w in r.step_work_normalized()])
    final, nonfinal = pick([x for r in runs for x in r.opt[True]]), pick([x for r in runs for x in r.opt[False]])
    to_train = pick([x for r in runs for x in r.switch["train"]])
    to_roll = pick([x for r in runs for x in r.switch["rollout"]])
    evals = pick([x for r in runs for x in r.eval_s])
    groups = [np.asarray(g, dtype=float) for r in runs for g in r.exec_dur.values()]
    if rng is not None:
        groups = [groups[i] for i in rng.integers(len(groups), size=len(groups))]
    cap_s = max(r.cap_s for r in runs)
    out: dict[str, Any] = {"durations": fit_lognormal(groups, cap_s)}
    if len(work):
        law = HierarchicalLogNormal(**{k: v for k, v in out["durations"].items() if k != "source"})
        law_mean = float(law.sample(np.random.default_rng(12345), 512, 16).mean())
        out["cell_hours_per_step"] = float(work.mean()) * law_mean / 3600.0
    if len(final):
        out["optimizer_s"] = float(final.mean())
    if len(nonfinal):
        out["param_send_s"] = max(float(nonfinal.mean()) - out.get("optimizer_s", 0.0), 0.0)
    if len(to_train):
        out["switch_to_train_s"] = float(to_train.mean())
    if len(to_roll):
        out["switch_to_rollout_s"] = float(to_roll.mean())
    if len(evals):
        out["eval_s"] = float(evals.mean())
    return out


def _reroute(runs: list[RunData]) -> tuple[float, int]:
    total, n = 0.0, 0
    for r in runs:
        for row in r.metrics:
            for kind in ("migrated", "recomputed"):
                c, lat = row.get(f"reroutes_{kind}", 0) or 0, row.get(f"reroute_latency_s_{kind}")
                if c and lat is not None:
                    total += c * float(lat)
                    n += c
    return (total / n if n else 0.0), n


def calibrate(run_dirs: list[str], *, name: str = "", bootstrap: int = BOOTSTRAP, seed: int = 0) -> Profile:
    """Fit a profile from one or more run directories of the same setting."""
    if not run_dirs:
        raise CalibrationError("--calibrate needs at least one run directory")
    runs = [RunData(p) for p in run_dirs]
    for r in runs:
        durs = np.sort(np.concatenate([np.asarray(g) for g in r.exec_dur.values()]))
        n_to = int((r.summary.get("execution_outcomes") or {}).get("timed_out", 0))
        at_max = int(np.sum(durs >= durs[-1] * (1 - 1e-6)))
        if n_to:
            r.cap_s = float(np.median(durs[-n_to:]))
        elif at_max >= 2:  # several executions ended at exactly the longest duration: the timeout
            r.cap_s = float(durs[-1])
        else:  # no timeout seen: 2x the longest
            r.cap_s = float(durs[-1]) * 2.0
        # an execution still running at the end after 0.8x the timeout would (almost surely) hit it:
        # counted as a timeout, so the slow queries the run had no time to finish are not lost
        for g, ran in r.unfinished:
            if ran >= 0.8 * r.cap_s:
                r.exec_dur[g].append(r.cap_s)
    point = _fit_all(runs, None)
    reps = [_fit_all(runs, np.random.default_rng([seed, i])) for i in range(bootstrap)]
    reroute_s, n_reroute = _reroute(runs)
    counts = {"cell_hours_per_step": sum(len(r.step_work) for r in runs),
              "optimizer_s": sum(len(r.opt[True]) for r in runs), "param_send_s": sum(len(r.opt[False]) for r in runs),
              "switch_to_train_s": sum(len(r.switch["train"]) for r in runs),
              "switch_to_rollout_s": sum(len(r.switch["rollout"]) for r in runs),
              "eval_s": sum(len(r.eval_s) for r in runs)}
    costs = {}
    for k, v in point.items():
        if k == "durations":
            continue
        vals = np.array([rep[k] for rep in reps if k in rep])
        costs[k] = {"value": v, "lo": min(float(np.percentile(vals, 5)), v), "hi": max(float(np.percentile(vals, 95)), v),
                    "n": counts[k]}
    costs["reroute_s"] = {"value": reroute_s, "lo": reroute_s, "hi": reroute_s, "n": n_reroute}
    for rep in reps:
        rep["reroute_s"] = reroute_s
    cfg, first = SimConfig(), runs[0]
    sc = first.config.get("scheduler", {})
    n_per_group = int(sc.get("n_per_group") or max(len(g) for g in first.exec_dur.values()))
    cells = max(len(first.summary.get("train_fraction") or {}), len(first.sim_result.get("cell_training_fraction") or []),
                first.cells_seen, 1)  # a cell that never trained appears in no switch event
    c_e = int(sc.get("cell_concurrency") or (first.config.get("train") or {}).get("cell_concurrency")  # train: runs before 2026-12
              or cfg.scheduler.cell_concurrency)
    fits = _diagnostics(runs, c_e, cells)
    return Profile(
        name=name or os.path.basename(os.path.normpath(run_dirs[0])),
        cluster={"num_cells": cells, "nodes_per_cell": 1, "cell_concurrency": c_e, "standalone_concurrency": 0},
        scheduler={"n_per_group": n_per_group, "batch_groups": int(sc.get("batch_groups") or cfg.scheduler.batch_groups),
                   **{k: sc[k] for k in ("tick_s", "rho_min", "tau", "phi", "mu", "mode", "streaming") if k in sc}},
        training={"reference_nodes": 1},
        costs=costs,
        durations=point["durations"],
        wall_timeout_h=max(r.cap_s for r in runs) / 3600.0 if any(  # the runner's timeout is wall-clock
            (r.summary.get("execution_outcomes") or {}).get("timed_out") for r in runs) else 0.0,
        replicates=[{k: v for k, v in rep.items()} for rep in reps],
        meta={"source": [os.path.abspath(p) for p in run_dirs], "bootstrap": bootstrap, "fits": fits,
              "not_measured": {"kv_recompute_s": "Gyre never pauses an execution",
                               "scaling_exponent": "one cell size per run"}},
    )


def _diagnostics(runs: list[RunData], c_e: int, cells: int) -> dict[str, Any]:
    durs = np.concatenate([np.asarray(g) for r in runs for g in r.exec_dur.values()])
    items = defaultdict(list)
    for r in runs:
        for c, xs in r.item_s.items():
            items[c] += xs
    core = np.mean(items[0]) if items.get(0) else None
    sat = [x for c, xs in items.items() if c > 0 for x in xs]
    dur, load = zip(*(r.running_load() for r in runs))
    dur, load = np.concatenate(dur), np.concatenate(load)
    rollout_cells = max(cells - 1, 1)
    slope = float(np.polyfit(load / c_e, dur / dur.mean(), 1)[0]) if len(dur) > 2 and np.ptp(load) > 0 else 0.0
    handover: dict[str, list[float]] = defaultdict(list)
    for r in runs:
        for part, s in (r.summary.get("handover_s") or {}).items():
            handover[part].append(s.get("mean"))
    return {
        "executions": int(len(durs)),
        "groups": int(sum(len(r.exec_dur) for r in runs)),
        "duration_quantiles_s": {f"p{q}": float(np.percentile(durs, q)) for q in (50, 90, 99)},
        "duration_mean_s": float(durs.mean()),
        "timeout_fraction": float(np.mean(durs >= max(r.cap_s for r in runs) * (1 - 1e-6))),
        "item_s_by_cell": {str(c): float(np.mean(xs)) for c, xs in sorted(items.items())},
        "satellite_speed": float(core / np.mean(sat)) if core and sat else None,
        "items_per_group": float(np.mean([v for r in runs for v in r.items_of_group.values()])) if any(
            r.items_of_group for r in runs) else None,
        "load_per_rollout_cell": float(load.mean()) / rollout_cells,
        "load_slope": slope,
        "handover_s": {k: float(np.mean([x for x in v if x is not None])) for k, v in handover.items()
                       if any(x is not None for x in v)},
    }


def main(argv: list[str]) -> int:
    """argv after `--calibrate`: RUN_DIR [RUN_DIR ...] [--out P] [--name NAME] [--bootstrap N]."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m gyre.sim --calibrate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dirs", nargs="+", help="gyre.run run directories (events.jsonl, metrics.jsonl, summary.json)")
    ap.add_argument("--out", default="profile.json", help="where the profile goes (default: profile.json)")
    ap.add_argument("--name", default="", help="profile name (default: the first run directory's name)")
    ap.add_argument("--bootstrap", type=int, default=BOOTSTRAP, help="bootstrap replicates for the intervals")
    args = ap.parse_args(argv)
    try:
        prof = calibrate(args.run_dirs, name=args.name, bootstrap=args.bootstrap)
    except (CalibrationError, ProfileError, FileNotFoundError) as e:
        print(f"gyre.sim --calibrate: error: {e}")
        return 2
    prof.save(args.out)
    print(f"profile {prof.name} ({FORMAT}) from {len(args.run_dirs)} run(s) -> {args.out}")
    for k, c in prof.costs.items():
        print(f"  {k:22s} {c['value']:12.4g}  90% [{c['lo']:.4g}, {c['hi']:.4g}]  n={c['n']}")
    d = prof.durations
    print(f"  durations: log-normal m={d['m']:.3f} sigma_q={d['sigma_q']:.3f} sigma_e={d['sigma_e']:.3f} "
          f"cap={d['cap_h'] * 3600:.1f} s; " + ", ".join(f"{k} {v:.2f} s" for k, v in prof.meta["fits"]["duration_quantiles_s"].items()))
    f = prof.meta["fits"]
    print(f"  load per rollout cell {f['load_per_rollout_cell']:.2f} (C_e {prof.cluster['cell_concurrency']}), "
          f"load slope {f['load_slope']:.3f}, satellite speed {f['satellite_speed']}")
    return 0
