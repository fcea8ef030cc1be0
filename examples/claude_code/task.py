"""The Claude Code example's tasks and their evaluator (partial credit).

    python -m examples.claude_code.task --out runs/claude-code/tasks.jsonl

Each task asks the agent to create `answer.txt` holding a given word. Claude Code does it with
one tool call; a random model never calls a tool, so the evaluator also gives a little credit
for how close the agent's final answer came to the word (the group-relative advantage needs
rewards that differ within a group):

    answer.txt exists:    0.5 + 0.5 * closeness(answer.txt stripped, word)
    no answer.txt:        0.3 * max over the words of the final answer of closeness(w, word)

The final answer is the `result` of the last `{"type": "result", ...}` line of `<exec
dir>/stdout.log`, which `claude -p --output-format stream-json` (run_claude.py) and the CPU
stand-in (standin_claude.py) both print. For real tasks, replace this with a hidden test suite
(README, "Evaluators").
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter
from pathlib import Path
from typing import Any

WORDS = ["apple", "river", "stone", "cloud", "tiger", "piano", "lemon", "grass",
         "candle", "rocket", "garden", "silver", "window", "planet", "bridge", "forest"]


def closeness(got: str, want: str) -> float:
    """0.6 letters in place + 0.2 letters in common + 0.2 closeness of length, over the longer length."""
    if not got or not want:
        return 1.0 if got == want else 0.0
    n = max(len(got), len(want))
    in_place = sum(a == b for a, b in zip(got, want))
    common = sum((Counter(got) & Counter(want)).values())
    return 0.6 * in_place / n + 0.2 * common / n + 0.2 * (1.0 - abs(len(got) - len(want)) / n)


def make_task(i: int, word: str) -> dict[str, Any]:
    return {
        "task_id": f"answer-{i:02d}",
        "instruction": f"Create a file answer.txt in the current directory that contains exactly the word: {word}",
        "evaluator": {"python": "examples.claude_code.task:evaluate", "kwargs": {"expected": word}},
        "metadata": {"word": word},
    }


def make_tasks(num_tasks: int = len(WORDS)) -> list[dict[str, Any]]:
    return [make_task(i, WORDS[i % len(WORDS)]) for i in range(num_tasks)]


def final_answer(workspace: Path) -> str:
    """`result` of the last stream-json result event in `<exec dir>/stdout.log` ('' if none)."""
    try:
        lines = (Path(workspace).parent / "stdout.log").read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return ""
    for line in reversed(lines):
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(event, dict) and event.get("type") == "result":
            return str(event.get("result") or "")
    return ""


def evaluate(workspace: Path, task: Any, expected: str) -> dict[str, Any]:
    try:
        got = (Path(workspace) / "answer.txt").read_text(encoding="utf-8", errors="replace").strip()
        return {"reward": 0.5 + 0.5 * closeness(got, expected), "answer": got[:200]}
    except (FileNotFoundError, IsADirectoryError):
        pass
    words = re.findall(r"[A-Za-z]+", final_answer(workspace))
    best = max(words, key=lambda w: closeness(w, expected), default=None)
    return {"reward": 0.3 * closeness(best, expected) if best else 0.0, "answer": None, "closest_word": best}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="write the Claude Code example's tasks (JSONL)")
    p.add_argument("--out", default="runs/claude-code/tasks.jsonl")
    p.add_argument("--num-tasks", type=int, default=len(WORDS))
    a = p.parse_args(argv)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(t) + "\n" for t in make_tasks(a.num_tasks)))
    print(f"wrote {a.num_tasks} tasks to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
