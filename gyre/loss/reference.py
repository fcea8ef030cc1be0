"""Pure-torch reference of the execution-level GSPO loss (docs/design.md §6) and of token log-probs.

Readable, float64-capable, the ground truth the fused extension (`gyre/csrc`) is tested against;
not fast (`token_logprobs` materializes the full [T, V] log-softmax).

Notation (docs/design.md §6): execution i, targets T_i, L_i = |T_i|, advantage A_i, |E| in the step:

    ℓ_t = log π_θ(y_t | context_t)               token_logprobs
    δ_t = ℓ_t − b_t                               b_t: behavior log-prob (TITO)
    s_i = exp((1/L_i) Σ_{t∈T_i} δ_t)              execution-level ratio
    m_i = 0 if (A_i > 0 and s_i > 1+ε_high) or (A_i < 0 and s_i < 1−ε_low) else 1
    ω_t = min(exp(stopgrad δ_t), C)
    loss = −(1/|E|) Σ_i (m_i A_i / L_i) Σ_{t∈T_i} ω_t ℓ_t

Packed (gyre/trajectory/microstep.py), −A_i/(|E|·L_i) is `token_weight[t]`: loss = Σ_t mask_t ·
m_i · ω_t · token_weight_t · ℓ_t. Example (hand values: tests/loss/test_reference.py):

    >>> lp = torch.tensor([-1.0, -2.0]); b = lp.clone()
    >>> loss, m = gspo_loss(lp, b, torch.tensor([True, True]), torch.tensor([0, 0]),
    ...                     torch.tensor([-0.25, -0.25], dtype=torch.float64),
    ...                     torch.tensor([1.0], dtype=torch.float64), torch.tensor([2]),
    ...                     eps_low=0.005, eps_high=0.005, cap=5.0)
    >>> float(loss)   # δ = 0 so s = 1, m = 1, ω = 1: Σ −0.25·ℓ_t = −0.25·(−1 − 2)
    0.75
"""

from __future__ import annotations

import torch

__all__ = [
    "token_logprobs",
    "token_logprobs_from_hidden",
    "exec_logratio_partial_sums",
    "gspo_terms",
    "gspo_loss",
    "gspo_loss_from_definition",
    "loss_metrics",
    "metrics_from_counts",
    "check_whole_executions",
]


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """ℓ_t = log_softmax(logits[t])[targets[t]].

    logits [T, V] (any float dtype; bf16/fp16 are upcast to float32), targets [T] int64 in [0, V).
    Returns [T] in float32 (float64 for float64 logits). Autograd flows to `logits`.
    """
    _check_logits_targets(logits, targets)
    x = logits if logits.dtype in (torch.float32, torch.float64) else logits.float()
    return torch.log_softmax(x, dim=-1).gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)


def token_logprobs_from_hidden(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """ℓ_t from hidden states [T, H] and the LM-head weight [V, H]: logits = hidden @ weightᵀ.

    Materializes [T, V] (that is what the chunked extension path avoids). Returns [T].
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden {tuple(hidden.shape)} and lm_head_weight {tuple(weight.shape)} must be [T, H] and [V, H]")
    return token_logprobs(hidden @ weight.t(), targets)


def exec_logratio_partial_sums(
    logprobs: torch.Tensor,
    behavior_logprobs: torch.Tensor,
    target_mask: torch.Tensor,
    exec_index: torch.Tensor,
    num_exec: int,
) -> torch.Tensor:
    """Σ_{t∈T_i, t here} δ_t per execution, float64 [E]; no gradient (the pre-pass of docs/design.md §6).

    logprobs, behavior_logprobs [N]; target_mask [N] bool; exec_index [N] int64 (−1 off-target).
    """
    check_packed(logprobs, behavior_logprobs, target_mask, exec_index, num_exec)
    delta = (logprobs.detach().double() - behavior_logprobs.double()) * target_mask
    idx = torch.where(target_mask, exec_index.long(), torch.zeros_like(exec_index, dtype=torch.long))
    return torch.zeros(num_exec, dtype=torch.float64, device=logprobs.device).index_add_(0, idx, delta)


def gspo_terms(
    logprobs: torch.Tensor,
    behavior_logprobs: torch.Tensor,
    target_mask: torch.Tensor,
    exec_index: torch.Tensor,
    advantages: torch.Tensor,
    exec_lengths: torch.Tensor,
    *,
    exec_logratio_sum: torch.Tensor | None = None,
    eps_low: float,
    eps_high: float,
    cap: float,
) -> dict[str, torch.Tensor]:
    """The intermediate quantities of docs/design.md §6, in float64, all detached.

    Returns delta [N] (0 off-target), omega [N] (0 off-target), ratio s [E], gate m [E] (float),
    count [E] (targets of each execution in this batch) and logratio_sum [E] (the Σδ used).
    When `exec_logratio_sum` is given it is the full Σ_{t∈T_i} δ_t (pre-pass) and replaces the
    local sum; otherwise every execution with targets here must have all L_i of them here
    (`check_whole_executions`).
    """
    num_exec = int(advantages.numel())
    check_packed(logprobs, behavior_logprobs, target_mask, exec_index, num_exec)
    mask = target_mask.bool()
    delta = torch.where(mask, logprobs.detach().double() - behavior_logprobs.double(), 0.0)
    idx = torch.where(mask, exec_index.long(), 0)
    count = torch.zeros(num_exec, dtype=torch.float64, device=logprobs.device).index_add_(0, idx, mask.double())
    if exec_logratio_sum is None:
        check_whole_executions(target_mask, exec_index, exec_lengths)
        sums = torch.zeros(num_exec, dtype=torch.float64, device=logprobs.device).index_add_(0, idx, delta)
    else:
        if exec_logratio_sum.shape != (num_exec,):
            raise ValueError(f"exec_logratio_sum must be [E]={num_exec}, got {tuple(exec_logratio_sum.shape)}")
        sums = exec_logratio_sum.double()
    lengths = exec_lengths.double()
    if bool(((count > 0) & (lengths <= 0)).any()):
        raise ValueError("exec_lengths: an execution with targets in this batch has L_i <= 0")
    ratio = torch.exp(sums / lengths.clamp_min(1.0))
    adv = advantages.double()
    clipped = ((adv > 0) & (ratio > 1.0 + eps_high)) | ((adv < 0) & (ratio < 1.0 - eps_low))
    gate = (~clipped).double()
    omega = torch.where(mask, torch.clamp(torch.exp(delta), max=cap), 0.0)
    return {"delta": delta, "omega": omega, "ratio": ratio, "gate": gate, "count": count, "logratio_sum": sums}


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
    """Packed GSPO loss: Σ_t mask_t · m_i · ω_t · token_weight_t · ℓ_t (float64 scalar).

    Shapes: logprobs, behavior_logprobs, target_mask, exec_index, token_weight [N]; advantages,
    exec_lengths [E]. token_weight = −A_i/(|E|·L_i) (the caller's denominators). Gradient flows to
    `logprobs` only; m_i and ω_t are constants. Returns (loss, metrics) — see `loss_metrics`.
    """
    terms = gspo_terms(
        logprobs, behavior_logprobs, target_mask, exec_index, advantages, exec_lengths,
        exec_logratio_sum=exec_logratio_sum, eps_low=eps_low, eps_high=eps_high, cap=cap,
    )
    idx = torch.where(target_mask.bool(), exec_index.long(), 0)
    coeff = terms["gate"][idx] * terms["omega"] * token_weight.double()
    loss = (coeff * logprobs.double()).sum()
    return loss, loss_metrics(terms, target_mask, cap)


def gspo_loss_from_definition(
    logprobs: torch.Tensor,
    behavior_logprobs: torch.Tensor,
    target_mask: torch.Tensor,
    exec_index: torch.Tensor,
    advantages: torch.Tensor,
    exec_lengths: torch.Tensor,
    num_executions: int,
    *,
    eps_low: float,
    eps_high: float,
    cap: float,
) -> torch.Tensor:
    """docs/design.md §6 written literally, one execution at a time (no token_weight; slow, for tests).

    loss = −(1/|E|) Σ_i (m_i A_i / L_i) Σ_{t∈T_i} ω_t ℓ_t, with s_i from the targets present, so
    the batch must hold all of each execution's targets. Returns a float64 scalar with autograd.
    """
    mask = target_mask.bool()
    total = logprobs.new_zeros((), dtype=torch.float64)
    for i in range(int(advantages.numel())):
        sel = mask & (exec_index == i)
        if not bool(sel.any()):
            continue
        lp = logprobs[sel].double()
        d = lp.detach() - behavior_logprobs[sel].double()
        length = float(exec_lengths[i])
        s = torch.exp(d.sum() / length)
        a = float(advantages[i])
        m = 0.0 if (a > 0 and s > 1 + eps_high) or (a < 0 and s < 1 - eps_low) else 1.0
        w = torch.clamp(torch.exp(d), max=cap)
        total = total + m * a / length * (w * lp).sum()
    return -total / num_executions


def loss_metrics(terms: dict[str, torch.Tensor], target_mask: torch.Tensor, cap: float) -> dict[str, float]:
    """`metrics_from_counts` for the terms of `gspo_terms` (targets counted, ω capped at C, Σ|δ|)."""
    mask = target_mask.bool()
    num_capped = float((mask & (torch.exp(terms["delta"]) > cap)).sum())
    return metrics_from_counts(terms["ratio"], terms["gate"], terms["count"], num_targets=float(mask.sum()),
                               num_omega_capped=num_capped, abs_delta_sum=float(terms["delta"].abs().sum()))


def metrics_from_counts(ratio: torch.Tensor, gate: torch.Tensor, count: torch.Tensor, *, num_targets: float,
                        num_omega_capped: float, abs_delta_sum: float) -> dict[str, float]:
    """Metrics over the executions with targets in this batch and over its target tokens; the one
    builder for the reference and the fused op (`gyre.loss.gspo`).

    ratio s_i, gate m_i, count (targets of i here) are [E]. clip_frac: fraction of executions gated
    off (m_i = 0); clip_frac_tokens: fraction of target tokens in gated executions;
    ratio_mean/min/max: s_i; omega_capped_frac: fraction of targets with exp(δ_t) > C;
    abs_delta_mean: mean |δ_t|. Raw counts (num_*) let a caller sum metrics over micro-steps and
    ranks.
    """
    ratio, gate, count = ratio.detach(), gate.detach(), count.detach()
    present = count > 0
    n_exec = int(present.sum())
    n_tok = float(num_targets)
    clipped = (gate == 0) & present
    n_clipped = float(int(clipped.sum()))
    r = ratio[present]
    return {
        "num_executions": float(n_exec),
        "num_targets": n_tok,
        "num_clipped": n_clipped,
        "num_omega_capped": float(num_omega_capped),
        "abs_delta_sum": float(abs_delta_sum),
        "clip_frac": n_clipped / n_exec if n_exec else 0.0,
        "clip_frac_tokens": float(count[clipped].sum()) / n_tok if n_tok else 0.0,
        "ratio_mean": float(r.mean()) if n_exec else 1.0,
        "ratio_min": float(r.min()) if n_exec else 1.0,
        "ratio_max": float(r.max()) if n_exec else 1.0,
        "omega_capped_frac": float(num_omega_capped) / n_tok if n_tok else 0.0,
        "abs_delta_mean": float(abs_delta_sum) / n_tok if n_tok else 0.0,
    }


def check_packed(
    logprobs: torch.Tensor,
    behavior_logprobs: torch.Tensor,
    target_mask: torch.Tensor,
    exec_index: torch.Tensor,
    num_exec: int,
) -> None:
    """Raise ValueError naming the field when packed inputs disagree in shape or index range."""
    n = logprobs.shape
    if logprobs.dim() != 1:
        raise ValueError(f"logprobs must be [N], got {tuple(n)}")
    for name, t in (("behavior_logprobs", behavior_logprobs), ("target_mask", target_mask), ("exec_index", exec_index)):
        if t.shape != n:
            raise ValueError(f"{name} must have the shape of logprobs {tuple(n)}, got {tuple(t.shape)}")
    if target_mask.dtype != torch.bool:
        raise ValueError(f"target_mask must be bool, got {target_mask.dtype}")
    if exec_index.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"exec_index must be int64, got {exec_index.dtype}")
    sel = exec_index[target_mask]
    if sel.numel() and (int(sel.min()) < 0 or int(sel.max()) >= num_exec):
        raise ValueError(f"exec_index out of range [0, {num_exec}) on a target position")


def check_whole_executions(target_mask: torch.Tensor, exec_index: torch.Tensor, exec_lengths: torch.Tensor) -> None:
    """Raise ValueError when an execution has targets here but fewer than its L_i.

    Without a pre-pass sum s_i would come from this batch's part of T_i only, a different ratio
    and possibly a different clip gate than the whole execution's (docs/design.md §6, "Split
    executions"); that is silent and wrong, so it is refused. target_mask, exec_index [N];
    exec_lengths [E]. Syncs once on CUDA.
    """
    num_exec = int(exec_lengths.numel())
    idx = exec_index[target_mask.bool()].long()
    count = torch.bincount(idx, minlength=num_exec) if idx.numel() else torch.zeros_like(exec_lengths, dtype=torch.long)
    partial = (count > 0) & (count < exec_lengths.to(count.device))
    if bool(partial.any()):
        i = int(partial.nonzero()[0, 0])
        raise ValueError(
            f"execution {i} has {int(count[i])} of its L_i = {int(exec_lengths[i])} targets in this batch and no "
            f"pre-pass sum was given ({int(partial.sum())} split execution(s) here): s_i needs Σδ over all of T_i. Sum "
            f"exec_logratio_partial_sums over every micro-step holding it (gyre.loss.prepass across ranks) and pass "
            f"exec_logratio_sum")


def _check_logits_targets(logits: torch.Tensor, targets: torch.Tensor) -> None:
    if logits.dim() != 2:
        raise ValueError(f"logits must be [T, V], got {tuple(logits.shape)}")
    if targets.shape != logits.shape[:1]:
        raise ValueError(f"targets must be [T]={logits.shape[0]}, got {tuple(targets.shape)}")
    if targets.numel() and (int(targets.min()) < 0 or int(targets.max()) >= logits.shape[1]):
        raise ValueError(f"targets out of range [0, {logits.shape[1]})")
