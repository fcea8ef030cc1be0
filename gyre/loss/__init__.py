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
`gyre.loss.reference` runs, with one warning. Nothing is loaded at import time (the names
below import their module on first use).
Environment: GYRE_LOSS_BACKEND=auto|extension|reference (force a path; `extension` makes a
missing build an error), GYRE_HUGEPAGES=1 (CPU: madvise 2 MiB pages on fresh [T, V] gradients;
faster backward in steady state, but the first calls can stall on memory compaction).
"""

import importlib

# name -> (module, attribute): imported on first use, so `gyre.loss.config` (the `--loss.*` section,
# read by gyre.config and the launcher's preflight) does not pull torch in.
_LAZY = {"LossConfig": ("config", "LossConfig"), "extension_available": ("_ext", "load"),
         **{n: ("gspo", n) for n in ("exec_logratio_partial_sums", "gspo_loss", "gspo_loss_for_microstep")},
         **{n: ("logprobs", n) for n in ("DEFAULT_CHUNK_SIZE", "token_logprobs", "token_logprobs_from_hidden")},
         **{n: ("prepass", n) for n in ("allreduce_exec_logratio_sums", "sum_partials")}}
__all__ = sorted([*_LAZY, "reference"])


def __getattr__(name: str):
    if name == "reference":
        return importlib.import_module("gyre.loss.reference")
    if name not in _LAZY:
        raise AttributeError(f"module 'gyre.loss' has no attribute {name!r}")
    module, attr = _LAZY[name]
    return getattr(importlib.import_module(f"gyre.loss.{module}"), attr)
