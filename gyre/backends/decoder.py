"""Functional Qwen2 forward over per-request KV caches: the compute kernel of the CPU engine.

`transformers.Qwen2ForCausalLM` is the reference (the actor trains it; tests compare this file's
logits against it). Here the same weights run as plain tensor ops so that one engine step can
mix requests of different lengths: the token-wise work (projections, MLP, LM head) is batched
over every request in the step, attention runs per request against that request's own cache.

Shapes: H hidden, nh query heads, nkv key/value heads, hd head dim, V vocab.

    weights = DecoderWeights.from_state_dict(model.state_dict(), model.config)
    caches = [KVCache.empty(weights, capacity=64) for _ in range(B)]
    logits = extend(weights, ids, positions, seqlens, caches)   # [B, V], last token of each
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gyre.backends.models import rope_theta

_LAYER_KEYS = (
    "self_attn.q_proj.weight",
    "self_attn.q_proj.bias",
    "self_attn.k_proj.weight",
    "self_attn.k_proj.bias",
    "self_attn.v_proj.weight",
    "self_attn.v_proj.bias",
    "self_attn.o_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
)


@dataclass
class DecoderWeights:
    """The tensors of a Qwen2 decoder, keyed like the HF state dict, plus the sizes it needs."""

    tensors: dict[str, torch.Tensor]
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float
    inv_freq: torch.Tensor  # [hd/2] float32
    tied: bool

    @classmethod
    def from_state_dict(cls, state_dict: dict[str, torch.Tensor], config, *, dtype: torch.dtype | None = None, copy: bool = True,
                        device: torch.device | str | None = None) -> "DecoderWeights":
        """Validate names and shapes against `config` (a Qwen2Config); copy unless `copy=False`.
        `device`: where the weights (and so every cache and activation of `extend`) live; None
        keeps the tensors' own (a move is a copy whatever `copy` says)."""
        layers = config.num_hidden_layers
        hd = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        expected = expected_shapes(config)
        missing = [k for k in expected if k not in state_dict and not (k == "lm_head.weight" and config.tie_word_embeddings)]
        if missing:
            raise ValueError(f"weights: missing {len(missing)} tensors, e.g. {missing[:3]}")
        unknown = [k for k in state_dict if k not in expected]
        if unknown:
            raise ValueError(f"weights: unexpected tensors {unknown[:3]}")
        tensors = {}
        for k, shape in expected.items():
            if k not in state_dict:
                continue
            t = state_dict[k].detach()
            if tuple(t.shape) != shape:
                raise ValueError(f"weights: {k} has shape {tuple(t.shape)}, expected {shape}")
            if dtype is not None:
                t = t.to(dtype)
            moved = device is not None and t.device != torch.device(device)
            if moved:
                t = t.to(device)
            tensors[k] = t.clone().contiguous() if copy and not moved else t.contiguous()
        theta = rope_theta(config)
        where = device if device is not None else next(iter(tensors.values())).device
        inv_freq = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float, device=where) / hd))
        return cls(tensors, layers, config.num_attention_heads, config.num_key_value_heads, hd,
                   float(config.rms_norm_eps), inv_freq, bool(config.tie_word_embeddings))

    @property
    def lm_head(self) -> torch.Tensor:
        return self.tensors["model.embed_tokens.weight" if self.tied else "lm_head.weight"]

    @property
    def dtype(self) -> torch.dtype:
        return self.tensors["model.embed_tokens.weight"].dtype

    @property
    def device(self) -> torch.device:
        return self.tensors["model.embed_tokens.weight"].device

    def to(self, device: torch.device | str, *, pin: bool = False) -> "DecoderWeights":
        """The same weights on `device` (host: page-locked when `pin`, for a fast copy back)."""
        def move(t: torch.Tensor) -> torch.Tensor:
            return t.to(device, non_blocking=True).pin_memory() if pin else t.to(device, non_blocking=True)

        return dataclasses.replace(self, tensors={k: move(t) for k, t in self.tensors.items()},
                                   inv_freq=self.inv_freq.to(device))

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def expected_shapes(config) -> dict[str, tuple[int, ...]]:
    """HF parameter name → shape for a Qwen2Config (lm_head included even when tied)."""
    h, v, f = config.hidden_size, config.vocab_size, config.intermediate_size
    hd = getattr(config, "head_dim", None) or h // config.num_attention_heads
    q, kv = config.num_attention_heads * hd, config.num_key_value_heads * hd
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h)}
    per = {
        "self_attn.q_proj.weight": (q, h), "self_attn.q_proj.bias": (q,),
        "self_attn.k_proj.weight": (kv, h), "self_attn.k_proj.bias": (kv,),
        "self_attn.v_proj.weight": (kv, h), "self_attn.v_proj.bias": (kv,),
        "self_attn.o_proj.weight": (h, q),
        "mlp.gate_proj.weight": (f, h), "mlp.up_proj.weight": (f, h), "mlp.down_proj.weight": (h, f),
        "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
    }
    for i in range(config.num_hidden_layers):
        for k in _LAYER_KEYS:
            out[f"model.layers.{i}.{k}"] = per[k]
    out["model.norm.weight"] = (h,)
    out["lm_head.weight"] = (v, h)
    return out


class KVCache:
    """Keys and values of one request: per layer [nkv, capacity, hd], `length` filled.

    Grows by doubling, so appending one token is amortised O(1) copies.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, capacity: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu"):
        self.k = [torch.empty(num_kv_heads, capacity, head_dim, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.empty(num_kv_heads, capacity, head_dim, dtype=dtype, device=device) for _ in range(num_layers)]
        self.length = 0

    @classmethod
    def empty(cls, w: DecoderWeights, capacity: int = 64) -> "KVCache":
        return cls(w.num_layers, w.num_kv_heads, w.head_dim, max(1, capacity), w.dtype, w.device)

    @property
    def capacity(self) -> int:
        return self.k[0].shape[1]

    def reserve(self, n: int) -> None:
        if n <= self.capacity:
            return
        cap = max(n, 2 * self.capacity)
        for store in (self.k, self.v):
            for i, t in enumerate(store):
                grown = torch.empty(t.shape[0], cap, t.shape[2], dtype=t.dtype, device=t.device)
                grown[:, : self.length] = t[:, : self.length]
                store[i] = grown

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen2RMSNorm: normalise in float32, scale in the input dtype. x [..., H]."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, heads, hd], cos/sin [N, 1, hd]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


_QUERY_BLOCK = 2048  # queries per attention pass of a long prefill (see extend)


def _attend(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, past: int, nkv: int, groups: int, hd: int,
            scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Causal attention of s new queries q [s, nh, hd] at positions past..past+s-1 against the
    cache's keys/values kc, vc [nkv, ≥ past+s, hd]. Returns [s, nh, hd]."""
    s_i = q.shape[0]
    total = past + s_i
    # GQA without copying the cache: query head h = kv·groups + g reads KV head kv, so
    # fold the groups into the query rows: [s, nh, hd] → [nkv, groups·s, hd]
    qi = q.reshape(s_i, nkv, groups, hd).permute(1, 2, 0, 3).reshape(nkv, groups * s_i, hd)
    # plain matmul attention: at these sizes torch's CPU SDPA kernel costs far more
    scores = torch.matmul(qi, kc[:, :total].transpose(1, 2)) * scale  # [nkv, groups·s, L]
    if s_i > 1:
        # query j sits at absolute position past + j and sees keys 0..past + j
        mask = torch.ones(s_i, total, dtype=torch.bool, device=q.device).tril(diagonal=past)
        scores = scores.view(nkv, groups, s_i, total).masked_fill(~mask, float("-inf")).view(nkv, groups * s_i, total)
    probs = torch.softmax(scores, dim=-1, dtype=torch.promote_types(dtype, torch.float32)).to(dtype)
    out = torch.matmul(probs, vc[:, :total])  # [nkv, groups·s, hd]
    return out.view(nkv, groups, s_i, hd).permute(2, 0, 1, 3).reshape(s_i, q.shape[1], hd)


def extend(w: DecoderWeights, ids: torch.Tensor, positions: torch.Tensor, seqlens: list[int],
           caches: list[KVCache], *, all_logits: bool = False) -> torch.Tensor:
    """Append `seqlens[i]` new tokens to request i's cache and return logits.

    ids [N], positions [N] (absolute, continuing each cache), seqlens: B ints summing to N,
    caches: B caches (filled to `positions` of each request's first new token).
    Returns logits [B, V] for the last new token of each request, or [N, V] if `all_logits`.
    Runs on the weights' device (`DecoderWeights.device`: caches, activations and logits there;
    ids / positions are moved to it).
    """
    n = int(ids.numel())
    if sum(seqlens) != n or len(seqlens) != len(caches):
        raise ValueError(f"extend: seqlens {seqlens} do not split {n} tokens over {len(caches)} caches")
    ids, positions = ids.to(w.device), positions.to(w.device)
    t = w.tensors
    nh, nkv, hd = w.num_heads, w.num_kv_heads, w.head_dim
    groups = nh // nkv
    scale = hd ** -0.5
    freqs = positions.float()[:, None] * w.inv_freq[None, :]  # [N, hd/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos = emb.cos().to(w.dtype)[:, None, :]
    sin = emb.sin().to(w.dtype)[:, None, :]
    starts = [0]
    for s in seqlens:
        starts.append(starts[-1] + s)
    for cache, s in zip(caches, seqlens):
        cache.reserve(cache.length + s)

    x = t["model.embed_tokens.weight"][ids]  # [N, H]
    for layer in range(w.num_layers):
        p = f"model.layers.{layer}."
        h = rms_norm(x, t[p + "input_layernorm.weight"], w.eps)
        q = F.linear(h, t[p + "self_attn.q_proj.weight"], t[p + "self_attn.q_proj.bias"]).view(n, nh, hd)
        k = F.linear(h, t[p + "self_attn.k_proj.weight"], t[p + "self_attn.k_proj.bias"]).view(n, nkv, hd)
        v = F.linear(h, t[p + "self_attn.v_proj.weight"], t[p + "self_attn.v_proj.bias"]).view(n, nkv, hd)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        attn = torch.empty(n, nh, hd, dtype=x.dtype, device=x.device)
        for i, cache in enumerate(caches):
            a, b = starts[i], starts[i + 1]
            s_i, past = b - a, cache.length
            total = past + s_i
            kc, vc = cache.k[layer], cache.v[layer]
            kc[:, past:total] = k[a:b].transpose(0, 1)
            vc[:, past:total] = v[a:b].transpose(0, 1)
            # A long prefill runs in blocks of queries, each against the keys it can see: the
            # scores are [nkv, groups·block, keys], not [.., s², ..] (16k tokens at once: ~17 GB).
            # Up to one block (every decode step) it is the single pass it always was.
            for j0 in range(0, s_i, _QUERY_BLOCK):
                j1 = min(s_i, j0 + _QUERY_BLOCK)
                attn[a + j0 : a + j1] = _attend(q[a + j0 : a + j1], kc, vc, past + j0, nkv, groups, hd, scale, x.dtype)
        x = x + F.linear(attn.reshape(n, nh * hd), t[p + "self_attn.o_proj.weight"])
        h = rms_norm(x, t[p + "post_attention_layernorm.weight"], w.eps)
        mlp = F.silu(F.linear(h, t[p + "mlp.gate_proj.weight"])) * F.linear(h, t[p + "mlp.up_proj.weight"])
        x = x + F.linear(mlp, t[p + "mlp.down_proj.weight"])
    for cache, s in zip(caches, seqlens):
        cache.length += s
    if not all_logits:
        x = x[torch.tensor(starts[1:], device=x.device) - 1]
    x = rms_norm(x, t["model.norm.weight"], w.eps)
    return F.linear(x, w.lm_head)
