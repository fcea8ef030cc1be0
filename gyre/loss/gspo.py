"""Execution-level GSPO loss over a packed micro-step (docs/design.md §6), fused op or reference.

    loss = Σ_t mask_t · m_i · ω_t · token_weight_t · ℓ_t,   i = exec_index[t]
    token_weight_t = −A_i/(|E|·L_i)   (computed by the packer; gyre/trajectory/microstep.py)
    s_i = exp(Σ_{t∈T_i} δ_t / L_i), m_i the clip gate, ω_t = min(exp(sg δ_t), C)

s_i needs Σδ over all of T_i at the step's parameters. Two paths:
  * one-pass: the execution sits in one micro-step → leave `exec_logratio_sum=None`, the local
    sum over this micro-step is used (an execution with fewer than L_i targets here is then a
    ValueError: its local sum is not its s_i);
  * pre-pass: the execution spans micro-steps or cells → run `exec_logratio_partial_sums` on each
    micro-step's forward-only log-probs, add them up, reduce over the cells' process group
    (`gyre.loss.prepass.allreduce_exec_logratio_sums`), and pass the result here.
Because the factor −A_i/(|E|·L_i) and ω_t are known per token and m_i is a function of the full
sum, the loss and its gradients add up exactly over any cut into micro-steps and ranks.
"""

from __future__ import annotations

from typing import Any

import torch

from gyre.loss import _ext, reference

__all__ = ["gspo_loss", "gspo_loss_for_microstep", "exec_logratio_partial_sums"]


def exec_logratio_partial_sums(
    logprobs: torch.Tensor,
    behavior_logprobs: torch.Tensor,
    target_mask: torch.Tensor,
    exec_index: torch.Tensor,
    num_exec: int,
) -> torch.Tensor:
    """Σ_{t here, t∈T_i} (ℓ_t − b_t) per execution: float64 [E], no gradient.

    logprobs, behavior_logprobs [N]; target_mask [N] bool; exec_index [N] (−1 off-target).
    Sum these over the micro-steps and ranks that hold T_i to get the full Σδ for s_i.
    """
    reference.check_packed(logprobs, behavior_logprobs, target_mask, exec_index, num_exec)
    if _ext.usable_for(logprobs):
        with torch.no_grad():
            return torch.ops.gyre.exec_logratio_sums(
                logprobs.detach().contiguous(), behavior_logprobs.contiguous(), target_mask.contiguous(),
                exec_index.long().contiguous(), int(num_exec),
            )
    return reference.exec_logratio_partial_sums(logprobs, behavior_logprobs, target_mask, exec_index, num_exec)


def gspo_loss(
    logprobs: torch.Tensor,
    behavior_logprobs: torch.Tensor,
    target_mask: torch.Tensor,
    exec_index: torch.Tensor,
    token_weight: torch.Tensor,
    advantages: torch.Tensor,
    exec_lengths: torch.Tensor,
    *,
    exec_logratio_sum: torch.Tensor | None = None,
    eps_low: float,
    eps_high: float,
    cap: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Packed GSPO loss and metrics. Returns (loss: float64 scalar with grad to `logprobs`, metrics).

    Shapes: logprobs [N] (with grad), behavior_logprobs [N], target_mask [N] bool, exec_index [N]
    int64 (−1 off-target), token_weight [N] float (−A_i/(|E|·L_i) on targets), advantages [E],
    exec_lengths [E] (L_i over the whole step), exec_logratio_sum [E] or None (see module doc;
    None with an execution split off this batch raises ValueError).
    Metrics: see `gyre.loss.reference.metrics_from_counts` (clip fraction, s_i mean/min/max, fraction
    of ω capped, mean |δ|, and raw counts for summing over micro-steps).
    """
    num_exec = int(advantages.numel())
    reference.check_packed(logprobs, behavior_logprobs, target_mask, exec_index, num_exec)
    if token_weight.shape != logprobs.shape:
        raise ValueError(f"token_weight must have the shape of logprobs {tuple(logprobs.shape)}, got {tuple(token_weight.shape)}")
    if exec_lengths.shape != advantages.shape or advantages.dim() != 1:
        raise ValueError(f"advantages {tuple(advantages.shape)} and exec_lengths {tuple(exec_lengths.shape)} must both be [E]")
    if exec_logratio_sum is not None and exec_logratio_sum.shape != (num_exec,):
        raise ValueError(f"exec_logratio_sum must be [E]={num_exec}, got {tuple(exec_logratio_sum.shape)}")
    if not (eps_low >= 0 and eps_high >= 0 and cap > 0):
        raise ValueError(f"need eps_low, eps_high >= 0 and cap > 0; got {eps_low}, {eps_high}, {cap}")
    if exec_logratio_sum is None:  # the fused kernel would silently take the local sum as all of T_i
        reference.check_whole_executions(target_mask, exec_index, exec_lengths)
    if not _ext.usable_for(logprobs):
        return reference.gspo_loss(
            logprobs, behavior_logprobs, target_mask, exec_index, token_weight, advantages, exec_lengths,
            exec_logratio_sum=exec_logratio_sum, eps_low=eps_low, eps_high=eps_high, cap=cap,
        )
    dev = logprobs.device
    loss, _coeff, ratio, gate, count, stats = torch.ops.gyre.gspo_loss_fwd(
        logprobs.contiguous(),
        behavior_logprobs.to(dev).contiguous(),
        target_mask.to(dev).contiguous(),
        exec_index.to(dev).long().contiguous(),
        token_weight.to(dev, torch.float64).contiguous(),
        advantages.to(dev, torch.float64).contiguous(),
        exec_lengths.to(dev, torch.int64).contiguous(),
        None if exec_logratio_sum is None else exec_logratio_sum.to(dev, torch.float64).contiguous(),
        float(eps_low), float(eps_high), float(cap),
    )
    num_targets, num_capped, abs_delta_sum = (float(x) for x in stats.detach().cpu())
    return loss, reference.metrics_from_counts(ratio, gate, count, num_targets=num_targets,
                                               num_omega_capped=num_capped, abs_delta_sum=abs_delta_sum)


def gspo_loss_for_microstep(
    logprobs: torch.Tensor,
    micro_step: Any,
    *,
    exec_logratio_sum: torch.Tensor | None = None,
    eps_low: float,
    eps_high: float,
    cap: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """`gspo_loss` with the packed fields of a `gyre.trajectory.microstep.MicroStep`. logprobs [N]."""
    ms = micro_step
    return gspo_loss(
        logprobs, ms.behavior_logprobs, ms.target_mask, ms.exec_index, ms.token_weight,
        ms.advantages, ms.exec_lengths, exec_logratio_sum=exec_logratio_sum,
        eps_low=eps_low, eps_high=eps_high, cap=cap,
    )
