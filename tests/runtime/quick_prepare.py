"""A seconds-long `--train.prepare` hook for the smoke preset's ordering test
(tests/runtime/test_newcomer.py): the cpu_demo tasks, with the demo's harness capped at 3 short
calls, and a random-init tiny model where the preset's hook puts its warm start, written as
examples/cpu_demo/warm_start.py writes its own (`build_model`, `save_checkpoint`, the project
tokenizer's vocabulary and ids). The preset's own hook (`prepare_smoke`) trains and evaluates a
model for about a minute on 2 cores; what the test proves (rank 0 writes, the others read only
after the barrier that follows) is the job's, whatever the hook writes. `prepare_smoke` itself runs
in CI's newcomer stage (.ci/run); the warm start it trains, in the slow tier
(tests/executions/test_cpu_demo_engine.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HARNESS = [sys.executable, str(ROOT / "examples" / "cpu_demo" / "harness.py"), "--max-calls", "3", "--max-tokens", "12",
           "--retries", "0"]


def prepare(out: str, *, seed: int = 0, with_checkpoint: bool = True) -> dict:
    from examples.cpu_demo.task import make_tasks

    root = Path(out)
    root.mkdir(parents=True, exist_ok=True)
    tasks = root / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({**t, "harness": HARNESS}) + "\n" for t in make_tasks(8, seed)))
    if not with_checkpoint:
        return {"dataset": str(tasks)}
    from gyre.backends.models.hf import build_model, model_config, save_checkpoint
    from gyre.backends.models.tokenizer import IM_END, load_tokenizer

    tok = load_tokenizer()
    config = model_config("tiny", vocab_size=len(tok), eos_token_id=tok.convert_tokens_to_ids(IM_END),
                          bos_token_id=None, pad_token_id=tok.convert_tokens_to_ids("<|endoftext|>"))
    save_checkpoint(build_model(config, seed=seed), str(root / "warm_start"))
    return {"dataset": str(tasks), "checkpoint": str(root / "warm_start")}
