"""Functional decoder forward over per-request KV caches: the compute kernel of the CPU engine.

One forward serves every family of `gyre.backends.models.arch` (Qwen2/2.5, Qwen3, Qwen3-MoE, Llama 3.x):
the family's Shape says which biases and q/k norms exist, the head dim, the RoPE frequencies
(Llama 3.1's rewrite included) and which layers use the sparse MLP (`arch.qwen3_moe.sparse_mlp`).
The transformers class of the family is the reference (the actor trains it; tests compare this
file's logits against it). Here the same weights run as plain tensor ops so that one engine step can
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

from gyre.backends.models.arch import Shape, expected_shapes as _shapes_of, family_of
from gyre.backends.models.arch.qwen3_moe import sparse_mlp


@dataclass
class DecoderWeights:
    """The tensors of a decoder, keyed like transformers' in-memory state dict, plus its Shape
    (`gyre.backends.models.arch`: biases, q/k norms, head dim, RoPE, MoE layers come from the family)."""

    tensors: dict[str, torch.Tensor]
    shape: Shape
    inv_freq: torch.Tensor  # [hd/2] float32

    @classmethod
    def from_state_dict(cls, state_dict: dict[str, torch.Tensor], config, *, dtype: torch.dtype | None = None, copy: bool = True,
                        device: torch.device | str | None = None) -> "DecoderWeights":
        """Validate names and shapes against `config` (an HF config of a family in
        `gyre.backends.models.arch.SUPPORTED`; any other is refused by name); copy unless `copy=False`.
        Names may be transformers' in-memory ones or the HF checkpoint's (per-expert MoE).
        `device`: where the weights (and so every cache and activation of `extend`) live; None
        keeps the tensors' own (a move is a copy whatever `copy` says)."""
        shape, state_dict, expected = validated(state_dict, config)
        tensors = {}
        for k, want in expected.items():
            if k not in state_dict:
                continue
            t = state_dict[k].detach()
            if dtype is not None:
                t = t.to(dtype)
            moved = device is not None and t.device != torch.device(device)
            if moved:
                t = t.to(device)
            tensors[k] = t.clone().contiguous() if copy and not moved else t.contiguous()
        where = device if device is not None else next(iter(tensors.values())).device
        return cls(tensors, shape, shape.rope.inv_freq().to(where))

    num_layers = property(lambda self: self.shape.num_layers)
    num_heads = property(lambda self: self.shape.num_heads)
    num_kv_heads = property(lambda self: self.shape.num_kv_heads)
    head_dim = property(lambda self: self.shape.head_dim)
    eps = property(lambda self: self.shape.eps)
    tied = property(lambda self: self.shape.tied)

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


def validated(state_dict: dict[str, torch.Tensor], config) -> tuple[Shape, dict[str, torch.Tensor], dict[str, tuple[int, ...]]]:
    """(Shape, state_dict under the model's names, expected shapes): names and shapes checked against
    `config`, nothing copied (metadata only), so a bad update is refused before any weight changes."""
    family = family_of(config)
    shape = family.shape(config)
    state_dict = family.to_model_names(state_dict, shape)
    expected = _shapes_of(shape)
    missing = [k for k in expected if k not in state_dict and not (k == "lm_head.weight" and shape.tied)]
    if missing:
        raise ValueError(f"weights: missing {len(missing)} tensors, e.g. {missing[:3]}")
    unknown = [k for k in state_dict if k not in expected]
    if unknown:
        raise ValueError(f"weights: unexpected tensors {unknown[:3]}")
    for k, t in state_dict.items():
        if tuple(t.shape) != expected[k]:
            raise ValueError(f"weights: {k} has shape {tuple(t.shape)}, expected {expected[k]}")
    return shape, state_dict, expected


def expected_shapes(config) -> dict[str, tuple[int, ...]]:
    """HF parameter name → shape for an HF config of a supported family (lm_head included even when tied)."""
    return _shapes_of(family_of(config).shape(config))


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
    """RMSNorm of every family here (Qwen2RMSNorm, LlamaRMSNorm): normalise in float32, scale
    in the input dtype. x [..., H] (or [..., heads, hd] for q/k norms)."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, heads, hd], cos/sin [N, 1, hd]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _dense_mlp(h: torch.Tensor, t: dict[str, torch.Tensor], p: str) -> torch.Tensor:
    """SwiGLU: down(silu(gate(h)) · up(h)), biases where the family has them (Llama mlp_bias)."""
    gate = F.linear(h, t[p + "gate_proj.weight"], t.get(p + "gate_proj.bias"))
    up = F.linear(h, t[p + "up_proj.weight"], t.get(p + "up_proj.bias"))
    return F.linear(F.silu(gate) * up, t[p + "down_proj.weight"], t.get(p + "down_proj.bias"))


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


def _attend_one(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, total: int, nkv: int, groups: int, hd: int,
                scale: float, out: torch.Tensor) -> None:
    """_attend for one query q [nh, hd] (a decode step) into out [nh, hd], bit for bit: with one
    query the folded layout [nkv, groups, hd] is a view (no permute, no copy), no mask is needed,
    and the result is written in place. A decode step runs this once per request and layer, so
    its per-op overhead is the engine's."""
    scores = torch.matmul(q.view(nkv, groups, hd), kc[:, :total].transpose(1, 2)) * scale  # [nkv, groups, L]
    probs = torch.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32)).to(out.dtype)
    torch.matmul(probs, vc[:, :total], out=out.view(nkv, groups, hd))


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
        # biases and q/k norms exist exactly where the family's Shape puts them (expected_shapes)
        q = F.linear(h, t[p + "self_attn.q_proj.weight"], t.get(p + "self_attn.q_proj.bias")).view(n, nh, hd)
        k = F.linear(h, t[p + "self_attn.k_proj.weight"], t.get(p + "self_attn.k_proj.bias")).view(n, nkv, hd)
        v = F.linear(h, t[p + "self_attn.v_proj.weight"], t.get(p + "self_attn.v_proj.bias")).view(n, nkv, hd)
        if w.shape.qk_norm:  # Qwen3: RMSNorm over each head's hd, before RoPE
            q = rms_norm(q, t[p + "self_attn.q_norm.weight"], w.eps)
            k = rms_norm(k, t[p + "self_attn.k_norm.weight"], w.eps)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        attn = torch.empty(n, nh, hd, dtype=x.dtype, device=x.device)
        for i, cache in enumerate(caches):
            a, b = starts[i], starts[i + 1]
            s_i, past = b - a, cache.length
            total = past + s_i
            kc, vc = cache.k[layer], cache.v[layer]
            kc[:, past:total] = k[a:b].transpose(0, 1)
            vc[:, past:total] = v[a:b].transpose(0, 1)
            if s_i == 1:  # a decode row: the same math as _attend, in a quarter of its ops
                _attend_one(q[a], kc, vc, total, nkv, groups, hd, scale, attn[a])
                continue
            # A long prefill runs in blocks of queries, each against the keys it can see: the
            # scores are [nkv, groups·block, keys], not [.., s², ..] (16k tokens at once: ~17 GB).
            # Up to one block (every decode step) it is the single pass it always was.
            for j0 in range(0, s_i, _QUERY_BLOCK):
                j1 = min(s_i, j0 + _QUERY_BLOCK)
                attn[a + j0 : a + j1] = _attend(q[a + j0 : a + j1], kc, vc, past + j0, nkv, groups, hd, scale, x.dtype)
        x = x + F.linear(attn.reshape(n, nh * hd), t[p + "self_attn.o_proj.weight"], t.get(p + "self_attn.o_proj.bias"))
        h = rms_norm(x, t[p + "post_attention_layernorm.weight"], w.eps)
        if layer in w.shape.moe_layers:
            x = x + sparse_mlp(h, t[p + "mlp.gate.weight"], t[p + "mlp.experts.gate_up_proj"],
                               t[p + "mlp.experts.down_proj"], w.shape.moe)
        else:
            x = x + _dense_mlp(h, t, p + "mlp.")
    for cache, s in zip(caches, seqlens):
        cache.length += s
    if not all_logits:
        x = x[torch.tensor(starts[1:], device=x.device) - 1]
    x = rms_norm(x, t["model.norm.weight"], w.eps)
    return F.linear(x, w.lm_head)
