"""Parameter counts of a checkpoint's config, split the way the parallel layouts shard them.

    dims = model_dims(read_config("qwen3-8b"))        # a known config by name ...
    dims = model_dims(read_config("/ckpt/Qwen3-8B"))  # ... or a checkpoint directory / config.json
    dims.total, dims.active                           # 8_190_735_360, same (dense)

Counts come from the architecture registry's tensor table (`arch.expected_shapes` of the family's
`Shape`: biases, q/k norms and experts follow the config); a family the registry lacks is counted
as a Llama-style decoder from the config fields alone. Each layer's tensors are split into
`sharded` (attention and dense-MLP weights, split by tensor parallelism), `replicated` (RMSNorm
weights and the MoE router, whole on every TP rank) and `experts` (split by EP, then TP).

`KNOWN` holds the published config.json fields of the models users train (Hugging Face hub,
Qwen/<name>/config.json), so the planner runs without a download.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from types import SimpleNamespace

__all__ = ["KNOWN", "Layer", "ModelDims", "model_dims", "read_config"]

_QWEN3 = dict(head_dim=128, vocab_size=151936, tie_word_embeddings=False, rms_norm_eps=1e-6, rope_theta=1000000.0,
              hidden_act="silu", attention_bias=False, use_sliding_window=False, max_position_embeddings=40960)
KNOWN: dict[str, dict] = {
    "qwen3-8b": dict(_QWEN3, architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=4096,
                     intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8),
    "qwen3-14b": dict(_QWEN3, architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=5120,
                      intermediate_size=17408, num_hidden_layers=40, num_attention_heads=40, num_key_value_heads=8),
    "qwen3-32b": dict(_QWEN3, architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=5120,
                      intermediate_size=25600, num_hidden_layers=64, num_attention_heads=64, num_key_value_heads=8),
    "qwen3-30b-a3b": dict(_QWEN3, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=2048,
                          intermediate_size=6144, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                          num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, decoder_sparse_step=1,
                          mlp_only_layers=[], norm_topk_prob=True),
}
_REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
_MOE_REQUIRED = ("num_experts_per_tok", "moe_intermediate_size")


@dataclass(frozen=True)
class Layer:
    """One decoder layer's parameter counts."""

    sharded: int  # q/k/v/o (+ biases) and the dense MLP: split by TP
    replicated: int  # input/post-attention RMSNorms, q/k norms, the MoE router: whole on every TP rank
    experts: int  # every expert's SwiGLU (0 on a dense layer): split by EP, then by TP
    moe: bool


@dataclass(frozen=True)
class ModelDims:
    """What the memory planner needs of a model (counts in parameters, sizes in elements)."""

    name: str
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    intermediate: int
    tied: bool
    qk_norm: bool
    embed: int  # vocab × hidden
    head: int  # the LM head (0 when tied to the embedding)
    final_norm: int
    layers: tuple[Layer, ...]
    num_experts: int = 0
    top_k: int = 0
    moe_intermediate: int = 0

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def total(self) -> int:
        """Every parameter once (a tied head counted once)."""
        return self.embed + self.head + self.final_norm + sum(l.sharded + l.replicated + l.experts for l in self.layers)

    @property
    def active(self) -> int:
        """Parameters one token passes through: top_k of num_experts experts per MoE layer."""
        routed = sum(l.experts for l in self.layers)
        return self.total - routed + (routed * self.top_k // self.num_experts if self.num_experts else 0)


def read_config(source: str) -> tuple[str, dict]:
    """(name, config dict) of `source`: a KNOWN name, a checkpoint directory or a config.json path.
    Errors name --model."""
    key = source.lower()
    if key in KNOWN:
        return key, dict(KNOWN[key])
    path = os.path.join(source, "config.json") if os.path.isdir(source) else source
    if not os.path.isfile(path):
        raise ValueError(f"--model {source!r}: not a known model ({', '.join(KNOWN)}), a checkpoint directory "
                         f"with config.json, nor a config.json file")
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"--model {source!r}: {path} is not JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"--model {source!r}: {path} is not a JSON object")
    return os.path.basename(os.path.normpath(os.path.dirname(path) or ".")), raw


def _check_fields(raw: dict, where: str) -> bool:
    """Missing or non-positive required fields raise, naming them; returns whether it is an MoE."""
    moe = bool(raw.get("num_experts") or 0)
    need = _REQUIRED + (_MOE_REQUIRED if moe else ("intermediate_size",))
    missing = [k for k in need if raw.get(k) is None]
    if missing:
        raise ValueError(f"{where}: config field(s) {', '.join(missing)} missing (needed to count parameters)")
    bad = [k for k in need if not isinstance(raw[k], int) or raw[k] <= 0]
    if bad:
        raise ValueError(f"{where}: config field(s) {', '.join(f'{k}={raw[k]!r}' for k in bad)} must be positive integers")
    return moe


def _fallback_shape(cfg, moe: bool):
    """A Llama-style Shape from the fields alone (a family the registry does not list)."""
    from gyre.backends.models.arch.base import Moe, Rope, Shape, head_dim

    m = Moe(int(cfg.num_experts), int(cfg.num_experts_per_tok), True, int(cfg.moe_intermediate_size)) if moe else None
    return Shape(num_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size, num_heads=cfg.num_attention_heads,
                 num_kv_heads=cfg.num_key_value_heads, head_dim=head_dim(cfg),
                 intermediate_size=getattr(cfg, "intermediate_size", None) or 0, vocab_size=cfg.vocab_size,
                 eps=1e-6, tied=bool(getattr(cfg, "tie_word_embeddings", False)), rope=Rope(1e4, head_dim(cfg)),
                 qkv_bias=bool(getattr(cfg, "attention_bias", False)), qk_norm=str(cfg.model_type).startswith("qwen3"),
                 moe=m, moe_layers=frozenset(range(cfg.num_hidden_layers)) if moe else frozenset())


def model_dims(named: tuple[str, dict], where: str = "--model") -> ModelDims:
    """Count `named` = read_config(...)'s parameters per layer (module docstring)."""
    from gyre.backends.models.arch import UnsupportedArchitecture, expected_shapes, family_of

    name, raw = named
    where = f"{where} {name}"
    if raw.get("num_experts") is None and raw.get("num_local_experts") is not None:
        # transformers 5 writes Qwen3-MoE's num_experts as num_local_experts (its attribute_map)
        raw = {**raw, "num_experts": raw["num_local_experts"]}
    moe = _check_fields(raw, where)
    # transformers' default: as many KV heads as query heads when the config names none
    fields = {"rms_norm_eps": 1e-6, "model_type": "", **raw}
    fields["num_key_value_heads"] = raw.get("num_key_value_heads") or raw["num_attention_heads"]
    cfg = SimpleNamespace(**fields)
    try:
        shape = family_of(cfg).shape(cfg)
    except UnsupportedArchitecture:
        shape = _fallback_shape(cfg, moe)
    sizes = {k: math.prod(v) for k, v in expected_shapes(shape).items()}
    layers = []
    for i in range(shape.num_layers):
        mine = {k[len(f"model.layers.{i}."):]: n for k, n in sizes.items() if k.startswith(f"model.layers.{i}.")}
        experts = sum(n for k, n in mine.items() if ".experts." in k)
        repl = sum(n for k, n in mine.items() if "norm" in k or k == "mlp.gate.weight")
        layers.append(Layer(sum(mine.values()) - experts - repl, repl, experts, i in shape.moe_layers))
    m = shape.moe
    return ModelDims(name=name, hidden=shape.hidden_size, heads=shape.num_heads, kv_heads=shape.num_kv_heads,
                     head_dim=shape.head_dim, vocab=shape.vocab_size, intermediate=shape.intermediate_size,
                     tied=shape.tied, qk_norm=shape.qk_norm, embed=sizes["model.embed_tokens.weight"],
                     head=0 if shape.tied else sizes["lm_head.weight"], final_norm=sizes["model.norm.weight"],
                     layers=tuple(layers), num_experts=m.num_experts if m and shape.moe_layers else 0,
                     top_k=m.top_k if m else 0, moe_intermediate=m.intermediate_size if m else 0)
