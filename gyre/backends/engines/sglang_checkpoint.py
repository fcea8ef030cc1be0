"""The checkpoint directory an embedded SGLang engine starts from (`factory.build_sglang_engine`
builds the engine on it from a run's config).

SGLang loads a model from a directory at start (`Engine(model_path=...)`); its `ModelConfig`
(sglang 0.5.23 configs/model_config.py) needs a config.json that

  * names the model class: `architectures` is read unguarded, `is_generation_model(architectures)`
    evaluates `"LlamaEmbeddingModel" in None` without it (model_config.py:801-803, 2360-2366), and
    the class is looked up in its ModelRegistry (model_loader/utils.py:197-231, models/registry.py);
  * carries its dtype: with `--dtype auto` SGLang serves `config.dtype` (float32 or missing →
    float16, model_config.py:2284-2340), so Gyre passes the dtype explicitly and writes it too.

`sglang_model_dir` picks the directory: the `--model.checkpoint` directory itself when the
engine serves that checkpoint's weights (version 0: nothing copied), else a directory Gyre writes
(config.json with `architectures` and `dtype`/`torch_dtype`, weights as sharded safetensors with
an index, like `save_pretrained`), for a preset model or a later version.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import torch

from gyre.backends.models.arch import SUPPORTED, UnsupportedArchitecture, family_of

logger = logging.getLogger(__name__)

def sglang_architecture(model_config: Any) -> str:
    """The architecture name SGLang is to load `model_config` as: its family's
    (`gyre.backends.models.arch`; the EntryClass names of sglang 0.5.23's models/qwen2.py:797,
    qwen3.py:808, qwen3_moe.py:1298, llama.py:968, ModelRegistry keys in models/registry.py:118-150).
    A preset's config has no `architectures`: its model_type decides. Anything else is refused by
    name (SGLang would fall back to its Transformers backend, model_loader/utils.py:219-220, which
    Gyre does not test)."""
    try:
        return family_of(model_config).sglang_architecture
    except UnsupportedArchitecture as e:
        raise ValueError(f"sglang: {e}") from None


def checkpoint_names(model_config: Any, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` (a transformers model's in-memory names) in the names and layout of an HF checkpoint
    on disk, which is what SGLang's `load_weights` reads, from files and in
    `update_weights_from_tensor` alike. transformers 5 fuses Qwen3-MoE experts in memory
    (`mlp.experts.gate_up_proj` [E, 2I, H]); checkpoints and SGLang keep one tensor per expert
    (`mlp.experts.<e>.gate_proj.weight`: sglang 0.5.23 models/qwen3_moe.py:1157-1175,
    FusedMoE.make_expert_params_mapping). The family's own conversion does it
    (`Family.to_checkpoint_names`); names already in checkpoint form pass unchanged, and dense
    families are unchanged."""
    family = family_of(model_config)
    return family.to_checkpoint_names(dict(state), family.shape(model_config))


# SGLang's names of the families Gyre serves (the registry's; the fake checks them against the wheel).
SGLANG_ARCHITECTURES = frozenset(f.sglang_architecture for f in SUPPORTED.values())


def startable_checkpoint(path: str | os.PathLike) -> str | None:
    """None if SGLang can start on the checkpoint directory `path` as it is (a config.json whose
    `architectures` names a known family, and safetensors weights), else why not."""
    p = Path(path)
    try:
        config = json.loads((p / "config.json").read_text())
    except (OSError, ValueError) as e:
        return f"no readable config.json ({e})"
    archs = config.get("architectures") or []
    known = sorted(SGLANG_ARCHITECTURES)
    if not archs or archs[0] not in known:
        return f"config.json architectures {archs or None} is not one of {known}"
    if not any(p.glob("*.safetensors")):
        return "no *.safetensors weights"
    return None


def parse_size(size: str | int) -> int:
    """'5GB' / '500MB' / '2GiB' / bytes → bytes (HF's max_shard_size spelling)."""
    if isinstance(size, int):
        return size
    s = size.strip().upper()
    for unit, mult in (("GIB", 2**30), ("MIB", 2**20), ("KIB", 2**10), ("GB", 10**9), ("MB", 10**6), ("KB", 10**3),
                       ("B", 1)):
        if s.endswith(unit):
            return int(float(s[: -len(unit)]) * mult)
    return int(s)


def write_sharded(tensors: dict[str, torch.Tensor], path: str | os.PathLike, max_shard_bytes: int) -> list[str]:
    """Write `tensors` as safetensors shards of at most `max_shard_bytes` each (a tensor larger than
    that gets a shard of its own), plus `model.safetensors.index.json` when there is more than one
    shard: HF's layout (`model-00001-of-00003.safetensors`, weight_map), which SGLang's loader
    reads. One file, `model.safetensors`, when everything fits. Returns the file names."""
    from safetensors.torch import save_file

    path = Path(path)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += n
    for stale in list(path.glob("model*.safetensors")) + list(path.glob("model.safetensors.index.json")):
        stale.unlink()  # an earlier version's shards must not mix with these
    if len(shards) == 1:
        save_file(shards[0], str(path / "model.safetensors"), metadata={"format": "pt"})
        return ["model.safetensors"]
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for file, shard in zip(names, shards):
        save_file(shard, str(path / file), metadata={"format": "pt"})
        weight_map.update({k: file for k in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                   "weight_map": weight_map}, indent=2))
    return names


def write_model_dir(path: str | os.PathLike, model_config: Any, params: dict[str, torch.Tensor], *, dtype: str,
                    eos_token_ids: list[int], max_shard_bytes: int) -> Path:
    """A checkpoint directory SGLang starts on: config.json with `architectures`, `dtype` and
    `torch_dtype` (transformers 5 and 4 spellings) and the run's EOS ids; `params` cast to
    `dtype`, sharded. Written directly: transformers' save_pretrained writes nothing on ranks other
    than 0 of a torch.distributed job, and every cell's first rank needs its own copy."""
    import copy

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    hf_config = copy.deepcopy(model_config)
    hf_config.architectures = [sglang_architecture(model_config)]
    hf_config.eos_token_id = list(eos_token_ids) if eos_token_ids else hf_config.eos_token_id
    hf_config.to_json_file(str(path / "config.json"))
    config = json.loads((path / "config.json").read_text())
    config["dtype"] = config["torch_dtype"] = dtype
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    torch_dtype = getattr(torch, dtype)
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    tensors = {k: v.detach().to(torch_dtype).contiguous() for k, v in checkpoint_names(hf_config, params).items()
               if not (k == "lm_head.weight" and tied)}
    write_sharded(tensors, path, max_shard_bytes)
    return path


def sglang_model_dir(*, checkpoint: str | None, version: int, out_dir: str | os.PathLike, model_config: Any,
                     params: dict[str, torch.Tensor], dtype: str, eos_token_ids: list[int],
                     max_shard_bytes: int) -> tuple[str, bool]:
    """(directory, written): `checkpoint` itself when the engine serves its weights (version 0) and
    SGLang can start on it as it is; else a directory written under `out_dir`."""
    if checkpoint and version == 0:
        why = startable_checkpoint(checkpoint)
        if why is None:
            return str(checkpoint), False
        logger.warning("sglang: --model.checkpoint %s cannot be served as it is (%s); writing a copy to %s",
                       checkpoint, why, out_dir)
    return str(write_model_dir(out_dir, model_config, params, dtype=dtype, eos_token_ids=eos_token_ids,
                               max_shard_bytes=max_shard_bytes)), True
