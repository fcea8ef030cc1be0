"""Reduce the pre-pass sums Σδ per execution over the ranks that hold parts of a step.

The one place in gyre.loss with a collective: the caller passes the process group (the prefix
group of the cells in the step, docs/design.md §3), nothing is global. The math stays in
`gyre.loss.gspo.exec_logratio_partial_sums`.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.distributed as dist

__all__ = ["sum_partials", "allreduce_exec_logratio_sums"]


def sum_partials(partials: Iterable[torch.Tensor]) -> torch.Tensor:
    """Add this rank's per-micro-step partial sums ([E] float64 each) into one [E] float64."""
    total: torch.Tensor | None = None
    for p in partials:
        total = p.double().clone() if total is None else total + p.double()
    if total is None:
        raise ValueError("sum_partials: no partial sums given")
    return total


def allreduce_exec_logratio_sums(partial: torch.Tensor, group: Any = None) -> torch.Tensor:
    """All-reduce (SUM) a [E] float64 tensor of per-execution Σδ over `group`; returns a new tensor.

    Every rank of `group` must call this with the same E (the step's execution table). Ranks
    holding no tokens of an execution contribute 0. Gloo and NCCL both reduce float64.
    """
    if partial.dim() != 1:
        raise ValueError(f"partial must be [E], got {tuple(partial.shape)}")
    out = partial.detach().to(torch.float64).clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
    return out
