"""A short task for mini-swe-agent and its evaluator (partial credit per check).

    python -m examples.mini_swe_agent.task --out runs/mini/tasks.jsonl
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

RUN_MINI = Path(__file__).resolve().with_name("run_mini.py")


def make_tasks(step_limit: int = 8) -> list[dict[str, Any]]:
    return [{
        "task_id": "mini-hello",
        "instruction": "Create a file hello.py in the current directory that prints exactly: hello gyre",
        "harness": ["{python}", str(RUN_MINI), "--step-limit", str(step_limit)],
        "timeout_s": 300,
        "evaluator": {"python": "examples.mini_swe_agent.task:evaluate"},
    }]


def evaluate(workspace: Path, task: Any) -> dict[str, Any]:
    """0.5 for hello.py existing, 0.5 more if running it prints `hello gyre`."""
    script = Path(workspace) / "hello.py"
    if not script.exists():
        return {"reward": 0.0}
    try:
        out = subprocess.run([sys.executable, str(script)], cwd=workspace, capture_output=True, text=True, timeout=30).stdout
    except subprocess.TimeoutExpired:
        out = ""
    return {"reward": 1.0 if out.strip() == "hello gyre" else 0.5, "stdout": out[-200:]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="write the mini-swe-agent example dataset (JSONL)")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text("".join(json.dumps(t) + "\n" for t in make_tasks()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
