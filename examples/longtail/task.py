"""longtail tasks: one JSONL line per query, the harness with its duration parameters, a 4 h
(scaled) timeout and a partial-progress evaluator (turns done / turns planned).

    python -m examples.longtail.task --out runs/longtail/tasks.jsonl --num-tasks 32 --time-scale 1e-3
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

HARNESS = Path(__file__).resolve().with_name("harness.py")
TIMEOUT_H = 4.0  # the paper's harness timeout


def make_tasks(num_tasks: int, *, seed: int = 0, time_scale: float = 1.0, no_model: bool = False,
               timeout_h: float = TIMEOUT_H, extra_args: list[str] | None = None) -> list[dict[str, Any]]:
    argv = ["{python}", str(HARNESS), "--seed", str(seed), "--time-scale", repr(time_scale)]
    if no_model:
        argv.append("--no-model")
    argv += extra_args or []
    return [{
        "task_id": f"longtail-{i:04d}",
        "instruction": "Work until your plan is done.",
        "harness": argv,
        "timeout_s": timeout_h * 3600.0 * time_scale,
        "evaluator": {"python": "examples.longtail.task:evaluate"},
    } for i in range(num_tasks)]


def evaluate(workspace: Path, task: Any) -> dict[str, Any]:
    """Fraction of the planned turns finished (progress.json is written after every turn)."""
    p = Path(workspace) / "progress.json"
    if not p.exists():
        return {"reward": 0.0, "turns_done": 0}
    prog = json.loads(p.read_text())
    return {"reward": prog["turns_done"] / prog["turns"], "turns_done": prog["turns_done"], "turns": prog["turns"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="write the longtail task dataset (JSONL)")
    p.add_argument("--out", required=True)
    p.add_argument("--num-tasks", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--time-scale", type=float, default=1e-3)
    p.add_argument("--no-model", action="store_true")
    a = p.parse_args(argv)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    with open(a.out, "w") as f:
        for t in make_tasks(a.num_tasks, seed=a.seed, time_scale=a.time_scale, no_model=a.no_model):
            f.write(json.dumps(t) + "\n")
    print(f"wrote {a.num_tasks} tasks to {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
