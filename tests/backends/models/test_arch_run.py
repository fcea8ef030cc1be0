"""`gyre.run --model.checkpoint DIR` on 2 gloo ranks for a Qwen3 and a Qwen3-MoE checkpoint: the
core trains the checkpoint's own class, the satellite and the engines build it through the
registry, every execution completes with a finite loss, and the saved checkpoint reloads in
transformers as the same class with equal logits.

The checkpoints' embeddings have exactly as many rows as the project tokenizer has ids (1024),
so no padded id can reach the proxy whichever tokenizer the job uses (`sampleable_vocab` covers
padded ones; tests/backends/engines/test_arch_vocab.py)."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest
import torch

from tests.jobs import RUNS, tiny_task, write_task_rows
from tests.realmodels import write_checkpoint

ROOT = Path(__file__).resolve().parents[3]
pytestmark = [pytest.mark.multirank, pytest.mark.slow, pytest.mark.jobs]


@pytest.mark.parametrize("family,cls", [("qwen3", "Qwen3ForCausalLM"), ("qwen3-moe", "Qwen3MoeForCausalLM")])
def test_run_on_a_real_family_checkpoint(tmp_path, family, cls):
    from transformers import AutoModelForCausalLM

    from gyre.backends.models.hf import load_model

    ckpt = write_checkpoint(tmp_path / family, family, vocab_size=1024, template="qwen2.5")
    tasks = write_task_rows(tmp_path / "tasks.jsonl", [tiny_task(t, n) for t, n in [(1, 40), (2, 60)]])
    run_dir = tmp_path / "run"
    cmd = RUNS["arch_run"].command(tasks, run_dir, "--model.checkpoint", str(ckpt))
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert set(summary["execution_outcomes"]) == {"completed"} and summary["aborted_calls"] == 0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(math.isfinite(r["loss"]) for r in rows)
    saved = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
    ours, ref = load_model(str(saved)), AutoModelForCausalLM.from_pretrained(str(saved))
    assert type(ours).__name__ == type(ref).__name__ == cls
    ids = torch.tensor([[1, 5, 9, 200, 7]])
    with torch.no_grad():
        assert torch.equal(ours(input_ids=ids).logits, ref(input_ids=ids).logits)
    start = load_model(str(ckpt))
    assert any(not torch.equal(a, b) for a, b in zip(ours.state_dict().values(), start.state_dict().values()))
