"""Write the own_agent dataset: one JSONL line per task.

    python examples/own_agent/make_tasks.py --out runs/own-agent/tasks.jsonl

Each task puts one word into `word.txt` in the workspace and asks for it reversed in `answer.txt`;
`examples/own_agent/evaluate.py` scores the answer with partial credit.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

WORDS = ["apple", "river", "stone", "cloud", "tiger", "piano", "lemon", "grass",
         "candle", "rocket", "garden", "silver", "window", "planet", "bridge", "forest"]


def make_task(i: int, word: str) -> dict:
    return {
        "task_id": f"reverse-{i:02d}",                       # [A-Za-z0-9._-], unique: names directories
        "instruction": "The file word.txt holds one word. Write that word reversed into answer.txt.",
        "files": {"word.txt": word + "\n"},                  # written into each execution's fresh workspace
        "evaluator": {"python": "examples.own_agent.evaluate:evaluate", "kwargs": {"expected": word[::-1]}},
        "timeout_s": 120,                                    # overrides --executions.runner.timeout-s
        "metadata": {"word": word},                          # free-form; the evaluator sees it as task.metadata
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/own-agent/tasks.jsonl")
    p.add_argument("--num-tasks", type=int, default=len(WORDS))
    a = p.parse_args(argv)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w") as f:
        for i in range(a.num_tasks):
            f.write(json.dumps(make_task(i, WORDS[i % len(WORDS)])) + "\n")
    print(f"wrote {a.num_tasks} tasks to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
