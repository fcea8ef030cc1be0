"""One architecture registry: which checkpoint families Gyre runs, and how each one differs.

    family = family_of(hf_config)               # by architectures[0], else model_type
    family = family_of_checkpoint("ckpt/dir")   # reads config.json only (cheap, before any rank builds)
    check_checkpoint("ckpt/dir")                # the same, for start-up validation
    family.model_class()                        # transformers class, e.g. Qwen3ForCausalLM
    shape = family.shape(hf_config)             # what the built-in decoder needs (arch.base.Shape)

An architecture not in `SUPPORTED` raises `UnsupportedArchitecture` (a ValueError) naming it and
listing the supported ones; it is never loaded as another family. `supported_table()` prints the
table for the docs. Megatron name mappings live in `gyre.backends.actors.mcore_mapping`, keyed by
`Family.mcore_mapping` (the model_type).

Families (one module each): qwen2 (Qwen2 / Qwen2.5), qwen3 (dense), qwen3_moe, llama (3.x).
"""

from __future__ import annotations

import json
import os

from gyre.backends.models.arch import llama, qwen2, qwen3, qwen3_moe
from gyre.backends.models.arch.base import Family, Moe, Rope, Shape, UnsupportedArchitecture, expected_shapes

__all__ = ["Family", "Moe", "Rope", "Shape", "SUPPORTED", "UnsupportedArchitecture", "check_checkpoint",
           "expected_shapes", "family_of", "family_of_checkpoint", "shape_of", "supported_table"]

SUPPORTED: dict[str, Family] = {f.name: f for f in (qwen2.FAMILY, qwen3.FAMILY, qwen3_moe.FAMILY, llama.FAMILY)}
_BY_ARCHITECTURE = {a: f for f in SUPPORTED.values() for a in f.architectures}
_BY_MODEL_TYPE = {f.model_type: f for f in SUPPORTED.values()}


def _supported_list() -> str:
    return ", ".join(f"{a} (model_type {f.model_type!r})" for a, f in _BY_ARCHITECTURE.items())


def _lookup(architectures, model_type, where: str) -> Family:
    archs = list(architectures or [])
    if archs:
        # architectures[0] decides: a config naming an unknown class is refused even when its
        # model_type is one we know (a Mistral config says model_type 'mistral', but a fine-tune
        # could say 'llama' with another head; the class is what transformers would build).
        family = _BY_ARCHITECTURE.get(archs[0])
        if family is None:
            raise UnsupportedArchitecture(f"{where}: architecture {archs[0]!r} is not supported; "
                                          f"supported: {_supported_list()}")
        if model_type and model_type != family.model_type:
            raise UnsupportedArchitecture(f"{where}: architecture {archs[0]!r} with model_type {model_type!r} "
                                          f"(expected {family.model_type!r}); supported: {_supported_list()}")
        return family
    family = _BY_MODEL_TYPE.get(model_type)
    if family is None:
        raise UnsupportedArchitecture(f"{where}: no architectures and model_type {model_type!r} is not supported; "
                                      f"supported: {_supported_list()}")
    return family


def family_of(config) -> Family:
    """The Family of an HF config object (`config.architectures[0]`, else `config.model_type`)."""
    return _lookup(getattr(config, "architectures", None), getattr(config, "model_type", None), "model config")


def family_of_checkpoint(path: str | os.PathLike) -> Family:
    """The Family of a checkpoint directory, from its config.json alone (no transformers import,
    no weights read): cheap enough to refuse a checkpoint before any rank builds anything."""
    file = os.path.join(os.fspath(path), "config.json")
    try:
        with open(file, encoding="utf-8") as f:
            raw = json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"checkpoint {os.fspath(path)!r}: no config.json") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"checkpoint {os.fspath(path)!r}: config.json is not JSON ({e})") from None
    return _lookup(raw.get("architectures"), raw.get("model_type"), f"checkpoint {os.fspath(path)!r}")


def shape_of(config) -> Shape:
    """The decoder Shape of an HF config (family checked first)."""
    return family_of(config).shape(config)


def check_checkpoint(path: str | os.PathLike) -> Family:
    """Start-up check of `--model.checkpoint DIR`: its family, and the variant's details (rope
    type, sliding window, activation) read through transformers' config class. Raises
    UnsupportedArchitecture / FileNotFoundError naming the directory."""
    family = family_of_checkpoint(path)
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(os.fspath(path))
    try:
        family.shape(config)
    except UnsupportedArchitecture as e:
        raise UnsupportedArchitecture(f"checkpoint {os.fspath(path)!r}: {e}") from None
    return family


def supported_table() -> str:
    """A Markdown table of SUPPORTED (for docs and --help)."""
    rows = ["| HF architecture | model_type | transformers class | SGLang | notes |", "|---|---|---|---|---|"]
    for f in SUPPORTED.values():
        rows.append(f"| {', '.join(f.architectures)} | {f.model_type} | {f.hf_class} | {f.sglang_architecture} | {f.notes} |")
    return "\n".join(rows)
