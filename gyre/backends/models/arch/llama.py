"""Llama 3.x (`LlamaForCausalLM`, model_type 'llama'): biases only with `attention_bias` (q, k,
v, o) and `mlp_bias` (gate, up, down); RoPE plain or Llama 3.1's `rope_type: llama3` frequency
rewrite (transformers `modeling_rope_utils.py`, `_compute_llama3_parameters`)."""

from __future__ import annotations

import math
from functools import partial

import torch

from gyre.backends.models.arch.base import Family, Shape, dense_shape, rope_of


def llama3_inv_freq(inv_freq: torch.Tensor, *, factor: float, low_freq_factor: float, high_freq_factor: float,
                    original_max_position_embeddings: int) -> torch.Tensor:
    """Llama 3.1's RoPE rewrite of inv_freq [d/2]: wavelengths shorter than
    original/high_freq_factor keep their frequency, longer than original/low_freq_factor are
    slowed by `factor`, and those between interpolate linearly in original/wavelength."""
    old = float(original_max_position_embeddings)
    wavelen = 2 * math.pi / inv_freq
    # smooth = 0 at the low-frequency edge (all `factor`), 1 at the high-frequency edge (none)
    smooth = (old / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    scaled = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelen < old / high_freq_factor, inv_freq, scaled)
    return torch.where(wavelen > old / low_freq_factor, inv_freq / factor, out)


def _llama3(params: dict):
    missing = [k for k in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
               if k not in params]
    if missing:
        raise ValueError(f"LlamaForCausalLM: rope_type 'llama3' needs {missing} in rope_parameters")
    return partial(llama3_inv_freq, factor=float(params["factor"]), low_freq_factor=float(params["low_freq_factor"]),
                   high_freq_factor=float(params["high_freq_factor"]),
                   original_max_position_embeddings=int(params["original_max_position_embeddings"]))


def shape(config) -> Shape:
    bias = bool(getattr(config, "attention_bias", False))
    return dense_shape(config, "LlamaForCausalLM",
                       rope_of(config, "LlamaForCausalLM", {"default": None, "llama3": _llama3}),
                       qkv_bias=bias, o_bias=bias, mlp_bias=bool(getattr(config, "mlp_bias", False)))


FAMILY = Family(
    name="llama", architectures=("LlamaForCausalLM",), model_type="llama", hf_class="LlamaForCausalLM",
    sglang_architecture="LlamaForCausalLM", shape=shape, mcore_mapping="llama",
    notes="Llama 3.x; rope_type default or llama3; attention_bias / mlp_bias per config",
)
