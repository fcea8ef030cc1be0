"""Materialize a training step into packed micro-steps (docs/design.md §5 packing, §6).

Input: the step's executions, each with its prefix tree, its selection and its advantage A_i.
Output: `MicroStep`s of at most `max_tokens` tokens. Every selected trajectory becomes one whole
sequence (the path cut after its last claimed target); on it, position t is a training target
iff token t+1 is a target claimed by *this* trajectory, and then

    token_weight[t] = −A_i / (|E| · L_i)        (docs/design.md §6, before ω_t and m_i)

so the weights of execution i sum to −A_i/|E| over the step however it is packed.

Packing: first-fit decreasing. An execution whose sequences fit in `max_tokens` together is
placed whole into one micro-step (so s_i can be computed locally); a larger one is split by
sequence and flagged in `MicroStep.exec_split` (its s_i needs the pre-pass). A single sequence
longer than `max_tokens` is an error (`TrajectoryTooLongError`) unless context parallelism is
configured: with `context_parallel_size` = cp a micro-step may hold cp·max_tokens tokens, each
sequence padded to a multiple of 2·cp, and `cp_shard_index` gives each CP rank its
load-balanced share of the positions.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from gyre.trajectory.microstep import MicroStep
from gyre.trajectory.selection import Selection, Trajectory
from gyre.trajectory.tree import PrefixTree

logger = logging.getLogger(__name__)

__all__ = ["ExecutionSample", "TrajectoryTooLongError", "cp_shard_index", "pack_step", "padded_length", "plan_bins"]


class TrajectoryTooLongError(ValueError):
    """A trajectory does not fit in one micro-step."""


@dataclass
class ExecutionSample:
    """One execution of a step, ready to pack."""

    execution_id: str
    tree: PrefixTree
    selection: Selection
    advantage: float  # A_i

    @property
    def num_targets(self) -> int:
        return self.selection.num_targets


def plan_bins(lengths: Sequence[Sequence[int]], max_tokens: int) -> tuple[list[list[tuple[int, int]]], list[bool]]:
    """Assign sequences to micro-steps. lengths[i][j] = tokens of sequence j of execution i.

    Returns (bins, split): bins[b] = [(i, j), ...] in placement order, split[i] = True where
    execution i's sequences landed in more than one bin. Pure and deterministic.
    """
    bins: list[list[tuple[int, int]]] = []
    room: list[int] = []

    def place(items: list[tuple[int, int]], size: int) -> int:
        for b, r in enumerate(room):
            if r >= size:
                bins[b].extend(items)
                room[b] -= size
                return b
        bins.append(list(items))
        room.append(max_tokens - size)
        return len(bins) - 1

    totals = [sum(ls) for ls in lengths]
    split = [False] * len(lengths)
    for i in sorted(range(len(lengths)), key=lambda i: (-totals[i], i)):
        if not lengths[i]:
            continue
        if totals[i] <= max_tokens:
            place([(i, j) for j in range(len(lengths[i]))], totals[i])
            continue
        used = set()
        for j in sorted(range(len(lengths[i])), key=lambda j: (-lengths[i][j], j)):
            used.add(place([(i, j)], lengths[i][j]))
        split[i] = len(used) > 1
    return bins, split


def _write_sequence(tree: PrefixTree, traj: Trajectory, out: dict[str, np.ndarray], start: int, e: int, weight: float) -> int:
    """Write one trajectory into the micro-step arrays at [start, start + seq_len)."""
    n = traj.seq_len
    end = start + n
    out["input_ids"][start:end] = tree.path_array(traj.segments, tree.tokens)[:n]
    out["position_ids"][start:end] = np.arange(n)
    ids = out["input_ids"]
    out["targets"][start : end - 1] = ids[start + 1 : end]
    # Token-level claim mask over the path: targets in this trajectory's own segments only.
    # mask_tok[p] says token p is trained; it is predicted at position p - 1.
    own_start = int(tree.seg_depth[traj.segments[traj.first_own]])
    for s in traj.own_segments:
        d = int(tree.seg_depth[s])
        if d >= n:
            break
        off, ln = int(tree.seg_offset[s]), min(int(tree.seg_len[s]), n - d)
        if d == 0:  # the token at depth 0 is never a target (inputs are non-empty)
            off, ln, d = off + 1, ln - 1, 1
        tgt = tree.is_target[off : off + ln]
        # token p = d + k is predicted at packed index start + p - 1
        lo = start + d - 1
        out["target_mask"][lo : lo + ln] = tgt
        out["behavior_logprobs"][lo : lo + ln] = np.where(tgt, tree.logprob[off : off + ln], 0.0)
    sl = slice(start + own_start - 1 if own_start > 0 else start, end)
    m = out["target_mask"][sl]
    out["exec_index"][sl][m] = e
    out["token_weight"][sl][m] = weight
    return end


def padded_length(n: int, context_parallel_size: int) -> int:
    """Sequence length after padding for context parallelism: a multiple of 2·cp (cp > 1)."""
    if context_parallel_size <= 1:
        return n
    q = 2 * context_parallel_size
    return -(-n // q) * q


def pack_step(
    samples: Sequence[ExecutionSample],
    max_tokens: int,
    *,
    num_executions: int | None = None,
    step: int = 0,
    context_parallel_size: int = 1,
    pad_token_id: int = 0,
) -> list[MicroStep]:
    """Pack the step's executions into micro-steps; see the module docstring.

    The execution table (advantages [E], exec_lengths [E]) follows the order of `samples`;
    |E| = `num_executions` (default len(samples)) is the loss denominator from the caller.
    Executions with no selected trajectory (L_i = 0) stay in the table and get no tokens.

    `max_tokens` is the token budget of one rank. With `context_parallel_size` = cp > 1 a
    micro-step holds up to cp·max_tokens tokens, to be sharded over the cp ranks of a cell with
    `cp_shard_index`; each sequence is padded at its end to a multiple of 2·cp (pad tokens are
    `pad_token_id`, never targets, positions continue), so a trajectory may be up to
    cp·max_tokens long.
    """
    if max_tokens < 2:
        raise ValueError(f"max_tokens must be >= 2, got {max_tokens}")
    if context_parallel_size < 1:
        raise ValueError(f"context_parallel_size must be >= 1, got {context_parallel_size}")
    cp = context_parallel_size
    capacity = max_tokens * cp
    E = len(samples)
    n_exec = E if num_executions is None else int(num_executions)
    if n_exec < 1:
        raise ValueError(f"num_executions must be >= 1, got {n_exec}")
    lengths: list[list[int]] = []
    for s in samples:
        ls = [padded_length(t.seq_len, cp) for t in s.selection.trajectories]
        for t, n in zip(s.selection.trajectories, ls):
            if n > capacity:
                hint = ("raise max_tokens or context_parallel_size" if cp > 1 else
                        "raise max_tokens or configure context-parallel splitting (context_parallel_size > 1)")
                raise TrajectoryTooLongError(
                    f"execution {s.execution_id!r}: trajectory to leaf {t.leaf} ({t.role.name}) needs {n} tokens, "
                    f"more than max_tokens={max_tokens} x context_parallel_size={cp}; {hint}"
                )
        lengths.append(ls)
    bins, split = plan_bins(lengths, capacity)
    adv = torch.tensor([float(s.advantage) for s in samples], dtype=torch.float64)
    lens = torch.tensor([s.num_targets for s in samples], dtype=torch.int64)
    weights = [(-float(s.advantage) / (n_exec * s.num_targets)) if s.num_targets else 0.0 for s in samples]
    split_t = torch.tensor(split, dtype=torch.bool)
    micro: list[MicroStep] = []
    for b, items in enumerate(bins):
        N = sum(lengths[i][j] for i, j in items)
        out = {
            "input_ids": np.full(N, pad_token_id, np.int64),
            "position_ids": np.zeros(N, np.int64),
            "targets": np.zeros(N, np.int64),
            "target_mask": np.zeros(N, np.bool_),
            "behavior_logprobs": np.zeros(N, np.float32),
            "exec_index": np.full(N, -1, np.int64),
            "token_weight": np.zeros(N, np.float64),
        }
        cu = [0]
        pos = 0
        for i, j in items:
            s = samples[i]
            end = _write_sequence(s.tree, s.selection.trajectories[j], out, pos, i, weights[i])
            padded = pos + lengths[i][j]
            out["position_ids"][end:padded] = np.arange(end - pos, padded - pos)
            pos = padded
            cu.append(pos)
        micro.append(
            MicroStep(
                **{k: torch.from_numpy(v) for k, v in out.items()},
                cu_seqlens=torch.tensor(cu, dtype=torch.int64),
                advantages=adv,
                exec_lengths=lens,
                num_executions=n_exec,
                step=step,
                index=b,
                exec_split=split_t,
            )
        )
    return micro


def cp_shard_index(cu_seqlens: torch.Tensor, context_parallel_size: int, rank: int) -> torch.Tensor:
    """Packed positions held by context-parallel rank `rank` (load-balanced "zigzag" split).

    Each sequence (length a multiple of 2·cp, as `pack_step` pads it) is cut into 2·cp equal
    chunks; rank r holds chunks r and 2·cp − 1 − r, so every rank gets the same number of
    tokens and the same causal-attention work. cu_seqlens [S+1] int64 → index [N / cp] int64.
    Example: one sequence of 8 tokens, cp = 2 → rank 0: [0 1 6 7], rank 1: [2 3 4 5].
    """
    cp = int(context_parallel_size)
    if not 0 <= rank < cp:
        raise ValueError(f"rank must be in [0, {cp}), got {rank}")
    parts = []
    cu = cu_seqlens.tolist()
    for a, b in zip(cu, cu[1:]):
        n = b - a
        if n % (2 * cp):
            raise ValueError(f"sequence [{a}, {b}) has {n} tokens, not a multiple of 2*cp={2 * cp}; pack with context_parallel_size={cp}")
        c = n // (2 * cp)
        parts.append(torch.arange(a + rank * c, a + (rank + 1) * c))
        parts.append(torch.arange(a + (2 * cp - 1 - rank) * c, a + (2 * cp - rank) * c))
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)
