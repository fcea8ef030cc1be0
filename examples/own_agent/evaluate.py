"""Evaluator of the own_agent example: how close `answer.txt` is to the reversed word.

Gyre calls it in a child process as `evaluate(workspace, task, **kwargs)` after the harness has
ended (also after a timeout: the workspace is preserved). It must return a number in [0, 1] or a
dict with "reward" in [0, 1]; anything else, an exception or a hang is a failed attempt.

Partial credit, so that even a random model's answers get different rewards (the group-relative
advantage needs differences). With `got` = answer.txt stripped and L = max(len(got), len(want)):

    0.6 * (letters in the right place) / L  +  0.2 * (letters in common) / L  +  0.2 * (1 - |len(got) - len(want)| / L)

An exact answer scores 1.0; a missing or empty answer.txt scores 0.0.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any


def score(got: str, want: str) -> float:
    if not got or not want:
        return 1.0 if got == want else 0.0
    n = max(len(got), len(want))
    in_place = sum(a == b for a, b in zip(got, want))
    common = sum((Counter(got) & Counter(want)).values())
    length = 1.0 - abs(len(got) - len(want)) / n
    return 0.6 * in_place / n + 0.2 * common / n + 0.2 * length


def evaluate(workspace: Path, task: Any, expected: str) -> dict[str, Any]:
    """`expected` comes from the task's evaluator kwargs (the harness never sees it)."""
    path = Path(workspace) / "answer.txt"
    try:
        got = path.read_text(encoding="utf-8", errors="replace").strip()
    except (FileNotFoundError, IsADirectoryError):
        return {"reward": 0.0, "answer": None}
    # Extra keys are kept in result.json beside the reward: handy when reading a run.
    return {"reward": score(got, expected), "answer": got[:200]}
