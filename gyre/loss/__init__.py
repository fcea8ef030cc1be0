"""Execution-level GSPO loss (docs/design.md §6) and fused token log-probs.

Public API (all autograd-aware where a gradient exists):
    token_logprobs(logits [T,V], targets [T]) -> [T]
    token_logprobs_from_hidden(hidden [T,H], lm_head_weight [V,H], targets [T], chunk_size) -> [T]
    gspo_loss(logprobs, behavior_logprobs, target_mask, exec_index, token_weight, advantages,
              exec_lengths, *, exec_logratio_sum=None, eps_low, eps_high, cap) -> (loss, metrics)
    gspo_loss_for_microstep(logprobs, micro_step, *, exec_logratio_sum=None, ...) -> (loss, metrics)
    exec_logratio_partial_sums(logprobs, behavior_logprobs, target_mask, exec_index, num_exec) -> [E]
    allreduce_exec_logratio_sums(partial [E], group) -> [E]      (the pre-pass reduction)
    extension_available() -> bool
    LossConfig                                                   (ε_low, ε_high, C, |E| convention)

The fused C++/CUDA ops (gyre/csrc, `gyre._C`) are used when built; otherwise the pure-torch
`gyre.loss.reference` runs, with one warning. Nothing is loaded at import time.
Environment: GYRE_LOSS_BACKEND=auto|extension|reference (force a path; `extension` makes a
missing build an error), GYRE_HUGEPAGES=1 (CPU: madvise 2 MiB pages on fresh [T, V] gradients;
faster backward in steady state, but the first calls can stall on memory compaction).
"""

from gyre.loss import reference
from gyre.loss._ext import load as extension_available
from gyre.loss.config import LossConfig
from gyre.loss.gspo import exec_logratio_partial_sums, gspo_loss, gspo_loss_for_microstep
from gyre.loss.logprobs import DEFAULT_CHUNK_SIZE, token_logprobs, token_logprobs_from_hidden
from gyre.loss.prepass import allreduce_exec_logratio_sums, sum_partials

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "LossConfig",
    "allreduce_exec_logratio_sums",
    "exec_logratio_partial_sums",
    "extension_available",
    "gspo_loss",
    "gspo_loss_for_microstep",
    "reference",
    "sum_partials",
    "token_logprobs",
    "token_logprobs_from_hidden",
]
