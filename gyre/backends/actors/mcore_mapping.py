"""HF ⇄ Megatron-core (0.16.1) weight names and shapes, per model family; pure (no megatron import).
(Over 600 lines: four families × two layer-spec layouts × two expert layouts, each mapping beside its inverse.)

    fam = family_of(hf_config)                       # refuses an unknown model_type by name
    names = NameLayout.of(hf_config, te=True)        # which megatron names (default: what is installed)
    full = hf_to_mcore(hf_state_dict, hf_config, names)      # full (unsharded) megatron tensors
    mine = shard(full, names, tp_rank=1, tp=2, ep_rank=0, ep=1)
    hf = mcore_to_hf(unshard_tp([...]), hf_config, names)    # the inverse, exact

Families (`hf_config.model_type`): 'qwen2' (Qwen2/2.5: q/k/v biases), 'qwen3' (per-head q/k
RMSNorm = megatron `qk_layernorm`, explicit head_dim = `kv_channels`), 'qwen3_moe' (Qwen3
attention, top-k softmax router, SwiGLU experts), 'llama' (Llama 3.x, llama3 RoPE scaling).

Name layouts: `local` (`get_gpt_layer_local_spec`: separate norms) and `te`
(`get_gpt_layer_with_transformer_engine_spec`: norms fused into `linear_qkv` / `linear_fc1` as
`layer_norm_weight`, an MoE layer keeping `pre_mlp_layernorm`). Expert layouts: `sequential`
(SequentialMLP, `mlp.experts.local_experts.{j}.*`) and `grouped` (TEGroupedMLP,
`mlp.experts.linear_fc1.weight{j}`). Where megatron states each name: docs/backends.md, "GPU
adapters". The full megatron dict numbers experts globally (0..E-1); `shard` keeps this EP rank's
E/EP experts renumbered from 0, as megatron's local modules are.

The tables stay in one module so a family's whole mapping reads together; a fifth family would
move the per-family tables into modules beside gyre/backends/models/arch/.
"""

from __future__ import annotations

import functools
import logging
import math
import re
from dataclasses import dataclass
from typing import Callable, Iterator, Mapping

import torch

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------- families
@dataclass(frozen=True)
class Family:
    """What the megatron mapping needs to know about an HF architecture family."""

    model_type: str
    qkv_bias: bool  # q/k/v projections carry biases (o_proj, MLP never do in these families)
    qk_norm: bool  # per-head RMSNorm on q and k before RoPE (megatron qk_layernorm)
    moe: bool


FAMILIES: dict[str, Family] = {
    "qwen2": Family("qwen2", qkv_bias=True, qk_norm=False, moe=False),
    "qwen3": Family("qwen3", qkv_bias=False, qk_norm=True, moe=False),
    "qwen3_moe": Family("qwen3_moe", qkv_bias=False, qk_norm=True, moe=True),
    "llama": Family("llama", qkv_bias=False, qk_norm=False, moe=False),
}


def family_of(hf_config) -> Family:
    """The family of an HF config; anything else is refused by name, never mapped as another."""
    mt = getattr(hf_config, "model_type", None)
    if mt not in FAMILIES:
        raise ValueError(f"Megatron actor: model_type {mt!r} is not supported; supported: {sorted(FAMILIES)}")
    fam = FAMILIES[mt]
    # Variants the HF config can switch on that megatron's flags cannot express one-to-one:
    # HF's attention_bias also puts a bias on o_proj (megatron add_bias_linear would add one to
    # every linear), mlp_bias on the MLP.
    if fam.model_type != "qwen2" and getattr(hf_config, "attention_bias", False):
        raise ValueError(f"Megatron actor: {mt} with attention_bias=True (q/k/v and o_proj biases) is not supported")
    if getattr(hf_config, "mlp_bias", False):
        raise ValueError(f"Megatron actor: {mt} with mlp_bias=True is not supported")
    act = getattr(hf_config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"Megatron actor: {mt} with hidden_act={act!r} is not supported (SwiGLU with silu only)")
    if fam.model_type == "qwen2" and getattr(hf_config, "use_sliding_window", False):
        raise ValueError("Megatron actor: qwen2 with use_sliding_window=True is not supported")
    return fam


def head_dim(hf_config) -> int:
    return getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads


def moe_layers(hf_config) -> list[bool]:
    """Which decoder layers are MoE (HF Qwen3-MoE: not in mlp_only_layers, num_experts > 0 and
    (i + 1) % decoder_sparse_step == 0, transformers' Qwen3MoeDecoderLayer)."""
    n = hf_config.num_hidden_layers
    if not family_of(hf_config).moe:
        return [False] * n
    only = set(getattr(hf_config, "mlp_only_layers", None) or [])
    step = getattr(hf_config, "decoder_sparse_step", 1) or 1
    experts = getattr(hf_config, "num_experts", 0) or 0
    return [i not in only and experts > 0 and (i + 1) % step == 0 for i in range(n)]


def num_experts(hf_config) -> int:
    return (getattr(hf_config, "num_experts", 0) or 0) if family_of(hf_config).moe else 0


# ---------------------------------------------------------------------------- rope
# megatron-core 0.16.1 RotaryEmbedding._apply_scaling (models/common/embeddings/
# rotary_pos_embedding.py:92) takes only `factor`: low_freq_factor 1, high_freq_factor 4 and
# original_max_position_embeddings 8192 are fixed (Llama 3.1's own values).
MEGATRON_LLAMA3_FIXED = dict(low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)
SUPPORTED_ROPE = ("default", "llama3")


def rope_parameters(hf_config) -> dict:
    """RoPE settings of an HF config (transformers 5 keeps them in `rope_parameters`; older
    configs in rope_theta / rope_scaling)."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    if not params:
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    if "rope_type" not in params:
        params["rope_type"] = params.get("type", "default")
    return params


def llama3_inv_freq(base: float, dim: int, factor: float, low_freq_factor: float, high_freq_factor: float,
                    original_max_position_embeddings: int) -> torch.Tensor:
    """Llama 3 scaled inverse frequencies (fp32), the formula of transformers'
    `_compute_llama3_parameters` and megatron's `_apply_scaling`, with every constant free."""
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    low_wl, high_wl = original_max_position_embeddings / low_freq_factor, original_max_position_embeddings / high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wl, inv / factor, inv)
    smooth = (original_max_position_embeddings / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wl) * ~(wavelen > low_wl)
    return torch.where(medium, smoothed, scaled)


def rope_settings(hf_config) -> tuple[dict, torch.Tensor | None]:
    """(GPTModel rope kwargs, inv_freq to install on the built model or None).

    default: rotary_base only. llama3 with megatron's fixed constants: megatron's own
    `rope_scaling=True, rope_scaling_factor`. llama3 with other constants (a model trained with
    another original context): megatron cannot express them, so the exact inverse frequencies are
    computed here and installed on `model.rotary_pos_emb.inv_freq` after building. Any other
    rope_type (linear, dynamic, yarn, longrope: position- or attention-scaled) is refused."""
    p = rope_parameters(hf_config)
    kind, base = p["rope_type"], float(p.get("rope_theta", 10000.0))
    kwargs = dict(rotary_base=int(base))
    if int(base) != base:
        raise ValueError(f"Megatron actor: rope_theta={base} is not an integer (megatron's rotary_base is an int)")
    if kind == "default":
        return kwargs, None
    if kind == "llama3":
        consts = {k: float(p[k]) for k in MEGATRON_LLAMA3_FIXED}
        if consts == {k: float(v) for k, v in MEGATRON_LLAMA3_FIXED.items()}:
            return dict(kwargs, rope_scaling=True, rope_scaling_factor=float(p["factor"])), None
        dim = head_dim(hf_config)
        return kwargs, llama3_inv_freq(base, dim, float(p["factor"]), consts["low_freq_factor"],
                                       consts["high_freq_factor"], int(consts["original_max_position_embeddings"]))
    raise ValueError(f"Megatron actor: rope_type {kind!r} ({hf_config.model_type}) is not supported; "
                     f"supported: {list(SUPPORTED_ROPE)}")


# ---------------------------------------------------------------------------- name layouts
LAYOUTS = ("local", "te")
EXPERT_LAYOUTS = ("sequential", "grouped")


@dataclass(frozen=True)
class NameLayout:
    """Which megatron parameter names a build has: the layer spec's (local / te) and, for MoE,
    the experts module's (sequential / grouped)."""

    spec: str = "local"
    experts: str = "sequential"

    def __post_init__(self):
        if self.spec not in LAYOUTS:
            raise ValueError(f"layer spec layout {self.spec!r}: choose one of {LAYOUTS}")
        if self.experts not in EXPERT_LAYOUTS:
            raise ValueError(f"expert layout {self.experts!r}: choose one of {EXPERT_LAYOUTS}")
        if self.experts == "grouped" and self.spec != "te":
            raise ValueError("grouped experts (TEGroupedMLP) need the TE layer spec; the local spec's grouped "
                             "experts are megatron's legacy GroupedMLP, which Gyre does not build")

    @classmethod
    def of(cls, hf_config=None, *, te: bool | None = None) -> "NameLayout":
        """The layout megatron builds here: TE spec (and TE grouped experts) where Transformer
        Engine is installed, else local; `te` overrides (tests simulate the TE layout)."""
        if te is None:
            te = has_transformer_engine()
        return cls("te", "grouped") if te else cls("local", "sequential")

    @property
    def moe_grouped_gemm(self) -> bool:
        return self.experts == "grouped"

    def input_norm(self) -> str:
        return "self_attention.linear_qkv.layer_norm_weight" if self.spec == "te" else "input_layernorm.weight"

    def pre_mlp_norm(self, moe: bool) -> str:
        return "mlp.linear_fc1.layer_norm_weight" if self.spec == "te" and not moe else "pre_mlp_layernorm.weight"

    def expert(self, j: int, fc: str) -> str:
        """Name of expert j's fc ('linear_fc1' / 'linear_fc2') weight."""
        if self.experts == "grouped":
            return f"mlp.experts.{fc}.weight{j}"
        return f"mlp.experts.local_experts.{j}.{fc}.weight"


@functools.lru_cache(maxsize=1)
def has_transformer_engine() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


_EXPERT_RE = re.compile(r"^(?P<pre>.*mlp\.experts\.)(?:local_experts\.(?P<j1>\d+)\.(?P<fc1>linear_fc[12])\.weight"
                        r"|(?P<fc2>linear_fc[12])\.weight(?P<j2>\d+))$")


def expert_index(name: str) -> tuple[int, str, Callable[[int], str]] | None:
    """(expert index, 'linear_fc1'/'linear_fc2', renamer to another index) of an expert weight's
    megatron name, else None."""
    m = _EXPERT_RE.match(name)
    if m is None:
        return None
    pre = m["pre"]
    if m["j1"] is not None:
        fc = m["fc1"]
        return int(m["j1"]), fc, lambda j: f"{pre}local_experts.{j}.{fc}.weight"
    fc = m["fc2"]
    return int(m["j2"]), fc, lambda j: f"{pre}{fc}.weight{j}"


# ---------------------------------------------------------------------------- HF → megatron
def _hf_expert(sd: Mapping[str, torch.Tensor], p: str, e: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(fc1 = [gate; up], fc2 = down) of HF expert e under layer prefix p: the hub layout
    (`mlp.experts.{e}.gate_proj.weight`, ...) or transformers 5's in-memory fused one
    (`mlp.experts.gate_up_proj` [E, 2I, H] with rows [gate; up], `mlp.experts.down_proj` [E, H, I];
    transformers' Qwen3MoeExperts.forward chunks gate first)."""
    if p + "mlp.experts.gate_up_proj" in sd:
        return sd[p + "mlp.experts.gate_up_proj"][e], sd[p + "mlp.experts.down_proj"][e]
    q = f"{p}mlp.experts.{e}."
    return torch.cat([sd[q + "gate_proj.weight"], sd[q + "up_proj.weight"]], dim=0), sd[q + "down_proj.weight"]


class _Reads(Mapping[str, torch.Tensor]):
    """A Mapping that remembers which keys were read (so nothing given is silently dropped)."""

    def __init__(self, inner: Mapping[str, torch.Tensor]):
        self.inner, self.read = inner, set()

    def __getitem__(self, name):
        self.read.add(name)
        return self.inner[name]

    def __contains__(self, name) -> bool:
        return name in self.inner

    def __iter__(self):
        return iter(self.inner)

    def __len__(self) -> int:
        return len(self.inner)


# HF tensors no megatron parameter holds: RoPE tables some older checkpoints saved, and the head
# of a tied model (the embedding itself)
_NOT_WEIGHTS = re.compile(r"(rotary_emb\.inv_freq|^lm_head\.weight)$")


def _hf_expert_sources(sd: Mapping[str, torch.Tensor], p: str, e: int) -> list[str]:
    """The HF names `_hf_expert` reads for expert e."""
    if p + "mlp.experts.gate_up_proj" in sd:
        return [p + "mlp.experts.gate_up_proj", p + "mlp.experts.down_proj"]
    return [f"{p}mlp.experts.{e}.{w}_proj.weight" for w in ("gate", "up", "down")]


def iter_hf_to_mcore(sd: Mapping[str, torch.Tensor], hf_config, names: NameLayout | None = None, *,
                     strict: bool = True, keep: Callable[[str], bool] | None = None,
                     ) -> Iterator[tuple[str, torch.Tensor]]:
    """Full megatron tensors one at a time from an HF state dict (a dict, or a lazy Mapping such
    as `LazyCheckpoint`: only the HF tensors of the current megatron tensor are read). strict: at
    the end, an HF tensor the mapping did not read (a weight of a variant this family's mapping
    does not know) raises, naming it. keep(megatron name) False: an expert this rank does not
    hold is skipped without reading its HF tensors (EP: a rank reads only its own experts).

    linear_qkv rows are grouped per query group g: [q heads of g; k_g; v_g] (megatron's
    interleaved GQA layout), linear_fc1 = [gate; up]."""
    reads = _Reads(sd)
    yield from _iter_hf_to_mcore(reads, hf_config, names, keep)
    if strict:
        unread = sorted(k for k in sd if k not in reads.read and not _NOT_WEIGHTS.search(k))
        if unread:
            raise ValueError(f"{hf_config.model_type}: {len(unread)} HF tensors have no megatron parameter, e.g. "
                             f"{unread[:3]} (a variant of the family the mapping does not support)")


def _iter_hf_to_mcore(sd: _Reads, hf_config, names: NameLayout | None, keep: Callable[[str], bool] | None,
                      ) -> Iterator[tuple[str, torch.Tensor]]:
    fam = family_of(hf_config)
    names = names or NameLayout.of()  # what megatron builds here (TE where installed)
    h = hf_config.hidden_size
    nh, nkv = hf_config.num_attention_heads, hf_config.num_key_value_heads
    hd, per = head_dim(hf_config), nh // nkv
    yield "embedding.word_embeddings.weight", sd["model.embed_tokens.weight"]
    for i, moe in enumerate(moe_layers(hf_config)):
        p, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        q = sd[p + "self_attn.q_proj.weight"].view(nkv, per * hd, h)
        k = sd[p + "self_attn.k_proj.weight"].view(nkv, hd, h)
        v = sd[p + "self_attn.v_proj.weight"].view(nkv, hd, h)
        yield m + "self_attention.linear_qkv.weight", torch.cat([q, k, v], dim=1).reshape(-1, h)
        if fam.qkv_bias:
            qb = sd[p + "self_attn.q_proj.bias"].view(nkv, per * hd)
            kb = sd[p + "self_attn.k_proj.bias"].view(nkv, hd)
            vb = sd[p + "self_attn.v_proj.bias"].view(nkv, hd)
            yield m + "self_attention.linear_qkv.bias", torch.cat([qb, kb, vb], dim=1).reshape(-1)
        yield m + "self_attention.linear_proj.weight", sd[p + "self_attn.o_proj.weight"]
        if fam.qk_norm:
            yield m + "self_attention.q_layernorm.weight", sd[p + "self_attn.q_norm.weight"]
            yield m + "self_attention.k_layernorm.weight", sd[p + "self_attn.k_norm.weight"]
        yield m + names.input_norm(), sd[p + "input_layernorm.weight"]
        yield m + names.pre_mlp_norm(moe), sd[p + "post_attention_layernorm.weight"]
        if moe:
            yield m + "mlp.router.weight", sd[p + "mlp.gate.weight"]
            for e in range(hf_config.num_experts):
                n1, n2 = m + names.expert(e, "linear_fc1"), m + names.expert(e, "linear_fc2")
                if keep is not None and not keep(n1) and not keep(n2):  # another EP rank's: not even read
                    sd.read.update(_hf_expert_sources(sd, p, e))
                    continue
                fc1, fc2 = _hf_expert(sd, p, e)
                yield n1, fc1
                yield n2, fc2
        else:
            yield m + "mlp.linear_fc1.weight", torch.cat([sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"]], dim=0)
            yield m + "mlp.linear_fc2.weight", sd[p + "mlp.down_proj.weight"]
    yield "decoder.final_layernorm.weight", sd["model.norm.weight"]
    if not hf_config.tie_word_embeddings:
        yield "output_layer.weight", sd["lm_head.weight"]


def hf_to_mcore(sd: Mapping[str, torch.Tensor], hf_config, names: NameLayout | None = None) -> dict[str, torch.Tensor]:
    """Full (unsharded) megatron GPTModel state dict from an HF state dict."""
    return dict(iter_hf_to_mcore(sd, hf_config, names))


# ---------------------------------------------------------------------------- megatron → HF
def mcore_to_hf(sd: Mapping[str, torch.Tensor], hf_config, names: NameLayout | None = None, *,
                fused_experts: bool = True) -> dict[str, torch.Tensor]:
    """Inverse of `hf_to_mcore` (full tensors). MoE experts come out in transformers 5's
    in-memory layout (`mlp.experts.gate_up_proj` [E, 2I, H], `down_proj` [E, H, I]: what
    `model.state_dict()` and `load_state_dict` use) or, with fused_experts=False, in the hub
    layout (`mlp.experts.{e}.gate_proj.weight`, ...: what checkpoints on disk and SGLang hold).
    `lm_head.weight` is always given (the embedding when tied)."""
    fam = family_of(hf_config)
    names = names or NameLayout.of()  # what megatron builds here (TE where installed)
    h = hf_config.hidden_size
    nh, nkv = hf_config.num_attention_heads, hf_config.num_key_value_heads
    hd, per = head_dim(hf_config), nh // nkv
    out = {"model.embed_tokens.weight": sd["embedding.word_embeddings.weight"]}
    for i, moe in enumerate(moe_layers(hf_config)):
        p, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        qkv = sd[m + "self_attention.linear_qkv.weight"].view(nkv, (per + 2) * hd, h)
        out[p + "self_attn.q_proj.weight"] = qkv[:, : per * hd].reshape(-1, h)
        out[p + "self_attn.k_proj.weight"] = qkv[:, per * hd : (per + 1) * hd].reshape(-1, h)
        out[p + "self_attn.v_proj.weight"] = qkv[:, (per + 1) * hd :].reshape(-1, h)
        if fam.qkv_bias:
            b = sd[m + "self_attention.linear_qkv.bias"].view(nkv, (per + 2) * hd)
            out[p + "self_attn.q_proj.bias"] = b[:, : per * hd].reshape(-1)
            out[p + "self_attn.k_proj.bias"] = b[:, per * hd : (per + 1) * hd].reshape(-1)
            out[p + "self_attn.v_proj.bias"] = b[:, (per + 1) * hd :].reshape(-1)
        out[p + "self_attn.o_proj.weight"] = sd[m + "self_attention.linear_proj.weight"]
        if fam.qk_norm:
            out[p + "self_attn.q_norm.weight"] = sd[m + "self_attention.q_layernorm.weight"]
            out[p + "self_attn.k_norm.weight"] = sd[m + "self_attention.k_layernorm.weight"]
        out[p + "input_layernorm.weight"] = sd[m + names.input_norm()]
        out[p + "post_attention_layernorm.weight"] = sd[m + names.pre_mlp_norm(moe)]
        if moe:
            out[p + "mlp.gate.weight"] = sd[m + "mlp.router.weight"]
            fc1 = [sd[m + names.expert(e, "linear_fc1")] for e in range(hf_config.num_experts)]
            fc2 = [sd[m + names.expert(e, "linear_fc2")] for e in range(hf_config.num_experts)]
            if fused_experts:
                out[p + "mlp.experts.gate_up_proj"] = torch.stack(fc1)
                out[p + "mlp.experts.down_proj"] = torch.stack(fc2)
            else:
                for e, (a, b) in enumerate(zip(fc1, fc2)):
                    inter = a.shape[0] // 2
                    out[f"{p}mlp.experts.{e}.gate_proj.weight"] = a[:inter]
                    out[f"{p}mlp.experts.{e}.up_proj.weight"] = a[inter:]
                    out[f"{p}mlp.experts.{e}.down_proj.weight"] = b
        else:
            fc1 = sd[m + "mlp.linear_fc1.weight"]
            f = fc1.shape[0] // 2
            out[p + "mlp.gate_proj.weight"], out[p + "mlp.up_proj.weight"] = fc1[:f], fc1[f:]
            out[p + "mlp.down_proj.weight"] = sd[m + "mlp.linear_fc2.weight"]
    out["model.norm.weight"] = sd["decoder.final_layernorm.weight"]
    out["lm_head.weight"] = sd.get("output_layer.weight", sd["embedding.word_embeddings.weight"])
    return out


# ---------------------------------------------------------------------------- TP / EP sharding
# column-parallel (rows split): qkv weight and bias, the vocab-parallel embedding and output layer;
# fc1 ([gate; up], gate and up split separately: each rank's slice is [gate_r; up_r], which its
# SwiGLU chunks in two); row-parallel (columns split): linear_proj, fc2. Everything else (norms,
# the fused TE norm weights, q/k norms, the router) is replicated over TP.
_ROWS = ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias", "word_embeddings.weight",
         "output_layer.weight")
_COLS = ("linear_proj.weight", "linear_fc2.weight")


def _kind(name: str) -> str:
    base = name
    e = expert_index(name)
    if e is not None:
        return "fc1" if e[1] == "linear_fc1" else "cols"
    if base.endswith(_ROWS):
        return "rows"
    if base.endswith("linear_fc1.weight"):
        return "fc1"
    if base.endswith(_COLS):
        return "cols"
    return "replicated"


def shard_tensor(name: str, t: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """TP rank `rank`'s slice of full megatron tensor `name` (a view where possible)."""
    if size == 1:
        return t
    kind = _kind(name)
    if kind == "rows":
        return t.chunk(size, dim=0)[rank]
    if kind == "fc1":
        gate, up = t.chunk(2, dim=0)
        return torch.cat([gate.chunk(size, dim=0)[rank], up.chunk(size, dim=0)[rank]], dim=0)
    if kind == "cols":
        return t.chunk(size, dim=1)[rank]
    return t


def shard_experts(name: str, ep_rank: int, ep: int, total: int) -> str | None:
    """This EP rank's local name of a full (globally numbered) megatron name, None when the name
    is another EP rank's expert. EP rank r holds experts [r·E/EP, (r+1)·E/EP) as local 0..E/EP-1
    (megatron's `local_expert_indices_offset = ep_rank * num_local_experts`, experts.py:942)."""
    e = expert_index(name)
    if e is None or ep == 1:
        return name
    j, _, rename = e
    local = total // ep
    return rename(j - ep_rank * local) if ep_rank * local <= j < (ep_rank + 1) * local else None


def shard(sd: Mapping[str, torch.Tensor], *, tp_rank: int = 0, tp: int = 1, ep_rank: int = 0, ep: int = 1,
          num_experts: int = 0) -> dict[str, torch.Tensor]:
    """This (TP rank, EP rank)'s slice of a full megatron state dict."""
    out = {}
    for name, t in sd.items():
        local = shard_experts(name, ep_rank, ep, num_experts)
        if local is not None:
            out[local] = shard_tensor(name, t, tp_rank, tp)
    return out


def shard_for_tp(sd: Mapping[str, torch.Tensor], rank: int, size: int) -> dict[str, torch.Tensor]:
    """This TP rank's slice of a full megatron state dict (EP 1)."""
    return shard(sd, tp_rank=rank, tp=size)


def unshard_tp(shards: list[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Full megatron state dict from every TP rank's slice (inverse of `shard_for_tp`)."""
    size = len(shards)
    if size == 1:
        return dict(shards[0])
    out = {}
    for name, t in shards[0].items():
        parts = [s[name] for s in shards]
        kind = _kind(name)
        if kind == "rows":
            out[name] = torch.cat(parts, dim=0)
        elif kind == "fc1":
            halves = [p.chunk(2, dim=0) for p in parts]
            out[name] = torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
        elif kind == "cols":
            out[name] = torch.cat(parts, dim=1)
        else:
            out[name] = t
    return out


def unshard_ep(shards: list[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Full (globally numbered) state dict from every EP rank's dict (each already TP-unsharded):
    EP rank r's local expert j is global r·E_local + j; the rest is replicated (rank 0's)."""
    out = {}
    for r, sd in enumerate(shards):
        counts: dict[str, int] = {}
        for name in sd:
            e = expert_index(name)
            if e is not None:
                key = e[2](0)
                counts[key] = max(counts.get(key, 0), e[0] + 1)
        for name, t in sd.items():
            e = expert_index(name)
            if e is None:
                if r == 0:
                    out[name] = t
            else:
                out[e[2](r * counts[e[2](0)] + e[0])] = t
    return out


# ---------------------------------------------------------------------------- shapes from the config
def hf_shapes(hf_config) -> dict[str, tuple[int, ...]]:
    """Every HF tensor's shape (hub layout for experts), from the config alone: the model is built
    on the meta device (no memory, no init)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def mcore_shapes(hf_config, names: NameLayout | None = None, *, tp_rank: int = 0, tp: int = 1, ep_rank: int = 0,
                 ep: int = 1) -> dict[str, tuple[int, ...]]:
    """This rank's megatron tensor shapes, from the config alone (the mapping run on meta tensors)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    sd = model.state_dict()
    if "lm_head.weight" not in sd:
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    full = hf_to_mcore(sd, hf_config, names)
    return {k: tuple(v.shape) for k, v in shard(full, tp_rank=tp_rank, tp=tp, ep_rank=ep_rank, ep=ep,
                                                  num_experts=num_experts(hf_config)).items()}


# ---------------------------------------------------------------------------- layouts refused up front
def check_layout(hf_config, *, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1, te: bool | None = None,
                 vocab_size: int | None = None, training: bool = True) -> None:
    """Refuse a Megatron layout that cannot run for this model, before any rank builds anything
    (ValueError naming the flag and the sizes). training=False: only what import, export and an
    eval-mode forward need (MoE with TP > 1 is then allowed)."""
    fam = family_of(hf_config)
    rope_settings(hf_config)  # an unsupported RoPE is refused here too
    te = has_transformer_engine() if te is None else te
    heads, kv = hf_config.num_attention_heads, hf_config.num_key_value_heads
    if cp != 1:
        raise ValueError(f"--parallel.cp {cp}: the Megatron actor does not support context parallelism yet "
                         f"(it needs CP-split micro-steps); use --parallel.cp 1")
    if pp > 1 and not te:
        raise ValueError(f"--parallel.pp {pp}: pipeline parallelism needs Transformer Engine (packed 'thd' "
                         f"attention); it is not installed here")
    if heads % tp or kv % tp:
        raise ValueError(f"--parallel.tp {tp} must divide the attention heads ({heads}) and KV heads ({kv}) "
                         f"of this {fam.model_type} model")
    if hf_config.num_hidden_layers % pp:
        raise ValueError(f"--parallel.pp {pp} must divide the {hf_config.num_hidden_layers} layers")
    if vocab_size is not None and vocab_size % tp:
        raise ValueError(f"--parallel.tp {tp} must divide the vocabulary ({vocab_size} rows): megatron's "
                         f"vocab-parallel embedding splits it evenly")
    if ep > 1:
        if not fam.moe:
            raise ValueError(f"--parallel.ep {ep}: expert parallelism needs an MoE model; this {fam.model_type} "
                             f"model is dense; use --parallel.ep 1")
        e = num_experts(hf_config)
        if e % ep:
            raise ValueError(f"--parallel.ep {ep} must divide the {e} experts")
    if fam.moe and tp > 1 and training:
        # megatron-core 0.16.1 moe_layer.py:379 raises in training for MoE + TP without sequence
        # parallelism, which the actor's micro-steps (unpadded packs) do not use yet
        raise ValueError(f"--parallel.tp {tp} with an MoE model: megatron-core trains MoE with TP only under "
                         f"sequence parallelism, which the Megatron actor does not build yet; split the "
                         f"experts with --parallel.ep instead (TP 1)")
    if fam.moe:
        inter = hf_config.moe_intermediate_size
        if inter % tp:
            raise ValueError(f"--parallel.tp {tp} must divide moe_intermediate_size {inter}")
    if hf_config.intermediate_size % tp:
        raise ValueError(f"--parallel.tp {tp} must divide intermediate_size {hf_config.intermediate_size}")


# ---------------------------------------------------------------------------- lazy checkpoints
class LazyCheckpoint(Mapping[str, torch.Tensor]):
    """An HF checkpoint directory's tensors as a read-only Mapping that reads one tensor per
    lookup (safetensors `safe_open`, sharded `model.safetensors.index.json` or a single file):
    `iter_hf_to_mcore(LazyCheckpoint(dir), ...)` holds about one megatron tensor at a time."""

    def __init__(self, path: str, *, dtype: torch.dtype | None = None):
        import json
        import os

        self.path, self.dtype = path, dtype
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index) as f:
                self._where = {k: os.path.join(path, v) for k, v in json.load(f)["weight_map"].items()}
        else:
            single = os.path.join(path, "model.safetensors")
            if not os.path.exists(single):
                raise FileNotFoundError(f"{path}: neither model.safetensors.index.json nor model.safetensors")
            from safetensors import safe_open

            with safe_open(single, "pt") as f:
                self._where = {k: single for k in f.keys()}

    def __getitem__(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        if name not in self._where:
            raise KeyError(f"{name} (not in the checkpoint at {self.path})")
        with safe_open(self._where[name], "pt") as f:
            t = f.get_tensor(name)
        return t if self.dtype is None else t.to(self.dtype)

    def __contains__(self, name) -> bool:
        return name in self._where

    def __iter__(self):
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)
