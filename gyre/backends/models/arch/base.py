"""What a family declares, and the pieces every family shares (pure; no transformers import).

A `Family` names a checkpoint architecture (HF `architectures[0]` / `model_type`, the
transformers class, SGLang's architecture name, the Megatron mapping key) and reads an HF
config into a `Shape`: the sizes and switches the built-in decoder needs (biases, qk-norm,
head dim, RoPE, MoE layers). Every supported family uses the Llama-style HF parameter names,
so one `expected_shapes(shape)` serves them all; which optional tensors exist (biases, q/k
norms, experts) follows from the Shape alone.

    shape = family.shape(config)             # raises UnsupportedArchitecture on a variant we lack
    shapes = expected_shapes(shape)          # HF name → shape, transformers' in-memory layout
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable

import torch


class UnsupportedArchitecture(ValueError):
    """A checkpoint whose architecture (or a variant of it) no Gyre backend implements."""


@dataclass(frozen=True)
class Rope:
    """Rotary embedding of a head: `theta`, rotated `dim`, and a family's frequency rewrite
    (`scale`: inv_freq [dim/2] → inv_freq, e.g. Llama 3.x's; None for plain RoPE)."""

    theta: float
    dim: int
    scale: Callable[[torch.Tensor], torch.Tensor] | None = None

    def inv_freq(self) -> torch.Tensor:
        """[dim/2] float32 on CPU, computed as transformers does (`modeling_rope_utils.py`,
        `_compute_default_rope_parameters`: int64 arange, then float)."""
        exponents = torch.arange(0, self.dim, 2, dtype=torch.int64).float() / self.dim
        inv = 1.0 / (self.theta ** exponents)
        return inv if self.scale is None else self.scale(inv)


@dataclass(frozen=True)
class Moe:
    """A sparse MLP: softmax router over `num_experts`, top `top_k`, the kept weights
    renormalised to sum 1 when `norm_topk_prob`; each expert a SwiGLU of `intermediate_size`.
    `shared_experts`: always-on experts (0 for Qwen3-MoE; kept so a family with them is explicit)."""

    num_experts: int
    top_k: int
    norm_topk_prob: bool
    intermediate_size: int
    shared_experts: int = 0


@dataclass(frozen=True)
class Shape:
    """Everything the built-in decoder needs from an HF config, checked by the family."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # dense MLP layers
    vocab_size: int
    eps: float
    tied: bool
    rope: Rope
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # RMSNorm over head_dim of q and k, before RoPE (Qwen3)
    moe: Moe | None = None
    moe_layers: frozenset[int] = frozenset()  # layers whose MLP is `moe`


@dataclass(frozen=True)
class Family:
    """One supported checkpoint architecture (see `gyre.backends.models.arch.SUPPORTED`)."""

    name: str
    architectures: tuple[str, ...]  # config.json "architectures"[0] values
    model_type: str  # config.json "model_type"
    hf_class: str  # transformers class
    sglang_architecture: str  # SGLang's model registry name (HF's for these families)
    shape: Callable[[Any], Shape]  # HF config → Shape; raises UnsupportedArchitecture on a variant
    # HF-on-disk names ⇄ transformers' in-memory names (Qwen3-MoE fuses experts in memory);
    # identity for dense families.
    to_model_names: Callable[[dict, Shape], dict] = field(default=lambda sd, shape: dict(sd))  # same names
    to_checkpoint_names: Callable[[dict, Shape], dict] = field(default=lambda sd, shape: dict(sd))  # same names
    mcore_mapping: str = ""  # key of gyre.backends.actors.mcore_mapping (its model_type dispatch)
    notes: str = ""

    def model_class(self):
        """The transformers class (imported on call: transformers costs seconds to import)."""
        return getattr(importlib.import_module("transformers"), self.hf_class)


# ----------------------------------------------------------------------------- shared readers
def head_dim(config) -> int:
    """Explicit `head_dim` when the config has one (Qwen3: 128 with hidden 4096/32 heads = 128,
    but 4B/8B differ), else hidden / heads."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def rope_parameters(config) -> dict:
    """The config's RoPE dict (transformers 5 keeps theta and scaling in `rope_parameters`)."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    params.setdefault("rope_type", "default")
    if "rope_theta" not in params:
        params["rope_theta"] = float(getattr(config, "rope_theta", 10000.0))
    return params


def rope_of(config, family: str, scalings: dict[str, Callable[[dict], Callable] | None]) -> Rope:
    """The Rope of `config`; `scalings`: rope_type → (params → frequency rewrite) this family
    implements ('default' → None). Any other type is refused by name."""
    params = rope_parameters(config)
    kind = params["rope_type"]
    if kind not in scalings:
        raise UnsupportedArchitecture(f"{family}: rope_type {kind!r} is not implemented; supported: {sorted(scalings)}")
    if float(params.get("partial_rotary_factor", 1.0)) != 1.0:
        raise UnsupportedArchitecture(f"{family}: partial_rotary_factor {params['partial_rotary_factor']} is not implemented")
    make = scalings[kind]
    return Rope(float(params["rope_theta"]), head_dim(config), None if make is None else make(params))


def check_dense_attention(config, family: str) -> None:
    """Refuse the variants the decoder lacks: sliding-window layers, activations other than SiLU."""
    kinds = set(getattr(config, "layer_types", None) or ["full_attention"])
    if getattr(config, "use_sliding_window", False) or kinds != {"full_attention"}:
        raise UnsupportedArchitecture(f"{family}: sliding-window attention (layer_types {sorted(kinds)}, "
                                      f"use_sliding_window {getattr(config, 'use_sliding_window', False)}) "
                                      f"is not implemented")
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        raise UnsupportedArchitecture(f"{family}: hidden_act {act!r} is not implemented (SwiGLU with silu only)")


def dense_shape(config, family: str, rope: Rope, **switches) -> Shape:
    """The Shape of a dense decoder of `config`, with the family's `switches` (biases, qk_norm...)."""
    check_dense_attention(config, family)
    if config.num_attention_heads % config.num_key_value_heads:
        raise ValueError(f"{family}: {config.num_attention_heads} query heads do not split over "
                         f"{config.num_key_value_heads} key/value heads")
    return Shape(num_layers=config.num_hidden_layers, hidden_size=config.hidden_size,
                 num_heads=config.num_attention_heads, num_kv_heads=config.num_key_value_heads,
                 head_dim=head_dim(config), intermediate_size=config.intermediate_size,
                 vocab_size=config.vocab_size, eps=float(config.rms_norm_eps),
                 tied=bool(getattr(config, "tie_word_embeddings", False)), rope=rope, **switches)


def expected_shapes(shape: Shape) -> dict[str, tuple[int, ...]]:
    """HF parameter name → tensor shape, transformers' in-memory layout (lm_head included even
    when tied; experts fused as `mlp.experts.gate_up_proj` [E, 2I, H], `down_proj` [E, H, I])."""
    s = shape
    h, v = s.hidden_size, s.vocab_size
    q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    attn = {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q)}
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h)}
    for i in range(s.num_layers):
        p = f"model.layers.{i}."
        for name, dims in attn.items():
            out[p + f"self_attn.{name}.weight"] = dims
            if (s.o_bias if name == "o_proj" else s.qkv_bias):
                out[p + f"self_attn.{name}.bias"] = dims[:1]
        if s.qk_norm:
            out[p + "self_attn.q_norm.weight"] = (s.head_dim,)
            out[p + "self_attn.k_norm.weight"] = (s.head_dim,)
        if i in s.moe_layers:
            m = s.moe
            out[p + "mlp.gate.weight"] = (m.num_experts, h)
            out[p + "mlp.experts.gate_up_proj"] = (m.num_experts, 2 * m.intermediate_size, h)
            out[p + "mlp.experts.down_proj"] = (m.num_experts, h, m.intermediate_size)
        else:
            f = s.intermediate_size
            for name, dims in (("gate_proj", (f, h)), ("up_proj", (f, h)), ("down_proj", (h, f))):
                out[p + f"mlp.{name}.weight"] = dims
                if s.mlp_bias:
                    out[p + f"mlp.{name}.bias"] = dims[:1]
        out[p + "input_layernorm.weight"] = (h,)
        out[p + "post_attention_layernorm.weight"] = (h,)
    out["model.norm.weight"] = (h,)
    out["lm_head.weight"] = (v, h)
    return out
