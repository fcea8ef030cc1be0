"""The cpu_demo task: write the number of letters of each word into `<word>.txt`.

Each task lists six colour words in TODO.md: four for the main agent, two for a helper
sub-agent. The answer for a word is its length (3..6). The warm start (warm_start.py) leaves a
tiny model with the tool-call format and a blurred guess of each word's number, so it starts at
a low reward; the number written for each word is exactly what RL has to sharpen. The reward
is the fraction of words whose file holds the right number: dense, and partial progress counts
after a timeout.

    python -m examples.cpu_demo.task --out runs/cpu_demo/tasks.jsonl --num-tasks 64
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path
from typing import Any

# Two words of each length 3..6. A small pool on purpose: each word recurs in most executions
# of every step, so the per-word answer gets enough reward signal within a few-minute run.
WORDS = ["red", "tan", "blue", "pink", "green", "white", "orange", "yellow"]
HARNESS = Path(__file__).resolve().with_name("harness.py")


def answer(word: str) -> str:
    return str(len(word))


def make_task(task_id: str, rng: random.Random, n_main: int = 4, n_helper: int = 2) -> dict[str, Any]:
    words = rng.sample(WORDS, n_main + n_helper)
    main, helper = words[:n_main], words[n_main:]
    return {
        "task_id": task_id,
        "instruction": f"Write the number of letters of each word into <word>.txt: {' '.join(words)}. "
                       f"The helper words ({' '.join(helper)}) go to a helper agent.",
        "files": {"TODO.md": f"main: {' '.join(main)}\nhelper: {' '.join(helper)}\n"},
        "evaluator": {"python": "examples.cpu_demo.task:evaluate", "kwargs": {"words": words}},
        "metadata": {"main": main, "helper": helper},
    }


def make_tasks(num_tasks: int, seed: int = 0) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [make_task(f"words-{i:04d}", rng) for i in range(num_tasks)]


def evaluate(workspace: Path, task: Any, words: list[str]) -> dict[str, Any]:
    """Fraction of `words` whose `<word>.txt` holds the word's length (whitespace ignored)."""
    if not words:
        raise ValueError("evaluate: no words")
    right = []
    for w in words:
        p = Path(workspace) / f"{w}.txt"
        try:
            if p.read_text().strip() == answer(w):
                right.append(w)
        except (FileNotFoundError, IsADirectoryError, UnicodeDecodeError):
            pass
    return {"reward": len(right) / len(words), "right": right}


def harness_command() -> list[str]:
    """Runner argv for this harness (RunnerConfig.harness_command)."""
    return ["{python}", str(HARNESS)]


def main(argv: list[str] | None = None) -> int:
    import json

    p = argparse.ArgumentParser(description="write the cpu_demo task dataset (JSONL)")
    p.add_argument("--out", required=True)
    p.add_argument("--num-tasks", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    with open(a.out, "w") as f:
        for t in make_tasks(a.num_tasks, a.seed):
            f.write(json.dumps(t) + "\n")
    print(f"wrote {a.num_tasks} tasks to {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
