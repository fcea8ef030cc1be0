"""The three invariants of docs/design.md §6, on the fused path, against docs/design.md §6 written literally.

(1) loss and gradients do not depend on how targets are cut into micro-steps or spread over
    ranks (real gloo ranks, pre-pass Σδ all-reduced over the group);
(2) for a fixed T_i, which selected path a shared target is trained on does not matter;
(3) an execution with more paths gets no more total weight than one with fewer.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

import gyre.loss as L
from gyre.loss import reference as R
from tests.distributed import run_ranks
from tests.loss.helpers import CLIP, random_step, rel, token_weight

NUM_EXEC, MAX_LEN, VOCAB, HID = 6, 12, 29, 8


def _problem(seed: int):
    p = random_step(torch.Generator().manual_seed(seed), NUM_EXEC, MAX_LEN, VOCAB, HID)
    p["token_weight"] = token_weight(p["advantages"], p["lengths"], p["exec_index"], NUM_EXEC)
    return p


def _full_reference(seed: int):
    """Whole step in one batch, float64, docs/design.md §6 literally (no token_weight, no pre-pass)."""
    p = _problem(seed)
    w = p["weight"].clone().requires_grad_()
    lp = R.token_logprobs_from_hidden(p["hidden"], w, p["targets"])
    mask = torch.ones_like(p["exec_index"], dtype=torch.bool)
    loss = R.gspo_loss_from_definition(lp, p["behavior"], mask, p["exec_index"], p["advantages"], p["lengths"], NUM_EXEC,
                                       **CLIP)
    loss.backward()
    gates = R.gspo_terms(lp.detach(), p["behavior"], mask, p["exec_index"], p["advantages"], p["lengths"], **CLIP)["gate"]
    return loss.item(), w.grad, gates


def _cuts(n: int, world: int, rank: int, micro: int, seed: int) -> list[torch.Tensor]:
    """This rank's token indices, cut at random into up to `micro` non-empty micro-steps."""
    g = torch.Generator().manual_seed(seed)
    owner = torch.randint(0, world, (n,), generator=g)
    mine = torch.nonzero(owner == rank).squeeze(-1)
    mine = mine[torch.randperm(mine.numel(), generator=g)]
    bounds = sorted(torch.randint(0, mine.numel() + 1, (micro - 1,), generator=g).tolist())
    parts = [mine[a:b] for a, b in zip([0] + bounds, bounds + [mine.numel()])]
    return [p for p in parts if p.numel()]


def _rank_train(seed: int, micro: int) -> tuple[float, torch.Tensor]:
    rank, world = dist.get_rank(), dist.get_world_size()
    p = _problem(seed)
    n = p["targets"].numel()
    steps = _cuts(n, world, rank, micro, seed + 1000)
    w = p["weight"].clone().requires_grad_()

    def batch(idx):
        return (p["behavior"][idx], torch.ones(idx.numel(), dtype=torch.bool), p["exec_index"][idx])

    # pre-pass: forward-only Σδ per execution over this rank's micro-steps, then over the group
    with torch.no_grad():
        partials = [L.exec_logratio_partial_sums(L.token_logprobs_from_hidden(p["hidden"][i], w, p["targets"][i]),
                                                 *batch(i), NUM_EXEC) for i in steps]
    local = L.sum_partials(partials) if partials else torch.zeros(NUM_EXEC, dtype=torch.float64)
    sums = L.allreduce_exec_logratio_sums(local, group=dist.group.WORLD)
    total = torch.zeros(1, dtype=torch.float64)
    for i in steps:
        lp = L.token_logprobs_from_hidden(p["hidden"][i], w, p["targets"][i], chunk_size=5)
        loss, _ = L.gspo_loss(lp, *batch(i), p["token_weight"][i], p["advantages"], p["lengths"], exec_logratio_sum=sums, **CLIP)
        loss.backward()
        total += loss.detach()
    grad = w.grad if w.grad is not None else torch.zeros_like(w)
    dist.all_reduce(grad)
    dist.all_reduce(total)
    return float(total), grad


@pytest.mark.multirank
@pytest.mark.parametrize("world,micro,seed", [
    (2, 3, 11),
    pytest.param(3, 2, 12, marks=pytest.mark.slow),
    pytest.param(4, 2, 12, marks=pytest.mark.slow),
])
def test_invariant1_any_cut_any_ranks(world, micro, seed):
    loss_ref, grad_ref, gates = _full_reference(seed)
    assert 0 < float(gates.sum()) < NUM_EXEC  # these seeds mix gated and trained executions
    for loss, grad in run_ranks(_rank_train, world, seed, micro):
        assert loss == pytest.approx(loss_ref, rel=1e-10, abs=1e-13)
        assert rel(grad, grad_ref) <= 1e-10


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 10_000), micro=st.integers(1, 6))
def test_invariant1_one_pass_whole_executions(seed, micro):
    """One-pass path: whole executions per micro-step, no pre-pass, same loss and grads."""
    loss_ref, grad_ref, _ = _full_reference(seed)
    p = _problem(seed)
    w = p["weight"].clone().requires_grad_()
    g = torch.Generator().manual_seed(seed + 7)
    group_of = torch.randint(0, micro, (NUM_EXEC,), generator=g)
    total = 0.0
    for k in range(micro):
        idx = torch.nonzero(group_of[p["exec_index"]] == k).squeeze(-1)
        if not idx.numel():
            continue
        lp = L.token_logprobs_from_hidden(p["hidden"][idx], w, p["targets"][idx], chunk_size=4)
        loss, _ = L.gspo_loss(lp, p["behavior"][idx], torch.ones(idx.numel(), dtype=torch.bool), p["exec_index"][idx],
                              p["token_weight"][idx], p["advantages"], p["lengths"], **CLIP)
        loss.backward()
        total += loss.item()
    assert total == pytest.approx(loss_ref, rel=1e-10, abs=1e-13)
    assert rel(w.grad, grad_ref) <= 1e-10


def test_split_execution_needs_the_prepass():
    """Exec with A < 0 and δ = (ln 6, −0.9, −0.9): whole, s = e^{−0.00824/3} ≥ 0.995 (trained).
    Cut as {ln 6} | {−0.9, −0.9}, the second micro-step alone has s = e^{−0.6} < 0.995 and would
    be gated, so without the pre-pass sum both paths refuse it; with it, it is trained, as in
    the whole-execution loss."""
    lp = torch.tensor([-0.5, -1.5, -2.5], dtype=torch.float64)
    b = lp - torch.tensor([math.log(6.0), -0.9, -0.9], dtype=torch.float64)
    adv, lens = torch.tensor([-0.5], dtype=torch.float64), torch.tensor([3])
    tw = torch.full((3,), 0.5 / 3, dtype=torch.float64)
    one = torch.ones(2, dtype=torch.bool)
    part = slice(1, 3)
    sums = L.exec_logratio_partial_sums(lp[:1], b[:1], one[:1], torch.zeros(1, dtype=torch.long), 1) + \
        L.exec_logratio_partial_sums(lp[part], b[part], one, torch.zeros(2, dtype=torch.long), 1)
    assert float(sums) == pytest.approx(math.log(6.0) - 1.8, rel=1e-12)
    for loss_fn in (L.gspo_loss, R.gspo_loss):  # the dispatcher (fused when built) and the reference
        with pytest.raises(ValueError, match=r"execution 0 has 2 of its L_i = 3 targets .* exec_logratio_sum"):
            loss_fn(lp[part], b[part], one, torch.zeros(2, dtype=torch.long), tw[part], adv, lens, **CLIP)
    _, pre = L.gspo_loss(lp[part], b[part], one, torch.zeros(2, dtype=torch.long), tw[part], adv, lens,
                         exec_logratio_sum=sums, **CLIP)
    assert pre["clip_frac"] == 0.0
    assert pre["ratio_mean"] == pytest.approx(math.exp((math.log(6.0) - 1.8) / 3), rel=1e-12)


# --- (2) which path a shared target is trained on ---------------------------------------------

def _context_hidden(emb: torch.Tensor, seq: list[int]) -> torch.Tensor:
    """A causal toy model: the state at position t is tanh of the running mean of embeddings of
    seq[:t+1], so it depends on the prefix only (like any causal LM)."""
    e = emb[torch.tensor(seq)]
    return torch.tanh(torch.cumsum(e, 0) / torch.arange(1, len(seq) + 1, dtype=e.dtype)[:, None])


def _tree_loss(shared_on: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    V, H = 13, 6
    emb = torch.randn(V, H, generator=g, dtype=torch.float64).requires_grad_()
    w = torch.randn(V, H, generator=g, dtype=torch.float64).requires_grad_()
    prefix = torch.randint(0, V, (5,), generator=g).tolist()
    branch = [torch.randint(0, V, (3,), generator=g).tolist(), torch.randint(0, V, (4,), generator=g).tolist()]
    other = torch.randint(0, V, (6,), generator=g).tolist()
    # behavior log-probs per *token of the tree* (TITO: one sampled token has one b, whatever path)
    b_prefix = -torch.rand(5, generator=g, dtype=torch.float64) * 3
    b_branch = [-torch.rand(3, generator=g, dtype=torch.float64) * 3, -torch.rand(4, generator=g, dtype=torch.float64) * 3]
    b_other = -torch.rand(6, generator=g, dtype=torch.float64) * 3
    seqs, hid, tgt, mask, ei, b = [], [], [], [], [], []
    for k in range(2):  # execution 0: two root-to-leaf paths sharing `prefix`
        seq = prefix + branch[k]
        n = len(seq)
        hid.append(_context_hidden(emb, seq))
        tgt += seq[1:] + [0]
        # prefix targets seq[2..4] (positions 1..3) are policy-sampled and shared: train them on one path
        m = [False] * n
        for t in range(1, 4):
            m[t] = k == shared_on
        for t in range(len(prefix) - 1, n - 1):
            m[t] = True  # this path's own branch tokens
        mask += m
        ei += [0 if x else -1 for x in m]
        bb = [0.0] * n
        for t in range(1, 4):
            bb[t] = float(b_prefix[t + 1])
        for j, t in enumerate(range(len(prefix) - 1, n - 1)):
            bb[t] = float(b_branch[k][j])
        b += bb
    hid.append(_context_hidden(emb, other))  # execution 1: one path
    tgt += other[1:] + [0]
    mask += [True] * 5 + [False]
    ei += [1] * 5 + [-1]
    b += b_other[1:].tolist() + [0.0]
    adv = torch.tensor([0.7, -0.4], dtype=torch.float64)
    lens = torch.tensor([3 + 3 + 4, 5])
    ei_t = torch.tensor(ei)
    mask_t = torch.tensor(mask)
    tw = torch.where(mask_t, token_weight(adv, lens, ei_t.clamp_min(0), 2), 0.0)
    lp = L.token_logprobs_from_hidden(torch.cat(hid), w, torch.tensor(tgt), chunk_size=4)
    loss, _ = L.gspo_loss(lp, torch.tensor(b, dtype=torch.float64), mask_t, ei_t, tw, adv, lens,
                          eps_low=0.5, eps_high=0.5, cap=5.0)
    loss.backward()
    return loss.item(), emb.grad, w.grad


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_invariant2_shared_target_path_choice(seed):
    loss_a, ge_a, gw_a = _tree_loss(0, seed)
    loss_b, ge_b, gw_b = _tree_loss(1, seed)
    assert loss_a != 0.0
    assert loss_a == pytest.approx(loss_b, rel=1e-12)
    assert rel(ge_a, ge_b) <= 1e-12 and rel(gw_a, gw_b) <= 1e-12


# --- (3) more paths, no more weight ------------------------------------------------------------

@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), paths=st.lists(st.integers(1, 9), min_size=1, max_size=6),
       one_path_len=st.integers(1, 30))
def test_invariant3_weight_independent_of_paths(seed, paths, one_path_len):
    """Exec 0: one path of `one_path_len` targets. Exec 1: len(paths) paths, each packed as its own
    sequence behind a re-sent (masked) shared context. Same |A|. With δ = 0 (ω = s = 1) each gets
    total weight Σ_t |∂loss/∂ℓ_t| = |A|/|E| exactly; with random δ it stays ≤ C·|A|/|E|."""
    g = torch.Generator().manual_seed(seed)
    ei, mask = [0] * one_path_len, [True] * one_path_len
    for k in paths:
        ei += [-1, -1] + [1] * k  # 2 positions of masked shared context, then this path's targets
        mask += [False, False] + [True] * k
    ei_t, mask_t = torch.tensor(ei), torch.tensor(mask)
    n = len(ei)
    adv = torch.tensor([0.8, 0.8], dtype=torch.float64)
    lens = torch.tensor([one_path_len, sum(paths)])
    tw = torch.where(mask_t, token_weight(adv, lens, ei_t.clamp_min(0), 2), 0.0)
    lp = (-torch.rand(n, generator=g, dtype=torch.float64) * 4).requires_grad_()
    for delta_scale in (0.0, 1.0):
        lp.grad = None
        b = lp.detach() - delta_scale * torch.randn(n, generator=g, dtype=torch.float64)
        loss, _ = L.gspo_loss(lp, b, mask_t, ei_t, tw, adv, lens, eps_low=10.0, eps_high=10.0, cap=5.0)
        loss.backward()
        per_exec = [float(lp.grad[ei_t == i].abs().sum()) for i in (0, 1)]
        if delta_scale == 0.0:
            assert per_exec == pytest.approx([0.4, 0.4], rel=1e-12)  # |A|/|E| = 0.8/2 each
        else:
            assert max(per_exec) <= 5.0 * 0.4 * (1 + 1e-12)
