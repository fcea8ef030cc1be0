"""Token log-probs ℓ_t = log π_θ(y_t | context_t): the fused op, or the reference as fallback.

    token_logprobs(logits [T, V], targets [T]) -> [T]
    token_logprobs_from_hidden(hidden [T, H], lm_head_weight [V, H], targets [T]) -> [T]

Both are autograd-aware. The fused path never materializes a [T, V] log-softmax (one online
max/sum pass per row; the backward writes g_t·(onehot − softmax) row by row); the hidden-state
path computes logits chunk by chunk, forward and backward, so its peak extra memory is
O(chunk_size · V) whatever T is. Outputs are float32 (float64 for float64 inputs); bf16 inputs
accumulate in float32.
"""

from __future__ import annotations

import torch

from gyre.loss import _ext, reference

__all__ = ["token_logprobs", "token_logprobs_from_hidden", "DEFAULT_CHUNK_SIZE"]

DEFAULT_CHUNK_SIZE = 1024


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """ℓ_t = logits[t, y_t] − logsumexp(logits[t, :]). logits [T, V], targets [T] int64 → [T].

    >>> token_logprobs(torch.zeros(2, 4), torch.tensor([0, 3]))   # uniform over 4: log(1/4)
    tensor([-1.3863, -1.3863])
    """
    _check(logits, targets, "logits")
    if _ext.usable_for(logits):
        return torch.ops.gyre.logprobs_fwd(logits.contiguous(), targets.long().contiguous())[0]
    return reference.token_logprobs(logits, targets)


def token_logprobs_from_hidden(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    targets: torch.Tensor,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> torch.Tensor:
    """ℓ_t with logits = hidden @ lm_head_weightᵀ computed `chunk_size` rows at a time.

    hidden [T, H], lm_head_weight [V, H], targets [T] int64 → [T]. Gradients flow to `hidden`
    and `lm_head_weight`; the backward recomputes each chunk's logits instead of keeping them.
    """
    if hidden.dim() != 2 or lm_head_weight.dim() != 2 or hidden.shape[1] != lm_head_weight.shape[1]:
        raise ValueError(
            f"hidden {tuple(hidden.shape)} and lm_head_weight {tuple(lm_head_weight.shape)} must be [T, H] and [V, H]"
        )
    if hidden.dtype != lm_head_weight.dtype:
        raise ValueError(f"hidden ({hidden.dtype}) and lm_head_weight ({lm_head_weight.dtype}) must share a dtype")
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    _check_targets(targets, hidden.shape[0], lm_head_weight.shape[0])
    if _ext.usable_for(hidden):
        return torch.ops.gyre.logprobs_hidden_fwd(
            hidden.contiguous(), lm_head_weight.contiguous(), targets.long().contiguous(), int(chunk_size)
        )[0]
    return _ChunkedReference.apply(hidden, lm_head_weight, targets.long(), int(chunk_size))


class _ChunkedReference(torch.autograd.Function):
    """Fallback chunked path in plain torch ops: same O(chunk · V) memory, not fused."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk_size):
        out_dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        out = hidden.new_empty(hidden.shape[0], dtype=out_dtype)
        lse = torch.empty_like(out)
        for lo in range(0, hidden.shape[0], chunk_size):
            hi = min(lo + chunk_size, hidden.shape[0])
            logits = (hidden[lo:hi] @ weight.t()).to(out_dtype)
            lse[lo:hi] = torch.logsumexp(logits, dim=-1)
            out[lo:hi] = logits.gather(-1, targets[lo:hi, None]).squeeze(-1) - lse[lo:hi]
        ctx.chunk_size = chunk_size
        ctx.save_for_backward(hidden, weight, targets, lse)
        return out

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, targets, lse = ctx.saved_tensors
        acc = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device)
        for lo in range(0, hidden.shape[0], ctx.chunk_size):
            hi = min(lo + ctx.chunk_size, hidden.shape[0])
            logits = (hidden[lo:hi] @ weight.t()).to(acc)
            # ∂ℓ_t/∂logits = onehot(y_t) − softmax(logits_t)
            g = -torch.exp(logits - lse[lo:hi, None])
            g.scatter_add_(-1, targets[lo:hi, None], torch.ones_like(g[:, :1]))
            g *= grad[lo:hi, None].to(acc)
            grad_hidden[lo:hi] = (g @ weight.to(acc)).to(hidden.dtype)
            grad_weight += g.t() @ hidden[lo:hi].to(acc)
        return grad_hidden, grad_weight.to(weight.dtype), None, None


def _check(logits: torch.Tensor, targets: torch.Tensor, name: str) -> None:
    if logits.dim() != 2:
        raise ValueError(f"{name} must be [T, V], got {tuple(logits.shape)}")
    if not logits.is_floating_point():
        raise ValueError(f"{name} must be floating point, got {logits.dtype}")
    _check_targets(targets, logits.shape[0], logits.shape[1])


def _check_targets(targets: torch.Tensor, t: int, v: int) -> None:
    if targets.shape != (t,):
        raise ValueError(f"targets must be [T]={t}, got {tuple(targets.shape)}")
    if targets.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"targets must be int64, got {targets.dtype}")
    # On CUDA this check would sync; the CUDA kernels write NaN for an out-of-range target instead.
    if targets.device.type == "cpu" and targets.numel() and (int(targets.min()) < 0 or int(targets.max()) >= v):
        raise ValueError(f"targets out of range [0, {v}): min {int(targets.min())}, max {int(targets.max())}")
