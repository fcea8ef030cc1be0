"""Evaluator of the tool_agent example: does the answer name the price?

Gyre calls `evaluate(workspace, task, expected=PRICE)` in a child process after the harness ends; the
price comes from the task's evaluator kwargs (the harness never sees them). `passed` is the pure rule,
shared with `base_rate.py`: the expected price appears in the answer as a whole number ("42",
"$42", "42 dollars", "42.00"), not inside another number ("142", "4.2", "420").
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

# A number: digits (thousands may be grouped with commas), an optional decimal part, not glued to
# other digits or decimal points on either side.
_NUMBER = re.compile(r"(?<![\d.,])(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?!\d|[.,]\d)")


def numbers(text: str) -> list[float]:
    """The numbers written in `text`, in order: '3 apples at $42.50' -> [3.0, 42.5]."""
    return [float(m.replace(",", "")) for m in _NUMBER.findall(text)]


def passed(answer: str, expected: int) -> bool:
    return float(expected) in numbers(answer)


def evaluate(workspace: Path, task: Any, expected: int) -> dict[str, Any]:
    try:
        answer = (Path(workspace) / "answer.txt").read_text(encoding="utf-8", errors="replace").strip()
    except (FileNotFoundError, IsADirectoryError):
        return {"reward": 0.0, "answer": None}
    return {"reward": float(passed(answer, expected)), "answer": answer[:200]}
