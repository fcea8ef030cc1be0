"""Hand-computed advantages, a hand-packed micro-step, and the whole materialization path from
store files. (The oldest-dispatch-version-first order of ready groups is the scheduler's heap,
tested in tests/scheduler/test_core.py.)"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from gyre.trajectory.advantages import Outcome, compute_advantages, group_advantages
from gyre.trajectory.materialize import ScoredExecution, ScoredGroup, materialize_step
from gyre.trajectory.packing import ExecutionSample, TrajectoryTooLongError, pack_step, plan_bins
from gyre.trajectory.record import CallRecord, Role
from gyre.trajectory.selection import select_trajectories
from gyre.trajectory.store import TitoStore
from gyre.trajectory.tree import build_tree


def rec(cid, inp, out, role=Role.MAIN, exec_id="e"):
    lp = [-(cid + 1) - k / 8 for k in range(len(out))]
    return CallRecord(exec_id, cid, role, np.array(inp), np.array(out), np.array(lp), 0)


# ------------------------------------------------------------------------------ advantages


def test_group_advantages_hand_values():
    g = group_advantages([Outcome.scored(1), Outcome.scored(0), Outcome.scored(0), Outcome.scored(1)])
    assert g.advantages.tolist() == [1.0, -1.0, -1.0, 1.0] and not g.all_equal
    g = group_advantages([Outcome.scored(1), Outcome.scored(0), Outcome.scored(0), Outcome.scored(1)], normalize_std=False)
    assert g.advantages.tolist() == [0.5, -0.5, -0.5, 0.5]
    # rewards 3, harness failure (0), excluded, 1 → valid [3, 0, 1]: mean 4/3, std sqrt(14/9)
    g = group_advantages([Outcome.scored(3), Outcome.harness_failed(), Outcome.eval_failed(), Outcome.scored(1)])
    std = math.sqrt(((3 - 4 / 3) ** 2 + (4 / 3) ** 2 + (1 / 3) ** 2) / 3)
    assert g.valid.tolist() == [True, True, False, True] and g.num_valid == 3
    assert np.isnan(g.advantages[2])
    assert np.allclose(g.advantages[[0, 1, 3]], [(3 - 4 / 3) / std, (-4 / 3) / std, (1 - 4 / 3) / std], rtol=1e-14)


def test_all_equal_and_empty_groups_are_reported():
    gs = compute_advantages([
        [Outcome.scored(0.5)] * 3,
        [Outcome.scored(0.0), Outcome.harness_failed()],
        [Outcome.eval_failed(), Outcome.eval_failed()],
        [Outcome.scored(2.0), Outcome.eval_failed()],
    ])
    assert [g.all_equal for g in gs] == [True, True, False, True]
    assert [g.empty for g in gs] == [False, False, True, False]
    assert gs[0].advantages.tolist() == [0.0, 0.0, 0.0]
    assert gs[3].advantages[0] == 0.0
    with pytest.raises(ValueError, match="reward"):
        Outcome.scored(float("nan"))
    with pytest.raises(ValueError, match="reward"):
        Outcome(Outcome.eval_failed().kind, 1.0)


# ------------------------------------------------------------------------------ packing


def two_leaf_tree():
    # shared prefix [1 2 | 3 4] (3 4 sampled), leaves [.. 5 | 6 7] and [.. 8 | 9]
    return build_tree([rec(0, [1, 2], [3, 4]), rec(1, [1, 2, 3, 4, 5], [6, 7]), rec(2, [1, 2, 3, 4, 8], [9], Role.SUB)])


def test_pack_step_hand_example():
    tree = two_leaf_tree()
    sel = select_trajectories(tree, None, np.random.default_rng(0))
    assert [(t.role, t.num_targets, t.seq_len) for t in sel.trajectories] == [(Role.MAIN, 4, 7), (Role.SUB, 1, 6)]
    (m,) = pack_step([ExecutionSample("e", tree, sel, 0.5)], max_tokens=16, num_executions=2, step=7)
    assert m.input_ids.tolist() == [1, 2, 3, 4, 5, 6, 7, 1, 2, 3, 4, 8, 9]
    assert m.position_ids.tolist() == [0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4, 5]
    assert m.cu_seqlens.tolist() == [0, 7, 13]
    assert m.targets.tolist() == [2, 3, 4, 5, 6, 7, 0, 2, 3, 4, 8, 9, 0]
    assert m.target_mask.tolist() == [0, 1, 1, 0, 1, 1, 0, 0, 0, 0, 0, 1, 0]
    lp = [0, -1, -1.125, 0, -2, -2.125, 0, 0, 0, 0, 0, -3, 0]
    assert m.behavior_logprobs.tolist() == lp
    assert m.exec_index.tolist() == [-1, 0, 0, -1, 0, 0, -1, -1, -1, -1, -1, 0, -1]
    w = -0.5 / (2 * 5)
    assert m.token_weight.tolist() == [0, w, w, 0, w, w, 0, 0, 0, 0, 0, w, 0]
    assert m.advantages.tolist() == [0.5] and m.exec_lengths.tolist() == [5] and m.num_executions == 2
    assert (m.step, m.index, m.exec_split.tolist()) == (7, 0, [False])
    assert m.token_weight.dtype == torch.float64 and m.behavior_logprobs.dtype == torch.float32


def test_execution_kept_whole_when_it_fits_else_split_and_flagged():
    tree = two_leaf_tree()
    sel = select_trajectories(tree, None, np.random.default_rng(0))
    other = build_tree([rec(0, [1], [2, 3, 4], exec_id="f")])
    sel_o = select_trajectories(other, None, np.random.default_rng(0))  # one sequence of 4 tokens
    samples = [ExecutionSample("e", tree, sel, 1.0), ExecutionSample("f", other, sel_o, -1.0)]
    ms = pack_step(samples, max_tokens=13)  # e = 7 + 6 = 13 fits alone; f goes elsewhere
    assert [m.num_tokens for m in ms] == [13, 4]
    assert ms[0].exec_split.tolist() == [False, False]
    ms = pack_step(samples, max_tokens=8)  # e must be split over two micro-steps, f fills a gap
    assert ms[0].exec_split.tolist() == [True, False]
    assert [m.num_tokens for m in ms] == [7, 6, 4]  # e's sequences first-fit one per bin, f opens a third
    assert all(m.num_tokens <= 8 for m in ms)
    with pytest.raises(TrajectoryTooLongError, match="needs 7 tokens, more than max_tokens=6"):
        pack_step(samples, max_tokens=6)


def test_context_parallel_padding_and_shards():
    tree = two_leaf_tree()
    sel = select_trajectories(tree, None, np.random.default_rng(0))  # sequences of 7 and 6 tokens
    samples = [ExecutionSample("e", tree, sel, 0.5)]
    with pytest.raises(TrajectoryTooLongError, match="configure context-parallel"):
        pack_step(samples, max_tokens=4)
    ms = pack_step(samples, max_tokens=4, context_parallel_size=2, pad_token_id=99)
    # each sequence padded to a multiple of 2·cp = 4: 7 → 8, 6 → 8; capacity 2·4 = 8 per micro-step
    assert [m.cu_seqlens.tolist() for m in ms] == [[0, 8], [0, 8]]
    m0 = ms[0]
    assert m0.input_ids.tolist() == [1, 2, 3, 4, 5, 6, 7, 99]
    assert m0.position_ids.tolist() == list(range(8))
    assert m0.target_mask.tolist() == [0, 1, 1, 0, 1, 1, 0, 0]
    assert ms[1].input_ids.tolist() == [1, 2, 3, 4, 8, 9, 99, 99]
    assert ms[0].exec_split.tolist() == [True]
    with pytest.raises(TrajectoryTooLongError, match="raise max_tokens or context_parallel_size"):
        pack_step(samples, max_tokens=2, context_parallel_size=2)


def test_cp_shard_index_zigzag():
    from gyre.trajectory.packing import cp_shard_index

    cu = torch.tensor([0, 8, 16])
    assert cp_shard_index(torch.tensor([0, 8]), 2, 0).tolist() == [0, 1, 6, 7]
    assert cp_shard_index(torch.tensor([0, 8]), 2, 1).tolist() == [2, 3, 4, 5]
    shards = [cp_shard_index(cu, 4, r) for r in range(4)]
    assert all(len(x) == 4 for x in shards)
    assert sorted(torch.cat(shards).tolist()) == list(range(16))
    assert shards[3].tolist() == [3, 4, 11, 12]
    with pytest.raises(ValueError, match="multiple of 2"):
        cp_shard_index(torch.tensor([0, 6]), 2, 0)


def test_plan_bins_first_fit_decreasing():
    bins, split = plan_bins([[5, 5], [3], [8], [2, 2, 2]], max_tokens=10)
    # totals 10, 3, 8, 6 → exec 0 fills bin 0; exec 2 → bin 1 (2 left); exec 3 → bin 2 (4 left); exec 1 → bin 2
    assert bins == [[(0, 0), (0, 1)], [(2, 0)], [(3, 0), (3, 1), (3, 2), (1, 0)]]
    assert split == [False, False, False, False]
    bins, split = plan_bins([[6, 6, 3]], max_tokens=10)
    assert bins == [[(0, 0), (0, 2)], [(0, 1)]] and split == [True]


# ------------------------------------------------------------------------------ end to end


def test_materialize_step_from_store(tmp_path):
    store = TitoStore(tmp_path)
    trees = {
        "x0": [rec(0, [1, 2], [3, 4], exec_id="x0"), rec(1, [1, 2, 3, 4, 5], [6], exec_id="x0")],
        "x1": [rec(0, [1, 2], [7], exec_id="x1")],
        "x2": [rec(0, [1, 2], [8, 9], exec_id="x2")],
        "y0": [rec(0, [4], [4, 4], exec_id="y0")],
        "y1": [rec(0, [4], [5], exec_id="y1")],
    }
    outcomes = {"x0": Outcome.scored(1), "x1": Outcome.scored(0), "x2": Outcome.eval_failed(),
                "y0": Outcome.scored(1), "y1": Outcome.scored(1)}
    for eid, recs in trees.items():
        with store.writer(eid) as w:
            for r in recs:
                w.append(r)
    groups = [ScoredGroup(q, 2, [ScoredExecution(e, outcomes[e], tito_path=str(store.path_for(e))) for e in eids])
              for q, eids in (("q0", ["x0", "x1", "x2"]), ("q1", ["y0", "y1"]))]
    def weights(batch):
        w = {}
        for m in batch.micro_steps:
            for e, wt in zip(m.exec_index[m.target_mask].tolist(), m.token_weight[m.target_mask].tolist()):
                w.setdefault(e, []).append(wt)
        return w

    batch = materialize_step(groups, max_tokens=32, rng=np.random.default_rng(0), train_version=5,
                             skip_zero_advantage=False)
    assert batch.excluded == ["x2"] and batch.all_equal_groups == ["q1"] and batch.staleness == [3, 3]
    assert [s.execution_id for s in batch.samples] == ["x0", "x1", "y0", "y1"]
    # x0: A = +1 (rewards 1, 0), L = 3; x1: A = -1, L = 1; q1 all equal → A = 0; |E| = 4
    w = weights(batch)
    assert w[0] == [-1 / (4 * 3)] * 3 and w[1] == [1 / 4] and w[2] == [0.0, 0.0] and w[3] == [0.0]
    # the default: the all-equal q1 makes no micro-step, but y0, y1 stay in |E| = 4, so x0 and x1
    # weigh exactly as above
    batch = materialize_step(groups, max_tokens=32, rng=np.random.default_rng(0))
    assert batch.all_equal_groups == ["q1"] and [s.execution_id for s in batch.samples] == ["x0", "x1"]
    assert all(m.num_executions == 4 for m in batch.micro_steps)
    assert weights(batch) == {0: [-1 / (4 * 3)] * 3, 1: [1 / 4]}
    only_q1 = materialize_step(groups[1:], max_tokens=32, rng=np.random.default_rng(0))
    assert only_q1.micro_steps == [] and only_q1.samples == [] and only_q1.all_equal_groups == ["q1"]
    # a caller-given |E| (nominal B·N when groups stream in one at a time)
    batch = materialize_step(groups[:1], max_tokens=32, rng=np.random.default_rng(0), num_executions=8)
    assert batch.micro_steps[0].num_executions == 8
    w = [x for m in batch.micro_steps for x in m.token_weight[m.target_mask].tolist()]
    assert sorted(w) == sorted([-1 / (8 * 3)] * 3 + [1 / 8])
