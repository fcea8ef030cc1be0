"""Megatron's side of a cell, from Gyre's and HF's configs: the cell layout's parallel state, an HF
config's TransformerConfig and GPTModel kwargs (pure), and this pipeline stage's GPTModel built
from them. The actor over it: megatron_actor.py; the APIs used: docs/backends.md, "GPU adapters"."""

from __future__ import annotations

from typing import Any

import torch

from gyre.backends.actors.mcore_mapping import (NameLayout, family_of, has_transformer_engine, head_dim, moe_layers,
                                                num_experts, rope_settings)
from gyre.backends.config import MegatronConfig
from gyre.backends.models.hf import dtype_of


# ---------------------------------------------------------------------------- parallel state
# Megatron's default order "tp-cp-ep-dp-pp" strides pipeline stages across the world (8 ranks,
# cells of 2, PP 2: stages [0, 4], [1, 5], ...); with "pp" before "dp" a cell's ranks are one
# contiguous block, Topology.cell_ranks, and each cell / pool engine is one Megatron DP replica.
MEGATRON_ORDER = "tp-cp-ep-pp-dp"


def initialize_parallel_state(mc: MegatronConfig, *, seed: int = 0) -> None:
    """Megatron parallel_state for the cell layout, then its seeded RNG tracker.

    Collective over the whole world: every `new_group` inside is world-collective, so every
    rank calls it together, standalone-pool ranks too (gyre.run does, right after
    `Topology.create_groups`); data-parallel size = world / cell size (pool engines count)."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        return
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=mc.tensor_model_parallel_size,
        pipeline_model_parallel_size=mc.pipeline_model_parallel_size,
        context_parallel_size=mc.context_parallel_size,
        expert_model_parallel_size=mc.expert_model_parallel_size,
        order=MEGATRON_ORDER,
    )
    seed_rng(seed)


def seed_rng(seed: int) -> None:
    """Megatron's model-parallel RNG states (without them, building the model raises "cuda rng
    state model-parallel-rng is not added"). On CPU (tests) megatron's CUDA tracker cannot read a
    CUDA RNG state, so its no-op inference tracker stands in: dropout is 0 and CPU-initialised
    weights draw from torch's CPU generator, so nothing forks the tracker's states there."""
    from megatron.core import tensor_parallel

    tensor_parallel.model_parallel_cuda_manual_seed(seed, inference_rng_tracker=not torch.cuda.is_available(),
                                                    force_reset_rng=True)


# ---------------------------------------------------------------------------- config translation
def transformer_config_kwargs(hf_config, mc: MegatronConfig, names: NameLayout | None = None) -> dict[str, Any]:
    """TransformerConfig kwargs for an HF config of a supported family (`mcore_mapping.FAMILIES`)
    and a cell layout (activation: SwiGLU with silu)."""
    fam = family_of(hf_config)
    names = names or NameLayout.of(hf_config)
    heads, kv = hf_config.num_attention_heads, hf_config.num_key_value_heads
    tp = mc.tensor_model_parallel_size
    if heads % tp or kv % tp:
        raise ValueError(f"megatron.tensor_model_parallel_size={tp} must divide attention heads {heads} and KV heads {kv}")
    if hf_config.num_hidden_layers % mc.pipeline_model_parallel_size:
        raise ValueError(f"megatron.pipeline_model_parallel_size={mc.pipeline_model_parallel_size} must divide {hf_config.num_hidden_layers} layers")
    dtype = dtype_of(mc.params_dtype)
    kw = dict(
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        num_attention_heads=heads,
        num_query_groups=kv,
        ffn_hidden_size=hf_config.intermediate_size,
        kv_channels=head_dim(hf_config),  # Qwen3: an explicit head_dim, not hidden / heads
        normalization="RMSNorm",
        layernorm_epsilon=hf_config.rms_norm_eps,
        gated_linear_unit=True,  # SwiGLU: linear_fc1 = [gate; up]
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=fam.qkv_bias,  # Qwen2: q/k/v biases, no o_proj / MLP biases; Qwen3, Llama: none
        qk_layernorm=fam.qk_norm,  # Qwen3: per-head RMSNorm of q and k (eps = rms_norm_eps, as HF)
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=mc.pipeline_model_parallel_size,
        context_parallel_size=mc.context_parallel_size,
        expert_model_parallel_size=mc.expert_model_parallel_size,
        sequence_parallel=False,
    )
    if fam.moe:
        # HF Qwen3-MoE routes softmax → top-k → (norm_topk_prob) renormalise. Megatron's softmax
        # router (moe_utils.topk_routing_with_score_function) with pre_softmax=False takes the
        # top-k logits then softmaxes them: the same renormalised top-k probabilities; with
        # pre_softmax=True it softmaxes all then takes the top-k, unnormalised = norm_topk_prob
        # False. No load-balancing loss (HF adds one only with output_router_logits).
        kw.update(
            num_moe_experts=num_experts(hf_config),
            moe_ffn_hidden_size=hf_config.moe_intermediate_size,
            moe_router_topk=hf_config.num_experts_per_tok,
            moe_router_score_function="softmax",
            moe_router_pre_softmax=not bool(getattr(hf_config, "norm_topk_prob", False)),
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            moe_grouped_gemm=names.moe_grouped_gemm,
            moe_layer_freq=[int(m) for m in moe_layers(hf_config)],  # mlp_only_layers / decoder_sparse_step
            # alltoall is megatron's choice for EP on GPUs; it opens a CUDA stream when built
            # (token_dispatcher.py:445), so CPU (gloo tests) takes the allgather dispatcher
            moe_token_dispatcher_type=("alltoall" if mc.expert_model_parallel_size > 1 and torch.cuda.is_available()
                                       else "allgather"),
        )
    return kw


def gpt_model_kwargs(hf_config) -> dict[str, Any]:
    """GPTModel kwargs (besides config and layer spec) for an HF config (RoPE per
    `mcore_mapping.rope_settings`; an inv_freq megatron cannot express is installed by
    `build_gpt_model`)."""
    rope, _ = rope_settings(hf_config)
    return dict(
        vocab_size=hf_config.vocab_size,
        max_sequence_length=hf_config.max_position_embeddings,
        position_embedding_type="rope",
        **rope,
        share_embeddings_and_output_weights=bool(hf_config.tie_word_embeddings),
        parallel_output=True,
    )


def layer_spec(hf_config, config, names: NameLayout):
    """Megatron's layer spec for this family and layout: the TE spec (fused norms) or the local
    one; MoE models take megatron's decoder block spec, which mixes dense and MoE layers per
    `moe_layer_freq` and slices this pipeline stage's layers (gpt_layer_specs.get_gpt_decoder_block_spec)."""
    from megatron.core.models.gpt import gpt_layer_specs as specs

    te = names.spec == "te"
    if family_of(hf_config).moe:
        return specs.get_gpt_decoder_block_spec(config, use_transformer_engine=te, normalization="RMSNorm")
    if te:
        return specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=config.qk_layernorm)
    return specs.get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=config.qk_layernorm)


def _no_init(tensor: torch.Tensor) -> None:
    """An init_method that leaves the tensor as allocated (its weights are imported next)."""


def build_gpt_model(hf_config, mc: MegatronConfig, *, use_cpu_initialization: bool = False,
                    init_weights: bool = True, names: NameLayout | None = None):
    """GPTModel for this rank's pipeline stage (parallel_state must be initialised), shaped from
    the HF config alone (no HF model). TE layer spec where Transformer Engine is installed
    (packed 'thd' attention), else the local spec. `init_weights=False`: no random draws (the
    weights are imported next). Not megatron's perform_initialization=False: that also skips
    tagging the TP-sharded weights (`tensor_model_parallel`, tensor_parallel/layers.py:855),
    which the grad norm's duplicate test reads; no-op init methods keep the tags."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer import TransformerConfig

    names = names or NameLayout.of(hf_config)
    if names.spec == "te" and not has_transformer_engine():
        raise RuntimeError("build_gpt_model: the TE layer spec needs Transformer Engine, which is not installed")
    if family_of(hf_config).moe and not has_transformer_engine():
        # megatron-core 0.16.1 moe_utils.py:1192 tests `te_general_gemm is not None`, a name it
        # binds only when TE imports (moe_utils.py:25-35): without TE every router forward raises
        # NameError. Binding it to None is what that test expects (plain torch.mm then).
        from megatron.core.transformer.moe import moe_utils

        if not hasattr(moe_utils, "te_general_gemm"):
            moe_utils.te_general_gemm = None
    kwargs = transformer_config_kwargs(hf_config, mc, names)
    kwargs["use_cpu_initialization"] = use_cpu_initialization
    if not init_weights:
        kwargs.update(init_method=_no_init, output_layer_init_method=_no_init, embedding_init_method=_no_init)
    config = TransformerConfig(**kwargs)
    model = GPTModel(config=config, transformer_layer_spec=layer_spec(hf_config, config, names),
                     pre_process=parallel_state.is_pipeline_first_stage(),
                     post_process=parallel_state.is_pipeline_last_stage(), **gpt_model_kwargs(hf_config))
    _, inv_freq = rope_settings(hf_config)
    if inv_freq is not None:  # llama3 constants megatron's rope_scaling hard-codes otherwise (mcore_mapping)
        rot = model.rotary_pos_emb
        rot.inv_freq = inv_freq.to(rot.inv_freq.device, rot.inv_freq.dtype)
    return model
