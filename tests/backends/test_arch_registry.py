"""The architecture registry at the checkpoint boundary: each checkpoint loads as its own class
(a Qwen3 one never as Qwen2), unknown architectures are refused by name with the supported
list, and the engine reads a Qwen3-MoE checkpoint's per-expert tensors."""

from __future__ import annotations

import json
import shutil
import types

import pytest
import torch

from gyre.backends.models import arch
from gyre.backends.models.arch import SUPPORTED, UnsupportedArchitecture, family_of_checkpoint
from gyre.backends.models.hf import load_model, model_config
from tests.realmodels import write_checkpoint

VOCAB = 400  # tokenizer size of the tiny checkpoints (ids, special tokens included)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A Qwen3 and a Qwen3-MoE checkpoint directory (template qwen2.5: only the weights matter here)."""
    root = tmp_path_factory.mktemp("ckpt")
    return {f: write_checkpoint(root / f, f, vocab_size=VOCAB, template="qwen2.5") for f in ("qwen3", "qwen3-moe")}


def _ids(n=17, seed=0):
    return torch.randint(0, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family,cls", [("qwen3", "Qwen3ForCausalLM"), ("qwen3-moe", "Qwen3MoeForCausalLM")])
def test_checkpoint_loads_as_its_own_class_with_equal_logits(checkpoints, family, cls):
    """load_model builds the checkpoint's class; its logits equal AutoModelForCausalLM's. The
    old load_model (always Qwen2ForCausalLM) dropped Qwen3's q/k norms: logits off by ~10."""
    from transformers import AutoModelForCausalLM

    path = str(checkpoints[family])
    ours = load_model(path)
    ref = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa").eval()
    ids = _ids()
    with torch.no_grad():
        gap = (ours(input_ids=ids).logits - ref(input_ids=ids).logits).abs().max()
    assert gap == 0
    assert type(ours).__name__ == cls == type(ref).__name__


def test_engine_serves_checkpoint_with_hf_logits(checkpoints):
    """CpuEngine.from_checkpoint reads the on-disk names (per-expert MoE tensors) and its
    forward matches transformers on the same directory."""
    from transformers import AutoModelForCausalLM

    from gyre.backends.engines.cpu_engine import CpuEngine
    from gyre.backends.engines.decoder import KVCache, extend

    for family in ("qwen3", "qwen3-moe"):
        path = str(checkpoints[family])
        engine = CpuEngine.from_checkpoint(path)
        ref = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
        ids = _ids(23, seed=1)[0]
        w = engine._weights
        with torch.no_grad():
            got = extend(w, ids, torch.arange(23), [23], [KVCache.empty(w)], all_logits=True)
            want = ref(input_ids=ids[None]).logits[0]
        assert (got - want).abs().max() <= 1e-4, family


def test_moe_names_round_trip(checkpoints):
    """Per-expert (disk) → fused (memory) → per-expert is exact, and fused equals transformers'."""
    from safetensors.torch import load_file

    path = checkpoints["qwen3-moe"]
    disk = load_file(str(path / "model.safetensors"))
    model = load_model(str(path))
    fam = arch.family_of(model.config)
    shape = fam.shape(model.config)
    fused = fam.to_model_names(disk, shape)
    sd = model.state_dict()
    assert set(fused) == set(sd) and all(torch.equal(fused[k], sd[k]) for k in sd)
    back = fam.to_checkpoint_names(fused, shape)
    assert set(back) == set(disk) and all(torch.equal(back[k], disk[k]) for k in disk)
    del disk["model.layers.1.mlp.experts.3.up_proj.weight"]
    with pytest.raises(ValueError, match=r"experts\.3\.up_proj"):
        fam.to_model_names(disk, shape)


def _retag(src, dst, **fields):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    for k, v in fields.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("name,model_type", [("MistralForCausalLM", "mistral"), ("FooForCausalLM", "qwen3")])
def test_unknown_architecture_refused_by_name_with_the_list(checkpoints, tmp_path, name, model_type):
    """Never loaded as another family: load_model, the engine and start-up validation all refuse,
    naming the architecture and listing the supported ones (even when model_type is known)."""
    from gyre.backends.engines.cpu_engine import CpuEngine
    from gyre.backends.factory import check_model_checkpoint
    from gyre.config import ConfigError

    path = _retag(checkpoints["qwen3"], tmp_path / "x", architectures=[name], model_type=model_type)
    supported = [a for f in SUPPORTED.values() for a in f.architectures]
    for call in (family_of_checkpoint, load_model, CpuEngine.from_checkpoint):
        with pytest.raises(UnsupportedArchitecture) as err:
            call(str(path))
        assert name in str(err.value) and all(a in str(err.value) for a in supported)
    with pytest.raises(ConfigError, match=f"--model.checkpoint.*{name}"):
        check_model_checkpoint(str(path))


def test_model_type_fallback_and_unsupported_variants(checkpoints, tmp_path):
    """No `architectures`: model_type decides. Variants the decoder lacks are refused by name."""
    bare = _retag(checkpoints["qwen3"], tmp_path / "bare", architectures=None)
    assert family_of_checkpoint(bare).name == "qwen3"
    assert type(load_model(str(bare))).__name__ == "Qwen3ForCausalLM"
    yarn = _retag(checkpoints["qwen3"], tmp_path / "yarn", rope_parameters={
        "rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 1024})
    with pytest.raises(UnsupportedArchitecture, match="rope_type 'yarn'"):
        arch.check_checkpoint(yarn)
    gelu = _retag(checkpoints["qwen3"], tmp_path / "gelu", hidden_act="gelu")
    with pytest.raises(UnsupportedArchitecture, match="hidden_act 'gelu'"):
        load_model(str(gelu))
    with pytest.raises(FileNotFoundError, match="config.json"):
        family_of_checkpoint(tmp_path)


def test_presets_carry_architectures_and_model_config_of_reads_the_checkpoint(checkpoints):
    from gyre.backends.factory import model_config_of

    cfg = model_config("tiny", 64)
    assert cfg.architectures == ["Qwen2ForCausalLM"] and arch.family_of(cfg).name == "qwen2"
    mc = model_config_of(types.SimpleNamespace(checkpoint=str(checkpoints["qwen3-moe"]), preset="tiny"), 64)
    assert mc.architectures == ["Qwen3MoeForCausalLM"] and mc.vocab_size == VOCAB and mc.num_experts == 4
    assert "| Qwen3MoeForCausalLM | qwen3_moe |" in arch.supported_table()
