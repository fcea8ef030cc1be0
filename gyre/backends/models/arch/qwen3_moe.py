"""Qwen3-MoE (`Qwen3MoeForCausalLM`, model_type 'qwen3_moe'): Qwen3 attention (q/k RMSNorm,
explicit head_dim) with a sparse MLP on the layers `decoder_sparse_step` / `mlp_only_layers`
pick: softmax router, top-k experts, kept weights renormalised when `norm_topk_prob`, each
expert a SwiGLU; no shared experts (transformers `models/qwen3_moe/modeling_qwen3_moe.py`,
`Qwen3MoeTopKRouter`, `Qwen3MoeExperts`, `Qwen3MoeDecoderLayer`).

Names. On disk (HF checkpoints, SGLang, Megatron mappings) each expert is its own
`mlp.experts.{e}.{gate,up,down}_proj.weight`; transformers 5 holds them fused in memory as
`mlp.experts.gate_up_proj` [E, 2I, H] (gate rows first) and `mlp.experts.down_proj` [E, H, I].
`fuse_experts` / `split_experts` convert; the decoder and the actor use the fused form.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F

from gyre.backends.models.arch.base import Family, Moe, Shape, UnsupportedArchitecture, dense_shape, rope_of

_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def shape(config) -> Shape:
    name = "Qwen3MoeForCausalLM"
    bias = bool(getattr(config, "attention_bias", False))
    experts = int(config.num_experts)
    if getattr(config, "shared_expert_intermediate_size", 0):
        raise UnsupportedArchitecture(f"{name}: shared experts are not implemented (Qwen3-MoE has none)")
    moe = Moe(num_experts=experts, top_k=int(config.num_experts_per_tok), norm_topk_prob=bool(config.norm_topk_prob),
              intermediate_size=int(config.moe_intermediate_size))
    if not 0 < moe.top_k <= max(experts, 1):
        raise ValueError(f"{name}: num_experts_per_tok {moe.top_k} must be in 1..num_experts {experts}")
    only_dense = set(getattr(config, "mlp_only_layers", None) or [])
    step = int(getattr(config, "decoder_sparse_step", 1) or 1)
    # Qwen3MoeDecoderLayer: sparse where not mlp_only and (i + 1) % decoder_sparse_step == 0
    layers = frozenset(i for i in range(config.num_hidden_layers)
                       if i not in only_dense and experts > 0 and (i + 1) % step == 0)
    return dense_shape(config, name, rope_of(config, name, {"default": None}), qkv_bias=bias, o_bias=bias,
                       qk_norm=True, moe=moe, moe_layers=layers)


def sparse_mlp(x: torch.Tensor, router: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, moe: Moe) -> torch.Tensor:
    """x [N, H] → [N, H]. router [E, H], gate_up [E, 2I, H], down [E, H, I].

    Router in float32 (softmax, top-k, renormalise), weights cast back to x's dtype; each
    token's output is the weighted sum of its k experts' SwiGLU. Only the experts some token
    chose run, on just their tokens.
    """
    probs = torch.softmax(F.linear(x, router), dim=-1, dtype=torch.float32)  # [N, E]
    top_w, top_i = torch.topk(probs, moe.top_k, dim=-1)  # [N, k]
    if moe.norm_topk_prob:
        top_w = top_w / top_w.sum(dim=-1, keepdim=True)
    top_w = top_w.to(x.dtype)
    out = torch.zeros_like(x)
    for e in top_i.unique().tolist():
        tok, slot = torch.where(top_i == e)
        gate, up = F.linear(x[tok], gate_up[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down[e]) * top_w[tok, slot, None]
        out.index_add_(0, tok, y)
    return out


def fuse_experts(state_dict: dict, shape: Shape) -> dict:
    """HF-on-disk per-expert names → transformers' fused in-memory names (others unchanged).
    Already-fused input passes through; a missing expert raises, naming it."""
    out, parts = {}, {}
    for k, v in state_dict.items():
        m = _EXPERT.match(k)
        if m is None:
            out[k] = v
        else:
            parts.setdefault(m.group(1), {})[(int(m.group(2)), m.group(3))] = v
    experts = shape.moe.num_experts if shape.moe is not None else 0
    for prefix, got in parts.items():
        need = [(e, p) for e in range(experts) for p in ("gate_proj", "up_proj", "down_proj")]
        absent = [f"{prefix}.{e}.{p}.weight" for e, p in need if (e, p) not in got]
        extra = sorted(set(got) - set(need))
        if absent or extra:
            raise ValueError(f"weights: experts of {prefix}: missing {absent[:3]}, unexpected {extra[:3]}")
        out[prefix + ".gate_up_proj"] = torch.stack([torch.cat([got[e, "gate_proj"], got[e, "up_proj"]])
                                                     for e in range(experts)])
        out[prefix + ".down_proj"] = torch.stack([got[e, "down_proj"] for e in range(experts)])
    return out


def split_experts(state_dict: dict, shape: Shape) -> dict:
    """The inverse of `fuse_experts`: fused in-memory experts → per-expert HF checkpoint names
    (views of the fused tensors)."""
    out = {}
    for k, v in state_dict.items():
        if k.endswith(".mlp.experts.gate_up_proj"):
            prefix = k.removesuffix(".gate_up_proj")
            gate, up = v.chunk(2, dim=1)
            for e in range(v.shape[0]):
                out[f"{prefix}.{e}.gate_proj.weight"], out[f"{prefix}.{e}.up_proj.weight"] = gate[e], up[e]
        elif k.endswith(".mlp.experts.down_proj"):
            prefix = k.removesuffix(".down_proj")
            for e in range(v.shape[0]):
                out[f"{prefix}.{e}.down_proj.weight"] = v[e]
        else:
            out[k] = v
    return out


FAMILY = Family(
    name="qwen3_moe", architectures=("Qwen3MoeForCausalLM",), model_type="qwen3_moe", hf_class="Qwen3MoeForCausalLM",
    sglang_architecture="Qwen3MoeForCausalLM", shape=shape, to_model_names=fuse_experts,
    to_checkpoint_names=split_experts, mcore_mapping="qwen3_moe",
    notes="Qwen3 attention + sparse MLP (softmax top-k router, norm_topk_prob; no shared experts)",
)
