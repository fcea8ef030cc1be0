"""Binding to the fused C++/CUDA ops in `gyre._C` (gyre/csrc): loading, fake kernels, autograd.

The ops live under the `gyre::` namespace (TORCH_LIBRARY in gyre/csrc/ops.cpp):

    logprobs_fwd(logits [T,V], targets [T]) -> (logprobs [T] fp32 (fp64 for fp64), lse [T] fp64)
    logprobs_bwd(grad [T], logits, targets, lse) -> grad_logits [T,V]           logits' dtype
    logprobs_hidden_fwd(hidden [T,H], weight [V,H], targets, chunk) -> (logprobs, lse)
    logprobs_hidden_bwd(grad, hidden, weight, targets, lse, chunk) -> (grad_hidden, grad_weight)
    exec_logratio_sums(logprobs, behavior, mask, exec_index, E) -> [E] fp64
    gspo_loss_fwd(logprobs, behavior, mask, exec_index, token_weight, advantages, exec_lengths,
                  exec_logratio_sum?, eps_low, eps_high, cap)
        -> (loss [] fp64, coeff [N] fp64, ratio [E] fp64, gate [E] fp64, count [E] i64, stats [3] fp64)

`coeff[t] = mask_t·m_i·ω_t·token_weight_t` is ∂loss/∂ℓ_t (m_i, ω_t are constants), so the loss
backward is one multiply. stats = (targets, ω capped, Σ|δ|).

Loading happens on first use, never at import. If `gyre._C` cannot be imported the callers fall
back to the pure-torch reference and log one warning (`GYRE_LOSS_BACKEND=reference` forces the
fallback, `=extension` makes a missing extension an error).
"""

from __future__ import annotations

import logging
import os
import threading

import torch

log = logging.getLogger(__name__)

_lock = threading.Lock()
_state: dict[str, object] = {}


def _lowp_out(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _register() -> None:
    """register_fake + register_autograd for the ops (once, after the library is loaded)."""
    lib = torch.library

    @lib.register_fake("gyre::logprobs_fwd")
    def _(logits, targets):
        t = logits.shape[0]
        dt = _lowp_out(logits.dtype)
        return logits.new_empty((t,), dtype=dt), logits.new_empty((t,), dtype=torch.float64)

    @lib.register_fake("gyre::logprobs_bwd")
    def _(grad, logits, targets, lse):
        return torch.empty_like(logits, memory_format=torch.contiguous_format)

    @lib.register_fake("gyre::logprobs_hidden_fwd")
    def _(hidden, weight, targets, chunk_size):
        t = hidden.shape[0]
        dt = _lowp_out(hidden.dtype)
        return hidden.new_empty((t,), dtype=dt), hidden.new_empty((t,), dtype=torch.float64)

    @lib.register_fake("gyre::logprobs_hidden_bwd")
    def _(grad, hidden, weight, targets, lse, chunk_size):
        return (torch.empty_like(hidden, memory_format=torch.contiguous_format),
                torch.empty_like(weight, memory_format=torch.contiguous_format))

    @lib.register_fake("gyre::exec_logratio_sums")
    def _(logprobs, behavior, target_mask, exec_index, num_exec):
        return logprobs.new_empty((num_exec,), dtype=torch.float64)

    @lib.register_fake("gyre::gspo_loss_fwd")
    def _(logprobs, behavior, target_mask, exec_index, token_weight, advantages, exec_lengths,
          exec_logratio_sum, eps_low, eps_high, cap):
        e = advantages.shape[0]
        f64 = torch.float64
        return (logprobs.new_empty((), dtype=f64), logprobs.new_empty(logprobs.shape, dtype=f64),
                logprobs.new_empty((e,), dtype=f64), logprobs.new_empty((e,), dtype=f64),
                logprobs.new_empty((e,), dtype=torch.int64), logprobs.new_empty((3,), dtype=f64))

    # --- autograd -------------------------------------------------------------------------
    def lp_setup(ctx, inputs, output):
        logits, targets = inputs
        ctx.save_for_backward(logits, targets, output[1])

    def lp_backward(ctx, grad_lp, grad_lse):
        # lse is an internal output (saved for backward, never handed out): its grad is ignored.
        logits, targets, lse = ctx.saved_tensors
        return torch.ops.gyre.logprobs_bwd(grad_lp.contiguous(), logits, targets, lse), None

    lib.register_autograd("gyre::logprobs_fwd", lp_backward, setup_context=lp_setup)

    def hid_setup(ctx, inputs, output):
        hidden, weight, targets, chunk_size = inputs
        ctx.chunk_size = chunk_size
        ctx.save_for_backward(hidden, weight, targets, output[1])

    def hid_backward(ctx, grad_lp, grad_lse):
        hidden, weight, targets, lse = ctx.saved_tensors
        gh, gw = torch.ops.gyre.logprobs_hidden_bwd(grad_lp.contiguous(), hidden, weight, targets, lse, ctx.chunk_size)
        return gh, gw, None, None

    lib.register_autograd("gyre::logprobs_hidden_fwd", hid_backward, setup_context=hid_setup)

    def loss_setup(ctx, inputs, output):
        ctx.lp_dtype = inputs[0].dtype
        ctx.save_for_backward(output[1])

    def loss_backward(ctx, grad_loss, *unused):
        (coeff,) = ctx.saved_tensors
        grad = (grad_loss.to(torch.float64) * coeff).to(ctx.lp_dtype)
        return (grad,) + (None,) * 10

    lib.register_autograd("gyre::gspo_loss_fwd", loss_backward, setup_context=loss_setup)


def load() -> bool:
    """Load gyre._C once; True when the fused ops are usable. Logs once on fallback."""
    with _lock:
        if "ok" in _state:
            return bool(_state["ok"])
        mode = os.environ.get("GYRE_LOSS_BACKEND", "auto")
        if mode not in ("auto", "extension", "reference"):
            raise ValueError(f"GYRE_LOSS_BACKEND must be auto, extension or reference, got {mode!r}")
        if mode == "reference":
            log.warning("gyre.loss: GYRE_LOSS_BACKEND=reference, using the pure-torch reference (slow, O(T*V) memory)")
            _state["ok"] = False
            return False
        try:
            import gyre._C  # noqa: F401  (registers the gyre:: ops)
        except ImportError as exc:
            if mode == "extension":
                raise RuntimeError(f"gyre.loss: GYRE_LOSS_BACKEND=extension but gyre._C failed to import: {exc}") from exc
            log.warning("gyre.loss: C++ extension gyre._C unavailable (%s); falling back to the pure-torch reference", exc)
            _state["ok"] = False
            return False
        _register()
        _state["ok"] = True
        return True


def usable_for(t: torch.Tensor) -> bool:
    """True when the fused ops are loaded and have a kernel for `t`'s device (CPU, or CUDA when
    gyre._C was built with the CUDA kernels). Logs once when a device has to fall back."""
    if not load():
        return False
    if t.device.type == "cpu" or t.device.type == "meta":
        return True
    key = {"cuda": "CUDA"}.get(t.device.type)
    ok = key is not None and torch._C._dispatch_has_kernel_for_dispatch_key("gyre::logprobs_fwd", key)
    if not ok and not _state.get(f"warned_{t.device.type}"):
        _state[f"warned_{t.device.type}"] = True
        log.warning("gyre.loss: gyre._C has no %s kernels; using the pure-torch reference there", t.device.type)
    return ok
