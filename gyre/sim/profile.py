"""Workload profiles: the simulator's costs with their uncertainty, and predictions from them.

A profile (JSON, `gyre-sim-profile/1`) is what `python -m gyre.sim --calibrate RUN_DIR` writes
from a run, or what one writes by hand for a cluster one has not run on
(`gyre/sim/profiles/paper_table1.json`: the paper's Table 1 setting). It holds

- ``cluster``, ``scheduler``: the setting it was measured at (K, nodes per cell, C_e, C_s, N, B,
  tick); a prediction starts from it and any `--cluster.*` / `--scheduler.*` flag changes it;
- ``costs``: name → {value, lo, hi, n}: the fitted cost (`COSTS` says where each goes in
  `SimConfig`) and its 90 % interval (bootstrap over the run's measurements, or by hand);
- ``durations``: the harness duration law (`lognormal` parameters with a cap, or a `preset`);
- ``replicates`` (optional): joint bootstrap draws of every cost and of the duration law. Without
  them a prediction draws each cost uniformly from its [lo, hi].

`predict` runs the point profile on several seeds (the estimate) and one simulation per draw
(draw i on the i-th of those seeds, cycled), whose 5–95 % range is the interval: it holds the
parameter uncertainty and the spread between those seeds (a short run's luck).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from gyre.sim.config import SimConfig
from gyre.sim.durations import NL2REPO_122B, DurationModel, HierarchicalLogNormal
from gyre.sim.engine import SimResult, Simulation

FORMAT = "gyre-sim-profile/1"

# cost name → (section of SimConfig, field)
COSTS = {
    "cell_hours_per_step": ("training", "cell_hours_per_step"),
    "scaling_exponent": ("training", "scaling_exponent"),
    "optimizer_s": ("training", "optimizer_s"),
    "param_send_s": ("training", "param_send_s"),
    "switch_to_train_s": ("training", "switch_to_train_s"),
    "switch_to_rollout_s": ("training", "switch_to_rollout_s"),
    "eval_s": ("training", "eval_s"),
    "reroute_s": ("cluster", "reroute_s"),
    "kv_recompute_s": ("cluster", "kv_recompute_s"),
}
_SECTIONS = ("cluster", "scheduler", "training")
DURATION_KEYS = ("m", "sigma_q", "sigma_e", "cap_h", "hard_frac", "hard_median_h")


class ProfileError(ValueError):
    pass


@dataclass
class Profile:
    name: str
    cluster: dict[str, Any]
    scheduler: dict[str, Any]
    costs: dict[str, dict[str, float]]
    durations: dict[str, Any]
    training: dict[str, Any] = field(default_factory=dict)
    wall_timeout_h: float = 0.0
    replicates: list[dict[str, Any]] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)

    # ------------------------------------------------------------------ io
    @staticmethod
    def load(path: str) -> "Profile":
        with open(path) as fh:
            try:
                raw = json.load(fh)
            except json.JSONDecodeError as e:
                raise ProfileError(f"{path}: not JSON ({e})") from None
        return Profile.from_dict(raw, path)

    @staticmethod
    def from_dict(raw: dict, source: str = "profile") -> "Profile":
        if raw.get("format") != FORMAT:
            raise ProfileError(f"{source}: field 'format' must be {FORMAT!r}, got {raw.get('format')!r}")
        for key in ("name", "cluster", "scheduler", "costs", "durations"):
            if key not in raw:
                raise ProfileError(f"{source}: missing field {key!r}")
        for name, c in raw["costs"].items():
            if name not in COSTS:
                raise ProfileError(f"{source}: costs.{name} is not a known cost (known: {sorted(COSTS)})")
            if not isinstance(c, dict) or "value" not in c:
                raise ProfileError(f"{source}: costs.{name} needs a 'value'")
            lo, hi = c.get("lo", c["value"]), c.get("hi", c["value"])
            if not lo <= c["value"] <= hi or c["value"] < 0:
                raise ProfileError(f"{source}: costs.{name}: need 0 <= lo <= value <= hi, got {lo}, {c['value']}, {hi}")
        src = raw["durations"].get("source")
        if src not in ("preset", "lognormal"):
            raise ProfileError(f"{source}: durations.source must be 'preset' or 'lognormal', got {src!r}")
        if src == "lognormal":
            missing = [k for k in DURATION_KEYS[:4] if k not in raw["durations"]]
            if missing:
                raise ProfileError(f"{source}: durations needs {missing}")
        return Profile(name=raw["name"], cluster=dict(raw["cluster"]), scheduler=dict(raw["scheduler"]),
                       costs={k: dict(v) for k, v in raw["costs"].items()}, durations=dict(raw["durations"]),
                       training=dict(raw.get("training", {})), wall_timeout_h=float(raw.get("wall_timeout_h", 0.0)),
                       replicates=list(raw.get("replicates", [])), meta=dict(raw.get("meta", {})))

    def to_dict(self) -> dict:
        return {"format": FORMAT, "name": self.name, "meta": self.meta, "cluster": self.cluster,
                "scheduler": self.scheduler, "training": self.training, "wall_timeout_h": self.wall_timeout_h,
                "costs": self.costs, "durations": self.durations, "replicates": self.replicates}

    def save(self, path: str) -> None:
        with open(path, "w") as fh:
            json.dump(self.to_dict(), fh, indent=1)
            fh.write("\n")

    # ------------------------------------------------------------------ to the simulator
    def point(self) -> dict[str, Any]:
        """{cost: value, 'durations': {...}}: the point estimate as one draw."""
        return {**{k: c["value"] for k, c in self.costs.items()}, "durations": self.durations}

    def draws(self, n: int, seed: int = 0) -> list[dict[str, Any]]:
        """n parameter draws: the stored bootstrap replicates (cycled), else uniform in [lo, hi]."""
        if self.replicates:
            return [self.replicates[i % len(self.replicates)] for i in range(n)]
        rng = np.random.default_rng(seed)
        out = []
        for _ in range(n):
            d = {k: float(rng.uniform(c.get("lo", c["value"]), c.get("hi", c["value"]))) for k, c in self.costs.items()}
            out.append({**d, "durations": self.durations})
        return out

    def sim_config(self, draw: dict[str, Any] | None = None) -> SimConfig:
        """The measured setting with the costs of `draw` (default: the point estimate)."""
        draw = draw if draw is not None else self.point()
        base = SimConfig()
        cluster = {k: v for k, v in self.cluster.items() if k != "gpus_per_node"}  # the planner's, not the simulator's
        scheduler = dict(self.scheduler)
        if "cell_concurrency" in cluster:  # the profile's cluster names C_e; the scheduler counts with it
            scheduler["cell_concurrency"] = cluster.pop("cell_concurrency")
        parts = {"cluster": cluster, "scheduler": scheduler, "training": dict(self.training)}
        for name, (section, fld) in COSTS.items():
            if name in draw:
                parts[section][fld] = float(draw[name])
        try:
            return replace(base, wall_timeout_h=self.wall_timeout_h,
                           **{s: replace(getattr(base, s), **parts[s]) for s in _SECTIONS})
        except TypeError as e:
            raise ProfileError(f"profile {self.name}: {e}") from None


def duration_model(spec: dict[str, Any]) -> DurationModel:
    if spec["source"] == "preset":
        if spec.get("preset", "nl2repo-122b") != "nl2repo-122b":
            raise ProfileError(f"durations.preset: unknown preset {spec.get('preset')!r} (known: nl2repo-122b)")
        return NL2REPO_122B
    return HierarchicalLogNormal(**{k: float(spec[k]) for k in DURATION_KEYS if k in spec})


def with_costs(cfg: SimConfig, draw: dict[str, Any]) -> SimConfig:
    """cfg with the costs of a draw put in (the setting of cfg is kept)."""
    parts: dict[str, dict] = {"cluster": {}, "training": {}}
    for name, (section, fld) in COSTS.items():
        if name in draw:
            parts[section][fld] = float(draw[name])
    return replace(cfg, cluster=replace(cfg.cluster, **parts["cluster"]),
                   training=replace(cfg.training, **parts["training"]))


@dataclass
class Prediction:
    """Predicted figures of one configuration: estimate (mean over seeds) and 90 % interval."""

    step_s: float
    step_s_interval: tuple[float, float]
    staleness: float
    train_fraction: list[float]
    idle_gpu_fraction: float
    runs: list[SimResult] = field(repr=False, default_factory=list)


def step_seconds(res: SimResult, skip: int = 0) -> float:
    """Mean seconds per step (after the first `skip` steps: start-up)."""
    ends = [0.0] + res.step_end_h
    return (ends[-1] - ends[skip]) * 3600.0 / (len(ends) - 1 - skip)


def predict(cfg: SimConfig, durations_of, draws: list[dict[str, Any]], point: dict[str, Any], seeds: list[int],
            skip: int = 0, label: str = "") -> Prediction:
    """Estimate on `seeds` with the point costs; interval from one run per draw (seeds cycled).
    `durations_of(spec)` builds the duration law of a draw."""
    est = [Simulation(replace(with_costs(cfg, point), seed=s), durations_of(point["durations"]), label).run()
           for s in seeds]
    spread = [step_seconds(Simulation(replace(with_costs(cfg, d), seed=seeds[i % len(seeds)]),
                                      durations_of(d["durations"]), label).run(), skip) for i, d in enumerate(draws)]
    k = est[0].num_cells
    return Prediction(
        step_s=float(np.mean([step_seconds(r, skip) for r in est])),
        step_s_interval=(float(np.percentile(spread, 5)), float(np.percentile(spread, 95))) if spread else (np.nan, np.nan),
        staleness=float(np.mean([r.mean_staleness for r in est])),
        train_fraction=[float(np.mean([r.role_fraction(c) for r in est])) for c in range(k)],
        idle_gpu_fraction=float(np.mean([r.idle_gpu_fraction for r in est])),
        runs=est,
    )


def format_prediction(p: Prediction, cfg: SimConfig) -> str:
    lo, hi = p.step_s_interval
    return "\n".join([
        f"predicted step time {p.step_s:.1f} s ({p.step_s / 3600:.3f} h), 90 % interval [{lo:.1f}, {hi:.1f}] s",
        f"  E[d] measured {p.staleness:.3f} (formula {cfg.scheduler.expected_staleness:.3f}; the first burst is "
        f"a transient), idle GPU fraction {p.idle_gpu_fraction:.3f}",
        "  training fraction per cell: " + " ".join(f"{x:.2f}" for x in p.train_fraction),
    ])


def predict_main(argv: list[str]) -> int:
    """`python -m gyre.sim --profile P [--draws N] [--seeds S ...] [--skip-steps K] [SimConfig flags]`:
    the profile's setting changed by the flags (mode, φ, μ, cells, C_e, ...), its costs from P."""
    import argparse
    import sys

    import tyro

    ap = argparse.ArgumentParser(prog="python -m gyre.sim --profile", add_help=False)
    ap.add_argument("--profile", required=True)
    ap.add_argument("--draws", type=int, default=8, help="simulations over the profile's uncertainty (the interval)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="seeds of the estimate")
    ap.add_argument("--skip-steps", type=int, default=0, help="steps left out of the step time (start-up)")
    args, rest = ap.parse_known_args(argv)
    try:
        prof = Profile.load(args.profile)
        cfg = tyro.cli(SimConfig, args=rest, default=prof.sim_config(),
                       description="Predict one configuration from a profile: the profile's setting, changed by "
                                   "the flags below; its costs come from the profile. Also: --draws N (simulations "
                                   "over the profile's uncertainty, default 8), --seeds S [S ...] (default 0 1 2), "
                                   "--skip-steps K (start-up steps left out of s/step).")
        cfg.scheduler.validate(cfg.cluster.num_cells)
        if args.draws < 0 or not args.seeds:
            raise ProfileError("--draws must be >= 0 and --seeds non-empty")
        p = predict(cfg, duration_model, prof.draws(args.draws), prof.point(), args.seeds, args.skip_steps,
                    cfg.scheduler.mode)
    except (ProfileError, ValueError, FileNotFoundError) as e:
        print(f"gyre.sim: error: {e}", file=sys.stderr)
        return 2
    from gyre.sim.variants import describe

    print(f"profile {prof.name}: {describe(cfg)}, B={cfg.scheduler.batch_groups}, N={cfg.scheduler.n_per_group}, "
          f"{cfg.steps} steps, seeds {args.seeds}, {args.draws} draws")
    print(format_prediction(p, cfg))
    return 0
