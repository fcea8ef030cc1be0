"""The mini-swe-agent example's tasks and their evaluator (partial credit).

    python -m examples.mini_swe_agent.task --out runs/mini-swe-agent/tasks.jsonl

Each task asks the agent to create `answer.txt` in its workspace holding one given word. An agent
that can use its bash tool solves it in one command (`echo river > answer.txt`); a random model
almost never emits a well-formed tool call, so the evaluator also gives a little credit for how
close the agent's last message came to the word. That keeps the rewards of a group different
from each other, which is what the group-relative advantage needs (docs/train-your-own-agent.md,
"Give partial credit"):

    answer.txt exists:    0.5 + 0.5 * closeness(answer.txt stripped, word)
    no answer.txt:        0.3 * max over the words of the agent's last message of closeness(w, word)

`closeness` is the own_agent example's score (0.6 letters in place + 0.2 letters in common + 0.2
length, each over the longer length; copied here so that this folder stands alone). The agent's last message is read from the trajectory
mini-swe-agent writes next to the workspace (`run_mini.py` puts it at `<exec dir>/mini.traj.json`).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

from collections import Counter

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
        "evaluator": {"python": "examples.mini_swe_agent.task:evaluate", "kwargs": {"expected": word}},
        "metadata": {"word": word},
    }


def make_tasks(num_tasks: int = len(WORDS)) -> list[dict[str, Any]]:
    return [make_task(i, WORDS[i % len(WORDS)]) for i in range(num_tasks)]


def last_agent_message(workspace: Path) -> str:
    """The text of the model's last reply, from `<exec dir>/mini.traj.json` ('' if none).

    A reply with a well-formed tool call is an assistant message; a reply without one (a format
    error, what a random model mostly writes) is kept only in the error message's
    `extra.response`, so both are read."""
    try:
        traj = json.loads((Path(workspace).parent / "mini.traj.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return ""
    said = ""
    for m in traj.get("messages", []):
        if m.get("role") == "assistant":
            said = m.get("content") or ""
        elif isinstance(response := m.get("extra", {}).get("response"), dict):
            said = ((response.get("choices") or [{}])[0].get("message") or {}).get("content") or ""
    return said if isinstance(said, str) else ""


def evaluate(workspace: Path, task: Any, expected: str) -> dict[str, Any]:
    path = Path(workspace) / "answer.txt"
    try:
        got = path.read_text(encoding="utf-8", errors="replace").strip()
        return {"reward": 0.5 + 0.5 * closeness(got, expected), "answer": got[:200]}
    except (FileNotFoundError, IsADirectoryError):
        pass
    words = re.findall(r"[A-Za-z]+", last_agent_message(workspace))
    best = max((closeness(w, expected) for w in words), default=0.0)
    return {"reward": 0.3 * best, "answer": None, "closest_word": max(words, key=lambda w: closeness(w, expected), default=None)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="write the mini-swe-agent example's tasks (JSONL)")
    p.add_argument("--out", default="runs/mini-swe-agent/tasks.jsonl")
    p.add_argument("--num-tasks", type=int, default=len(WORDS))
    a = p.parse_args(argv)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(t) + "\n" for t in make_tasks(a.num_tasks)))
    print(f"wrote {a.num_tasks} tasks to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
