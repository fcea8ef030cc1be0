"""`python -m gyre.export`: a Gyre checkpoint as a plain HF directory (gyre/export.py).

The checkpoint is a real one: step 2 of the shared finished tiny run (tests/conftest.py
`finished_run`: a Qwen2-family model trained by 2 gloo ranks). transformers loads the export
with no Gyre code, and its logits are checked against Gyre's own forwards of the same
checkpoint: the engine's decoder (`DecoderWeights`, plain tensor ops) in float64, and the
actor's packed forward after `CpuActor.load_checkpoint` (the resume path) in float32. The
tokenizer and chat template are the ones the run served with.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gyre.export import ExportError, export, source_dirs

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.jobs  # finished_run starts a real job


def _ids(n: int = 40, vocab: int = 1024, seed: int = 3) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def test_export_loads_in_transformers_with_gyres_logits(finished_run, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gyre.backends.actors.cpu_actor import CpuActor
    from gyre.backends.engines.decoder import DecoderWeights, KVCache, extend
    from gyre.backends.models.hf import build_model, packed_logits
    from gyre.backends.models.tokenizer import load_tokenizer
    from safetensors.torch import load_file
    from transformers import AutoConfig

    ckpt = finished_run.dir / "checkpoints" / "step_000002"
    out = export(finished_run.dir, tmp_path / "hf")  # a run directory: its newest complete checkpoint
    names = sorted(p.name for p in out.iterdir())
    assert not {"optimizer.pt", "gyre_actor.json", "COMPLETE"} & set(names)
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(names)
    assert json.loads((out / "gyre_export.json").read_text())["version"] == 2

    ids = _ids()
    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float64).eval()
    with torch.no_grad():
        want64 = hf(ids[None]).logits[0]
    # the engine's decoder on the checkpoint's own file, float64
    state = load_file(str(ckpt / "model.safetensors"))
    config = AutoConfig.from_pretrained(str(ckpt))
    w = DecoderWeights.from_state_dict(state, config, dtype=torch.float64)
    got64 = extend(w, ids, torch.arange(len(ids)), [len(ids)], [KVCache.empty(w)], all_logits=True)
    assert (got64 - want64).abs().max() <= 1e-10
    # the actor, resumed from the checkpoint into a differently seeded model, float32
    actor = CpuActor(build_model(config, seed=99), is_core=True)
    actor.load_checkpoint(str(ckpt))
    hf32 = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    with torch.no_grad():
        mine = packed_logits(actor.model, ids, torch.arange(len(ids)), torch.tensor([0, len(ids)]))
        assert (mine - hf32(ids[None]).logits[0]).abs().max() <= 1e-5
    # the tokenizer and template the run served with (the project's, for a preset model)
    tok, served = AutoTokenizer.from_pretrained(str(out)), load_tokenizer(None)
    msgs = [{"role": "user", "content": "reverse 'stone'"}]
    assert tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == \
        served.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert json.loads((out / "tokenizer_config.json").read_text())["chat_template"] == served.chat_template


def test_cli_exports_one_step_cast_and_refuses_what_it_cannot(finished_run, tmp_path):
    from safetensors import safe_open

    step1 = finished_run.dir / "checkpoints" / "step_000001"
    cli = [sys.executable, "-m", "gyre.export"]
    proc = subprocess.run([*cli, str(step1), str(tmp_path / "bf16"), "--dtype", "bfloat16"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    with safe_open(str(tmp_path / "bf16" / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    assert json.loads((tmp_path / "bf16" / "gyre_export.json").read_text())["version"] == 1
    # a non-empty OUT without --overwrite; an incomplete checkpoint (no COMPLETE marker)
    proc = subprocess.run([*cli, str(step1), str(tmp_path / "bf16")], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "--overwrite" in proc.stderr
    broken = shutil.copytree(step1, tmp_path / "step_000001")
    (broken / "COMPLETE").unlink()
    with pytest.raises(ExportError, match="not a complete checkpoint: no COMPLETE marker"):
        export(broken, tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_source_dirs_find_the_runs_relative_paths(tmp_path, monkeypatch):
    """run.json holds --model.checkpoint as given (relative to where the run was launched):
    looked up from above the run directory when the export runs elsewhere."""
    launch = tmp_path / "repo"
    model = launch / "runs" / "p" / "data" / "model"
    model.mkdir(parents=True)
    (model / "tokenizer.json").write_text("{}")
    run = launch / "runs" / "p" / "20260101-000000"
    (run / "checkpoints" / "step_000003").mkdir(parents=True)
    (run / "run.json").write_text(json.dumps({"config": {"model": {"checkpoint": "runs/p/data/model"},
                                                         "proxy": {"tokenizer_path": None}}}))
    monkeypatch.chdir(tmp_path)  # not the launch directory
    assert source_dirs(run / "checkpoints" / "step_000003") == (str(model), str(model))
    (run / "run.json").write_text(json.dumps({"config": {"model": {"checkpoint": "gone/model"}, "proxy": {}}}))
    with pytest.raises(ExportError, match="'gone/model'.*--tokenizer"):
        source_dirs(run / "checkpoints" / "step_000003")
    (run / "run.json").write_text(json.dumps({"config": {"model": {"checkpoint": None}, "proxy": {}}}))
    assert source_dirs(run / "checkpoints" / "step_000003") == (None, None)  # a preset: the project tokenizer
