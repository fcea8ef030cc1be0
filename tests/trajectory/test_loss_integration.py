"""Packed micro-steps fed to gyre.loss give the docs/design.md §6 loss computed directly from the trees in
float64, whatever max_tokens does to the packing (invariant 1), and for a fixed T_i the loss does
not depend on which selected path carries a shared target (invariant 2)."""

from __future__ import annotations

import hashlib
import math

import numpy as np
import pytest
import torch

from gyre.trajectory.packing import ExecutionSample, pack_step
from gyre.trajectory.selection import select_trajectories
from gyre.trajectory.tree import build_tree
from tests.trajectory.sim import random_execution

gyre_loss = pytest.importorskip("gyre.loss")

EPS, CAP = 0.05, 5.0


def policy_logprob(prefix: tuple[int, ...], behavior: float) -> float:
    """A fixed 'trainer' log-prob of the last token of `prefix` given the rest: behavior + noise
    that depends only on the prefix (same token, same context → same value)."""
    h = hashlib.blake2b(np.array(prefix, np.int64).tobytes(), digest_size=8).digest()
    return behavior + (int.from_bytes(h, "little") / 2**64 - 0.5) * 0.2


def direct_loss(samples, E) -> float:
    """−(1/|E|) Σ_i (m_i A_i / L_i) Σ_{t∈T_i} ω_t ℓ_t from the trees and selections, in float64."""
    total = 0.0
    for s in samples:
        tree, A = s.tree, s.advantage
        terms = []
        for t in s.selection.trajectories:
            toks = tree.path_array(t.segments, tree.tokens).tolist()
            for seg in t.own_segments:
                d, off = int(tree.seg_depth[seg]), int(tree.seg_offset[seg])
                for k in np.flatnonzero(tree.is_target[off : off + tree.seg_len[seg]]):
                    p = d + int(k)
                    b = float(tree.logprob[off + k])
                    terms.append((policy_logprob(tuple(toks[: p + 1]), b), b))
        L = len(terms)
        if L == 0:
            continue
        s_i = math.exp(math.fsum(l - b for l, b in terms) / L)
        m = 0.0 if (A > 0 and s_i > 1 + EPS) or (A < 0 and s_i < 1 - EPS) else 1.0
        total += m * A / L * math.fsum(min(math.exp(l - b), CAP) * l for l, b in terms)
    return -total / E


def packed_loss(micro, E) -> float:
    lps = []
    for m in micro:
        lp = torch.zeros(m.num_tokens, dtype=torch.float64)
        cu = m.cu_seqlens.tolist()
        for a, b in zip(cu, cu[1:]):
            toks = m.input_ids[a:b].tolist()
            for t in range(a, b):
                if m.target_mask[t]:
                    lp[t] = policy_logprob(tuple(toks[: t - a + 2]), float(m.behavior_logprobs[t]))
        lps.append(lp)
    # forward-only pre-pass: Σδ per execution over all micro-steps (docs/design.md §6)
    sums = gyre_loss.sum_partials(
        gyre_loss.exec_logratio_partial_sums(lp, m.behavior_logprobs.double(), m.target_mask, m.exec_index, E)
        for lp, m in zip(lps, micro)
    )
    total = 0.0
    for lp, m in zip(lps, micro):
        loss, _ = gyre_loss.gspo_loss_for_microstep(lp, m, exec_logratio_sum=sums, eps_low=EPS, eps_high=EPS, cap=CAP)
        total += loss.item()
    return total


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_loss_independent_of_packing_and_equal_to_direct(seed):
    rng = np.random.default_rng(seed)
    samples = []
    for i in range(3):
        tree = build_tree(random_execution(seed * 10 + i, 25, 4))
        samples.append(ExecutionSample(f"e{i}", tree, select_trajectories(tree, 4, rng), float(rng.normal())))
    E = len(samples)
    ref = direct_loss(samples, E)
    longest = max(t.seq_len for s in samples for t in s.selection.trajectories)
    for max_tokens, cp in ((longest, 1), (longest + 17, 1), (10**6, 1), (longest // 2 + 3, 2), (longest // 3 + 6, 3)):
        micro = pack_step(samples, max_tokens, context_parallel_size=cp)
        assert packed_loss(micro, E) == pytest.approx(ref, rel=1e-6, abs=1e-9)


def test_shared_target_path_choice_does_not_change_loss():
    # same tree, two selection orders: the shared prefix's targets are carried by different paths
    tree = build_tree(random_execution(7, 30, 3))
    losses = set()
    for seed in range(6):
        sel = select_trajectories(tree, None, np.random.default_rng(seed))
        micro = pack_step([ExecutionSample("e", tree, sel, 0.7)], 10**6)
        losses.add(round(packed_loss(micro, 1), 9))
    assert len(losses) == 1
