"""Prepare a cpu_demo run: the task dataset and the warm-started checkpoint (skipped when it is
already there), then print the settings that point a Gyre run at them.

    python -m examples.cpu_demo.prepare --out runs/cpu_demo
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from examples.cpu_demo.task import harness_command, make_tasks
from gyre.runtime.outputs import write_text


def write_tasks(path: Path, text: str) -> Path:
    """Every rank's preflight parses the tasks file while rank 0 prepares it (issue 53: one launch
    in ~35 read 0 tasks from a file being rewritten): written whole (`write_text`), and unchanged
    content not rewritten at all."""
    if not (path.exists() and path.read_text() == text):
        write_text(path, text)
    return path


def prepare(out: str, *, num_tasks: int = 64, seed: int = 0, with_checkpoint: bool = True, **warm_kw) -> dict:
    """`with_checkpoint=False` (the job passes it when --model.checkpoint is the user's own): the
    tasks only, no warm start of the project model."""
    root = Path(out)
    root.mkdir(parents=True, exist_ok=True)
    tasks = write_tasks(root / "tasks.jsonl", "".join(json.dumps(t) + "\n" for t in make_tasks(num_tasks, seed)))
    if not with_checkpoint:
        return {"dataset": str(tasks.resolve()), "harness_command": harness_command()}
    ckpt = root / "warm_start"
    if not (ckpt / "model.safetensors").exists():
        from examples.cpu_demo.warm_start import warm_start

        warm_start(str(ckpt), seed=seed, **warm_kw)
    report = json.loads((ckpt / "warm_start.json").read_text())
    return {
        "dataset": str(tasks.resolve()),
        "checkpoint": str(ckpt.resolve()),
        "harness_command": harness_command(),
        "warm_start_reward": report["model_reward"],
        "warm_start_valid_calls": report["model_valid_call_fraction"],
    }


def prepare_smoke(out: str, *, seed: int = 0, with_checkpoint: bool = True) -> dict:
    """A seconds-long preparation for the smoke preset (CI): 8 tasks and a short warm start that
    teaches the tool-call format but not the word -> number mapping (no blur phase)."""
    return prepare(out, num_tasks=8, seed=seed, with_checkpoint=with_checkpoint, episodes=16, steps=150,
                   blur_steps=0, eval_episodes=1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="write the cpu_demo dataset and warm-start checkpoint")
    p.add_argument("--out", default="runs/cpu_demo")
    p.add_argument("--num-tasks", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    print(json.dumps(prepare(a.out, num_tasks=a.num_tasks, seed=a.seed)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
