"""Model factory: HF causal LMs of the supported families, and Qwen2 size presets (no downloads).

The class comes from the architecture registry (`gyre.backends.models.arch`): a Qwen3 checkpoint loads
as `Qwen3ForCausalLM`, never as another family; an unsupported one is refused by name. Presets
build `Qwen2ForCausalLM` from a `Qwen2Config` (with `architectures` set, as SGLang requires);
checkpoints are the HF layout (`config.json` + `model.safetensors`) that `transformers` (and
SGLang) load back.

    >>> config = model_config("tiny", vocab_size=1024)
    >>> model = build_model(config, seed=0)
    >>> logits = packed_logits(model, input_ids, position_ids, cu_seqlens)   # [N, V]

Packed sequences (docs/design.md §5 micro-steps) never attend to each other: `packed_logits` runs each
sequence of a pack through the model on its own (correctness over cleverness at this size).
"""

from __future__ import annotations

import copy
import logging
import os
from dataclasses import dataclass
from typing import Literal

import torch

logger = logging.getLogger(__name__)

PresetName = Literal["tiny", "small"]


@dataclass(frozen=True)
class ModelPreset:
    """Architecture sizes of a Qwen2-style decoder (vocab comes from the tokenizer)."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    max_position_embeddings: int = 8192
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False


PRESETS: dict[str, ModelPreset] = {
    # Tests: ~0.2 M parameters with a 1024 vocab; a forward of 100 tokens takes ~1 ms.
    "tiny": ModelPreset(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128),
    # The CPU demo: ~3.5 M parameters with a 1024 vocab; still trains on 2 cores.
    "small": ModelPreset(hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4, intermediate_size=704),
}


def model_config(preset: str | ModelPreset, vocab_size: int, **overrides):
    """A `Qwen2Config` for `preset` ('tiny' | 'small' | a ModelPreset) and `vocab_size`.

    `overrides` are passed to Qwen2Config (e.g. `eos_token_id`, `bos_token_id`).
    """
    from transformers import Qwen2Config

    if isinstance(preset, str):
        if preset not in PRESETS:
            raise ValueError(f"model preset: unknown name {preset!r}; choose one of {sorted(PRESETS)}")
        preset = PRESETS[preset]
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    if preset.hidden_size % preset.num_heads or preset.num_heads % preset.num_kv_heads:
        raise ValueError(f"model preset: heads do not divide ({preset})")
    kwargs = dict(
        vocab_size=vocab_size,
        hidden_size=preset.hidden_size,
        intermediate_size=preset.intermediate_size,
        num_hidden_layers=preset.num_layers,
        num_attention_heads=preset.num_heads,
        num_key_value_heads=preset.num_kv_heads,
        max_position_embeddings=preset.max_position_embeddings,
        rms_norm_eps=preset.rms_norm_eps,
        tie_word_embeddings=preset.tie_word_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": preset.rope_theta},
        use_sliding_window=False,
        hidden_act="silu",
        architectures=["Qwen2ForCausalLM"],  # SGLang's ModelConfig refuses a config without it
    )
    kwargs.update(overrides)
    return Qwen2Config(**kwargs)


def preset_of(config) -> ModelPreset:
    """The ModelPreset a Qwen2Config was made from (inverse of `model_config`)."""
    return ModelPreset(
        hidden_size=config.hidden_size,
        num_layers=config.num_hidden_layers,
        num_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads,
        intermediate_size=config.intermediate_size,
        max_position_embeddings=config.max_position_embeddings,
        rope_theta=rope_theta(config),
        rms_norm_eps=config.rms_norm_eps,
        tie_word_embeddings=bool(config.tie_word_embeddings),
    )


def rope_theta(config) -> float:
    """RoPE base of a plain-RoPE config (transformers 5 keeps it in `rope_parameters`); a scaled
    RoPE (Llama 3.1's 'llama3') raises: its frequencies are `gyre.backends.models.arch` `Rope.inv_freq`."""
    from gyre.backends.models.arch.base import rope_parameters

    params = rope_parameters(config)
    if params["rope_type"] != "default":
        raise ValueError(f"only default RoPE is supported, got {params['rope_type']!r}")
    return float(params["rope_theta"])


DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


def dtype_of(name: str) -> torch.dtype:
    """The torch dtype a resolved `--model.dtype` or `--megatron.params-dtype` names."""
    return DTYPES[name]


def build_model(config, *, seed: int = 0, dtype: torch.dtype = torch.float32):
    """A freshly initialised model of `config`'s family (`gyre.backends.models.arch.family_of`: e.g.
    `Qwen2ForCausalLM` for a preset, `Qwen3ForCausalLM` for a Qwen3 config), deterministic in `seed`.

    Initialisation uses the global torch RNG inside `fork_rng`, so the caller's RNG state is
    untouched and the same (config, seed) gives bit-identical weights on every rank.
    """
    from gyre.backends.models.arch import family_of

    family = family_of(config)
    family.shape(config)  # refuse a variant the built-in decoder lacks (rope type, sliding window) now
    config = copy.deepcopy(config)
    config._attn_implementation = "sdpa"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = family.model_class()(config)
    model.to(dtype)
    model.eval()
    return fit_kernels(model)


def fit_kernels(model):
    """Kernels that take the model's dtype: transformers 5 runs MoE experts with torch's
    grouped_mm by default, which refuses float64 (`--model.dtype float64`); the eager loop then."""
    if getattr(model.config, "num_experts", 0) and model.dtype == torch.float64:
        model.set_experts_implementation("eager")
    return model


def check_packing(input_ids: torch.Tensor, position_ids: torch.Tensor, cu_seqlens: torch.Tensor) -> None:
    """Raise ValueError unless (input_ids [N], position_ids [N], cu_seqlens [S+1]) describe a pack."""
    n = int(input_ids.numel())
    if input_ids.dim() != 1 or position_ids.shape != input_ids.shape:
        raise ValueError(f"packed input: input_ids {tuple(input_ids.shape)} and position_ids {tuple(position_ids.shape)} must be equal 1-D")
    cu = cu_seqlens.tolist()
    if len(cu) < 2 or cu[0] != 0 or cu[-1] != n or any(b <= a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"packed input: cu_seqlens {cu} must rise strictly from 0 to N={n}")
    for a, b in zip(cu, cu[1:]):
        expect = torch.arange(b - a, dtype=position_ids.dtype)
        if not torch.equal(position_ids[a:b], expect):
            raise ValueError(f"packed input: position_ids of sequence [{a}:{b}] must be 0..{b - a - 1}")


def packed_logits(model, input_ids: torch.Tensor, position_ids: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Per-token logits [N, V] of a pack of S sequences; no attention across sequences.

    input_ids [N] int64, position_ids [N] (0.. within each sequence), cu_seqlens [S+1].
    Runs with the caller's grad mode (inside `torch.no_grad()` for rollouts).
    """
    check_packing(input_ids, position_ids, cu_seqlens)
    cu = cu_seqlens.tolist()
    out = []
    for a, b in zip(cu, cu[1:]):
        ids = input_ids[a:b].unsqueeze(0)
        pos = position_ids[a:b].unsqueeze(0)
        out.append(model(input_ids=ids, position_ids=pos, use_cache=False).logits[0])
    return torch.cat(out, dim=0)


def save_checkpoint(model, path: str) -> None:
    """Write `model` as an HF checkpoint (config.json + model.safetensors) under `path`."""
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    logger.info("saved HF checkpoint to %s", path)


def load_model(path: str, *, dtype: torch.dtype | None = None):
    """Load an HF checkpoint directory (written by `save_checkpoint`, or a user's) as its own
    family's class (`gyre.backends.models.arch.check_checkpoint`: from config.json's architectures;
    an unsupported architecture raises UnsupportedArchitecture naming it)."""
    from gyre.backends.models.arch import check_checkpoint

    family = check_checkpoint(path)
    kwargs = {"attn_implementation": "sdpa"}
    if dtype is not None:
        kwargs["dtype"] = dtype
    model = family.model_class().from_pretrained(path, **kwargs)
    model.eval()
    return fit_kernels(model)


def num_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())
