"""What one CPU-actor rank should hold: weights + grads + AdamW states + one micro-step's activations.

`memory_accounting` is pure arithmetic on the model's shape, the yardstick the measured peak RSS is
held against (benchmarks/actor_memory.py; docs/backends.md, "The CPU actor's memory").

Activations, per token, of one decoder layer of the supported dense families (Llama / Qwen2 /
Qwen3 in transformers, SDPA attention), counted from what autograd saves for the backward
(tests/backends/actors/test_actor_memory.py checks the count against `saved_tensors_hooks`):

    8 · hidden       the layer's input; x·rsqrt and the normed input, before attention and before
                     the MLP (2 × 2); q after RoPE; the attention output; the residual after
                     attention
    2 · kv_dim       k after RoPE, v               (kv_dim = kv_heads · head_dim)
    4 · intermediate gate, up, silu(gate), silu(gate)·up
    heads + 2        the attention's log-sum-exp per head; the two RMSNorms' rsqrt

With activation checkpointing only each layer's input stays, plus one layer's full set while it
is recomputed. Outside the layers: the final norm, RoPE's cos and sin, ids and targets, the
log-prob op's log-sum-exp, and `chunk` rows of logits at a time (never the whole [T, V]).

    >>> a = memory_accounting(10, 2, hidden=4, layers=1, vocab=8, intermediate=6, heads=2, kv_heads=1, chunk=2)
    >>> a["weights_bytes"], a["optimizer_bytes"], a["activations_bytes"]
    (40, 80, 888)
"""

from __future__ import annotations

__all__ = ["layer_floats_per_token", "memory_accounting"]


def layer_floats_per_token(hidden: int, intermediate: int, heads: int, kv_heads: int) -> int:
    """Floats one decoder layer keeps per token for its backward (the table in the module doc)."""
    kv_dim = kv_heads * (hidden // heads)
    return 8 * hidden + 2 * kv_dim + 4 * intermediate + heads + 2


def memory_accounting(n_params: int, tokens: int, hidden: int, layers: int, vocab: int, *, intermediate: int,
                      heads: int, kv_heads: int, checkpointing: bool = False, chunk: int = 256,
                      param_bytes: int = 4, act_bytes: int = 4) -> dict[str, int]:
    """Bytes a rank holds training one micro-step of `tokens` tokens (float32 by default).

    weights, grads: n_params each (float32 masters and gradients); optimizer: AdamW's two moments;
    activations: the layers' (all of them, or with `checkpointing` each layer's input plus one
    layer's), the rest of the decoder's, and the chunked log-prob op's buffers. `total_bytes` is
    their sum. `act_bytes` 2 models bf16 activations."""
    for name, v in (("n_params", n_params), ("tokens", tokens), ("hidden", hidden), ("layers", layers),
                    ("vocab", vocab), ("intermediate", intermediate), ("heads", heads), ("kv_heads", kv_heads),
                    ("chunk", chunk)):
        if v <= 0:
            raise ValueError(f"memory_accounting: {name} must be positive, got {v}")
    per_layer = layer_floats_per_token(hidden, intermediate, heads, kv_heads)
    kept = layers * hidden + per_layer if checkpointing else layers * per_layer
    rest = 3 * hidden + 2 * (hidden // heads) + 7
    logprobs = (min(chunk, tokens) * vocab + vocab * hidden) * 4
    out = {
        "weights_bytes": n_params * param_bytes,
        "grads_bytes": n_params * param_bytes,
        "optimizer_bytes": 2 * n_params * 4,
        "activations_bytes": tokens * (kept + rest) * act_bytes + logprobs,
    }
    out["total_bytes"] = sum(out.values())
    return out
