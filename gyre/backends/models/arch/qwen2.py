"""Qwen2 and Qwen2.5 (`Qwen2ForCausalLM`, model_type 'qwen2'): q/k/v biases, no o_proj or MLP
biases, plain RoPE (transformers `models/qwen2/modeling_qwen2.py`, `Qwen2Attention`)."""

from __future__ import annotations

from gyre.backends.models.arch.base import Family, Shape, dense_shape, rope_of


def shape(config) -> Shape:
    return dense_shape(config, "Qwen2ForCausalLM", rope_of(config, "Qwen2ForCausalLM", {"default": None}),
                       qkv_bias=True)


FAMILY = Family(
    name="qwen2", architectures=("Qwen2ForCausalLM",), model_type="qwen2", hf_class="Qwen2ForCausalLM",
    sglang_architecture="Qwen2ForCausalLM", shape=shape, mcore_mapping="qwen2",
    notes="Qwen2 / Qwen2.5 dense; q/k/v bias; tied embeddings per config",
)
