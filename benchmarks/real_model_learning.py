"""Does Gyre make a real pretrained model better? SmolLM2-135M-Instruct on the tool-agent task,
seeds one after another, each judged on the held-out split twice: through Gyre (`gyre.eval`:
the same harness, proxy and engine as training) and with no Gyre code in the loop
(transformers `generate` on the exported checkpoints, the task's own `base_rate.py`).

Per seed:
  1. train: `torchrun --standalone --nproc-per-node R -m gyre.run --preset PRESET --seed S --run-dir RUN`
  2. gyre.eval on the held-out split: the base model (once, shared by every seed) and RUN's final
     checkpoint, `--samples K` executions a task, into RUN/eval/ (`gyre.report RUN` shows them)
  3. export RUN's final checkpoint as a plain HF directory (`python -m gyre.export`) and measure
     base and final with transformers alone (`examples/tool_agent/base_rate.py`)
Figures per seed: the held-out pass rates before/after with the 95 % interval of the difference
(Newcombe's hybrid score interval, `gyre.eval.difference_interval`), the same from transformers,
whether the two agree (each one's difference inside the other's interval), and the training
reward's fitted rise with its 95 % bootstrap interval (summary.json). The goal (issue 51): the
held-out difference's interval and the fitted rise's interval exclude 0 in >= 2 of 3 seeds.

    python benchmarks/real_model_learning.py                          # seeds 0 1 2
    python benchmarks/real_model_learning.py --seeds 0 --preset smollm2-smoke --samples 1 --max-tasks 8
    python benchmarks/real_model_learning.py --seeds 1 2 --reuse     # keep what seed 0 already measured
Results (`--out benchmarks/results/real_model_learning.json`): machine, load, versions, commit, config,
every run, rewritten after every seed so that a stopped benchmark keeps what it measured; the last
line printed is one JSON object of the figures. `--reuse` keeps a seed's finished training run (its
summary.json) and any evaluation already written (the base model's, a seed's final), so the seeds
can be run in several sittings.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.provenance import OUT_HELP, provenance, write_results  # noqa: E402
from gyre.config import PRESETS  # noqa: E402
from gyre.eval import difference_interval  # noqa: E402

BASE_RATE = ROOT / "examples" / "tool_agent" / "base_rate.py"


class LoadSampler:
    """The 1-minute load average every 5 s while a stage runs."""

    def __init__(self) -> None:
        self.samples: list[float] = []
        self._done = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._done.wait(5.0):
            self.samples.append(os.getloadavg()[0])

    def __enter__(self) -> "LoadSampler":
        self._t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()

    @property
    def mean(self) -> float | None:
        return round(sum(self.samples) / len(self.samples), 2) if self.samples else None


def sh(cmd: list[str], log: Path, timeout: float | None = None) -> int:
    with open(log, "a") as f:
        f.write(f"$ {' '.join(map(str, cmd))}\n")
        f.flush()
        return subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, timeout=timeout).returncode


def last_json(log: Path) -> dict:
    for line in reversed(log.read_text().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise ValueError(f"{log}: no JSON line")


def prepared(cfg) -> dict:
    """What the preset's prepare step writes (the converted model, the train and held-out tasks):
    run here once (it reuses a conversion already there), so every evaluation has its files."""
    import importlib

    module, fn = cfg.train.prepare.split(":")
    return getattr(importlib.import_module(module), fn)(cfg.train.prepare_dir)


def gyre_eval(preset: str, checkpoint: str | None, out: Path, args, log: Path) -> dict:
    if args.reuse and out.exists():
        return json.loads(out.read_text())
    cmd = [sys.executable, "-m", "gyre.eval", "--preset", preset, "--executions.dataset.path", args.heldout_file,
           "--split", args.split, "--samples", str(args.samples),
           "--out", str(out), *(["--checkpoint", checkpoint] if checkpoint else []),
           *(["--max-tasks", str(args.max_tasks)] if args.max_tasks else [])]
    if sh(cmd, log) != 0:
        raise RuntimeError(f"gyre.eval failed; see {log}")
    return json.loads(out.read_text())


def hf_eval(model_dir: Path, args, log: Path, seed: int, tasks: int, out: Path) -> dict:
    """The task's own transformers-only measurement (no Gyre code): as many episodes as gyre.eval
    ran, at the harness's temperature; kept in `out`."""
    if args.reuse and out.exists():
        return json.loads(out.read_text())
    cmd = [sys.executable, str(BASE_RATE), "--checkpoint", str(model_dir), "--split", args.split, "--tasks", str(tasks),
           "--samples", str(args.transformers_samples or tasks * args.samples), "--seed", str(seed), "--temperature", str(args.temperature)]
    before = log.read_text() if log.exists() else ""
    if sh(cmd, log) != 0:
        raise RuntimeError(f"base_rate.py failed; see {log}")
    res = json.loads([x for x in log.read_text()[len(before):].splitlines() if x.startswith("{")][-1])
    res["executions"] = res["samples"]
    out.write_text(json.dumps(res) + "\n")
    return res


def before_after(base: dict, final: dict) -> dict:
    d, low, high = difference_interval(base["passed"], base["executions"], final["passed"], final["executions"])
    return {"before": round(base["passed"] / base["executions"], 4), "after": round(final["passed"] / final["executions"], 4),
            "diff": round(d, 4), "diff_ci95": [round(low, 4), round(high, 4)], "excludes_zero": low > 0}


def agree(a: dict, b: dict) -> bool:
    """Each measurement's difference lies inside the other's interval."""
    return a["diff_ci95"][0] <= b["diff"] <= a["diff_ci95"][1] and b["diff_ci95"][0] <= a["diff"] <= b["diff_ci95"][1]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--preset", default="smollm2")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--split", default="heldout")
    p.add_argument("--samples", type=int, default=2, help="executions per held-out task, in each evaluation")
    p.add_argument("--max-tasks", type=int, default=None)
    p.add_argument("--temperature", type=float, default=0.7, help="the harness's sampling temperature (the preset's)")
    p.add_argument("--runs", default="runs/real-model-learning")
    p.add_argument("--out", help=OUT_HELP)
    p.add_argument("--transformers-samples", type=int, default=None,
                   help="episodes of each transformers measurement (default: as many as gyre.eval ran)")
    p.add_argument("--skip-transformers", action="store_true",
                   help="train and evaluate through Gyre only; a later --reuse run adds the transformers measurement")
    p.add_argument("--reuse", action="store_true",
                   help="keep finished training runs and evaluations already written (run seeds in several sittings)")
    p.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="flags passed to gyre.run after the preset")
    args = p.parse_args()

    cfg = PRESETS[args.preset]()
    args.heldout_file = prepared(cfg)["heldout"]
    root = ROOT / args.runs
    root.mkdir(parents=True, exist_ok=True)
    log = root / "benchmark.log"
    runs, t_start = [], time.time()
    base_eval = base_hf = None
    for seed in args.seeds:
        run_dir = root / f"seed{seed}"
        record: dict = {"seed": seed, "run_dir": str(run_dir)}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.nproc),
               "-m", "gyre.run", "--preset", args.preset, "--seed", str(seed), "--run-dir", str(run_dir), "--overwrite",
               *args.extra]
        done = run_dir / "train.json"  # this benchmark's record of the training run
        if args.reuse and done.exists() and (run_dir / "summary.json").exists():
            record.update(json.loads(done.read_text()))
        else:
            t0 = time.time()
            with LoadSampler() as load:
                rc = sh(cmd, log)
            record.update(train_rc=rc, train_wall_s=round(time.time() - t0, 1), train_load_mean=load.mean)
            done.write_text(json.dumps({k: record[k] for k in ("train_rc", "train_wall_s", "train_load_mean")}) + "\n")
        rc = record["train_rc"]
        summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").exists() else {}
        if rc != 0 or summary.get("error"):
            record["error"] = summary.get("error") or f"gyre.run exit {rc}; see {log}"
            runs.append(record)
            report(runs, base_eval, args, t_start)
            continue
        t = summary.get("reward_trend") or {}
        record["fitted_rise"] = [t.get("fitted_rise"), t.get("fitted_rise_ci95_low"), t.get("fitted_rise_ci95_high")]
        record["fitted_rise_excludes_zero"] = bool(t) and t["fitted_rise_ci95_low"] > 0
        record["zero_advantage_groups"] = summary.get("zero_advantage_groups")
        with LoadSampler() as load:
            if base_eval is None:  # the base model, once: every seed starts from it
                base_eval = gyre_eval(args.preset, None, root / "eval-base.json", args, log)
            (run_dir / "eval").mkdir(exist_ok=True)
            (run_dir / "eval" / f"{args.split}-base.json").write_text(json.dumps(base_eval))
            final_eval = gyre_eval(args.preset, str(run_dir), run_dir / "eval" / f"{args.split}-final.json", args, log)
            if not args.skip_transformers:
                export = run_dir / "export"
                if not (args.reuse and (export / "config.json").exists()):
                    if sh([sys.executable, "-m", "gyre.export", str(run_dir), str(export), "--overwrite"], log) != 0:
                        raise RuntimeError(f"export failed; see {log}")
                n_tasks = base_eval["tasks"]
                if base_hf is None:
                    base_hf = hf_eval(Path(cfg.model.checkpoint), args, log, seed=1000, tasks=n_tasks,
                                      out=root / "transformers-base.json")
                final_hf = hf_eval(export, args, log, seed=1000 + seed, tasks=n_tasks,
                                   out=run_dir / "eval" / f"{args.split}-final-transformers.json")
        record["eval_load_mean"] = load.mean
        record["gyre_eval"] = before_after(base_eval, final_eval)
        if not args.skip_transformers:
            record["transformers_eval"] = before_after(base_hf, final_hf)
            record["evals_agree"] = agree(record["gyre_eval"], record["transformers_eval"])
        runs.append(record)
        print(json.dumps(record), flush=True)
        report(runs, base_eval, args, t_start)
    return 0


def report(runs: list[dict], base_eval: dict | None, args, t_start: float) -> None:
    """Write the results file for the seeds measured so far (after each seed: a stop keeps them)."""
    ok = [r for r in runs if "error" not in r]
    figures = {
        "seeds": len(runs), "runs_ok": len(ok),
        "heldout_rise_excludes_zero": sum(r["gyre_eval"]["excludes_zero"] for r in ok),
        "fitted_rise_excludes_zero": sum(r["fitted_rise_excludes_zero"] for r in ok),
        "transformers_agrees": sum(r.get("evals_agree", False) for r in ok),
        "transformers_measured": sum("evals_agree" in r for r in ok),
        "heldout_before": base_eval and round(base_eval["pass_rate"], 4),
        "heldout_after": [r["gyre_eval"]["after"] for r in ok],
        "train_wall_s": [r["train_wall_s"] for r in runs], "load_mean": [r.get("train_load_mean") for r in runs],
        "goal_met": len(ok) >= 2 and sum(r["gyre_eval"]["excludes_zero"] and r["fitted_rise_excludes_zero"] for r in ok) >= 2,
    }
    write_results(args.out and ROOT / args.out, {**provenance("transformers"), "config": vars(args), "runs": runs,
                                    "wall_s": round(time.time() - t_start, 1), "figures": figures})


if __name__ == "__main__":
    sys.exit(main())
