"""Qwen3 dense (`Qwen3ForCausalLM`, model_type 'qwen3'): RMSNorm over each head of q and k
before RoPE (`q_norm`, `k_norm`, [head_dim]), biases only with `attention_bias` (q, k, v and o
alike), an explicit `head_dim` (transformers `models/qwen3/modeling_qwen3.py`, `Qwen3Attention`)."""

from __future__ import annotations

from gyre.backends.models.arch.base import Family, Shape, dense_shape, rope_of


def shape(config) -> Shape:
    bias = bool(getattr(config, "attention_bias", False))
    return dense_shape(config, "Qwen3ForCausalLM", rope_of(config, "Qwen3ForCausalLM", {"default": None}),
                       qkv_bias=bias, o_bias=bias, qk_norm=True)


FAMILY = Family(
    name="qwen3", architectures=("Qwen3ForCausalLM",), model_type="qwen3", hf_class="Qwen3ForCausalLM",
    sglang_architecture="Qwen3ForCausalLM", shape=shape, mcore_mapping="qwen3",
    notes="Qwen3 dense; q/k RMSNorm per head; explicit head_dim; bias only with attention_bias",
)
