"""The packed micro-step: what the trajectory processor hands to a training actor.

One definition shared by the packer (`gyre.trajectory.packing`), the actors and the loss.

Layout. N packed positions hold S whole sequences back to back (each a root-to-leaf trajectory
path, or a prefix of one). Position t's logits predict `targets[t]` (the next token of the same
sequence); `target_mask[t]` says whether that prediction is a training target (a policy-sampled
token claimed by this trajectory, docs/design.md §5). At the last position of each sequence
`target_mask` is False.

The loss (docs/design.md §6) per target position t of execution i = exec_index[t]:
    δ_t = ℓ_t − behavior_logprobs[t]
    loss = Σ_t m_i · ω_t · token_weight[t] · ℓ_t,   token_weight[t] = −A_i / (|E| · L_i)
so Σ over all micro-steps of a step of token_weight over execution i's targets is −A_i/|E|.
`advantages` and `exec_lengths` (L_i) are the execution table, indexed by exec_index (the step's
executions, or — when a streaming step packs group by group — the group's). `num_executions` is
the |E| folded into `token_weight`; it is at least the table's size. A streaming step packs
with the nominal B·N, and the core rescales the summed gradient to the loss's |E| before its
optimizer step (`gyre.loss.LossConfig.grad_scale`, gyre/runtime/samples.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class MicroStep:
    input_ids: torch.Tensor  # [N] int64
    position_ids: torch.Tensor  # [N] int64, restarts at 0 at each sequence start
    cu_seqlens: torch.Tensor  # [S+1] int64, sequence boundaries (packed attention)
    targets: torch.Tensor  # [N] int64, next-token id (0 where no next token)
    target_mask: torch.Tensor  # [N] bool
    behavior_logprobs: torch.Tensor  # [N] float32, 0 where not a target
    exec_index: torch.Tensor  # [N] int64, index into the step's execution table, -1 where not a target
    token_weight: torch.Tensor  # [N] float64, −A_i/(|E|·L_i) on targets, 0 elsewhere
    advantages: torch.Tensor  # [E] float64, A_i for the step's executions
    exec_lengths: torch.Tensor  # [E] int64, L_i = |T_i| over the whole step
    num_executions: int  # |E|
    step: int = 0  # optimizer step this micro-step belongs to
    index: int = 0  # position of this micro-step within the step
    # [E] bool, same on every micro-step of a step: True where execution e's targets are spread
    # over more than one micro-step, so s_e needs the forward-only pre-pass (docs/design.md §6).
    # None when the producer does not know.
    exec_split: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def num_targets(self) -> int:
        return int(self.target_mask.sum())
