"""The CPU actor on real-family checkpoints: trains the checkpoint's own class, and its
parameters round-trip in transformers' naming (satellites, engines and resume read them)."""

from __future__ import annotations

import pytest
import torch

from gyre.backends.actors.cpu_actor import CpuActor
from gyre.backends.engines.cpu_engine import CpuEngine
from gyre.backends.models.hf import build_model, load_model
from tests.backends.helpers import finish_step, random_step
from tests.realmodels import write_checkpoint

VOCAB = 300


@pytest.fixture(scope="module", params=["qwen3", "qwen3-moe"])
def checkpoint(request, tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp(request.param), request.param, vocab_size=VOCAB, template="qwen2.5")


def test_train_step_export_and_satellite_import(checkpoint):
    model = load_model(str(checkpoint))
    actor = CpuActor(model, is_core=True)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    step = finish_step(random_step(model, seed=0, num_exec=2, seqs_per_exec=2, num_micro=2, vocab=VOCAB))
    metrics = [actor.forward_backward(ms) for ms in step]
    assert all(torch.isfinite(torch.tensor(m["loss"])) for m in metrics)
    out = actor.optimizer_step(max_grad_norm=1.0)
    assert torch.isfinite(torch.tensor(out["grad_norm"])) and actor.version == 1
    params = actor.export_parameters()
    sd = model.state_dict()
    # transformers' naming, equal to the model's own state dict (tied lm_head is the embedding)
    assert set(params) == set(sd) - ({"lm_head.weight"} if model.config.tie_word_embeddings else set())
    assert all(torch.equal(params[k], sd[k]) for k in params)
    assert any(not torch.equal(sd[k], before[k]) for k in params)  # the step changed weights
    # a satellite: a fresh model of the same config (the registry's class), then the core's params
    sat = CpuActor(build_model(model.config, seed=5), is_core=False)
    assert type(sat.model) is type(model)
    sat.import_parameters(params)
    assert all(torch.equal(p, sd[k]) for k, p in sat.model.state_dict().items())
    # an engine serves the exported (in-memory) names
    engine = CpuEngine(model.config, params)
    assert engine._weights.shape.qk_norm


def test_checkpoint_round_trip_and_wrong_class_refused(checkpoint, tmp_path):
    """save_checkpoint writes HF names (per-expert for MoE); load_checkpoint reads them back."""
    model = load_model(str(checkpoint))
    actor = CpuActor(model, is_core=True)
    actor.save_checkpoint(str(tmp_path))
    other = CpuActor(build_model(model.config, seed=9), is_core=True)
    other.load_checkpoint(str(tmp_path))
    assert all(torch.equal(p, q) for p, q in zip(model.state_dict().values(), other.model.state_dict().values()))
    again = load_model(str(tmp_path))
    assert type(again) is type(model)
    wide = load_model(str(tmp_path), dtype=torch.float64)  # --model.dtype float64 (MoE: eager experts)
    with torch.no_grad():
        assert torch.allclose(wide(input_ids=torch.tensor([[1, 2, 3]])).logits.float(),
                              again(input_ids=torch.tensor([[1, 2, 3]])).logits, atol=1e-4)


def test_wrong_class_for_the_config_refused():
    """A Qwen2 class under a Qwen3 config (what the old load_model built) is refused by name."""
    from transformers import Qwen2ForCausalLM

    from tests.realmodels import model_config

    with pytest.raises(ValueError, match="Qwen2ForCausalLM but its config's architecture is Qwen3ForCausalLM"):
        CpuActor(Qwen2ForCausalLM(model_config("qwen3", VOCAB)), is_core=False)
