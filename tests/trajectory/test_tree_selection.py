"""Hand-worked trees: provenance rules, stats, selection by role priority."""

from __future__ import annotations

import numpy as np
import pytest

from gyre.trajectory.record import CallRecord, Role
from gyre.trajectory.selection import select_trajectories
from gyre.trajectory.tree import build_tree


def rec(cid, inp, out, role=Role.MAIN, lp=None, ms=None, exec_id="e"):
    lp = [-(cid + 1) - k / 10 for k in range(len(out))] if lp is None else lp
    return CallRecord(exec_id, cid, role, np.array(inp), np.array(out), np.array(lp), 0, message_starts=ms)


def provenance(tree, leaf):
    segs = tree.leaf_path(leaf)
    return (tree.path_array(segs, tree.tokens).tolist(), tree.path_array(segs, tree.is_target).astype(int).tolist(),
            tree.path_array(segs, tree.logprob).tolist())


def leaf_by_tokens(tree, tokens):
    for k in range(tree.num_leaves):
        if tree.leaf_tokens(k).tolist() == tokens:
            return k
    raise AssertionError(f"no leaf {tokens}")


def test_output_reused_verbatim_stays_target_and_diverging_copy_is_context():
    recs = [
        rec(0, [1, 2], [7, 8, 9]),  # sampled 7 8 9 after [1 2]
        rec(1, [1, 2, 7, 8, 9, 5], [6]),  # reuses them verbatim at the same positions
        rec(2, [1, 2, 7, 8, 4, 7, 8, 9], [3]),  # diverges inside call 0's output; then 7 8 9 again (shifted)
        rec(3, [1, 3, 7, 8, 9], [6], role=Role.MAIN_SUMMARY),  # a summary re-inserted into a new prompt
    ]
    tree = build_tree(recs)
    toks, tgt, lp = provenance(tree, leaf_by_tokens(tree, [1, 2, 7, 8, 9, 5, 6]))
    assert tgt == [0, 0, 1, 1, 1, 0, 1]
    assert np.allclose(lp, [0, 0, -1.0, -1.1, -1.2, 0, -2.0])
    toks, tgt, _ = provenance(tree, leaf_by_tokens(tree, [1, 2, 7, 8, 4, 7, 8, 9, 3]))
    assert tgt == [0, 0, 1, 1, 0, 0, 0, 0, 1]  # shared 7 8 stay targets; 4 and the shifted copy are context
    toks, tgt, _ = provenance(tree, leaf_by_tokens(tree, [1, 3, 7, 8, 9, 6]))
    assert tgt == [0, 0, 0, 0, 0, 1]
    s = tree.stats
    assert (s.calls, s.leaves) == (4, 3)
    # positions: [1] [2] [7] [8] | [9 5 6] | [4 7 8 9 3] | [3 7 8 9 6]  → 1 + 1 + 2 + 3 + 5 + 5 = 13 ... counted:
    # root segment [1]; branch [2 7 8] / [3 7 8 9 6]; under [2 7 8]: [9 5 6] and [4 7 8 9 3]
    assert s.unique_tokens == 1 + 3 + 5 + 3 + 5
    assert s.token_segments == 5
    assert s.expanded_tokens == 7 + 9 + 6
    assert s.unique_target_tokens == 3 + 1 + 1 + 1  # 7 8 9, 6, 3, 6 (summary)
    assert s.expanded_target_tokens == 4 + 3 + 1
    assert s.message_nodes is None
    assert s.leaves_by_role == {"MAIN": 2, "MAIN_SUMMARY": 1}


def test_retry_resampling_a_context_position_makes_it_a_target_with_first_logprob():
    recs = [
        rec(5, [1, 2, 3], [4], lp=[-0.25]),
        rec(2, [1, 2], [3, 9], lp=[-0.5, -0.75]),  # lower call_id: processed first
        rec(7, [1, 2], [3, 8], lp=[-0.125, -1.0]),  # samples 3 again: first sampler (call 2) keeps its log-prob
    ]
    tree = build_tree(recs)
    _, tgt, lp = provenance(tree, leaf_by_tokens(tree, [1, 2, 3, 4]))
    assert tgt == [0, 0, 1, 1] and lp == [0.0, 0.0, -0.5, -0.25]
    assert tree.call_ids.tolist() == [2, 5, 7]
    _, tgt, lp = provenance(tree, leaf_by_tokens(tree, [1, 2, 3, 8]))
    assert tgt == [0, 0, 1, 1] and lp == [0.0, 0.0, -0.5, -1.0]


def test_message_nodes_small():
    # message starts: system at 0, user at 2, the assistant header 9 (generation prompt) at 4.
    # call 1 continues call 0 with a tool message at 7; call 2 re-samples call 0 with other output.
    recs = [
        rec(0, [1, 1, 2, 2, 9], [3, 3], ms=[0, 2, 4]),
        rec(1, [1, 1, 2, 2, 9, 3, 3, 4, 4, 9], [5], ms=[0, 2, 4, 7, 9]),
        rec(2, [1, 1, 2, 2, 9], [6], ms=[0, 2, 4]),
    ]
    tree = build_tree(recs)
    # message nodes: sys [1 1], user [2 2], asst [9 3 3], tool [4 4], asst [9 5], asst' [9 6] = 6
    # leaves: [..5] with sys,user,asst,tool,asst = 5 messages; [..6] with sys,user,asst' = 3
    assert tree.stats.message_nodes == 6
    assert tree.stats.message_occurrences == 8
    assert tree.stats.message_duplicates_saved == 2


def test_bad_records_are_rejected():
    with pytest.raises(ValueError, match="no records"):
        build_tree([])
    with pytest.raises(ValueError, match="execution_id"):
        build_tree([rec(1, [1], [2]), rec(2, [1], [3], exec_id="other")])
    with pytest.raises(ValueError, match="input_ids is empty"):
        build_tree([rec(1, [], [2])])
    with pytest.raises(ValueError, match="message_starts"):
        build_tree([rec(1, [1, 2], [2], ms=[0, 5])])


def priority_tree():
    # M: main leaf, S1/S2: main summaries, U: sub-agent, X: sub summary, D: a main leaf whose own
    # segment holds no target (a call with empty output that branches off inside the prompt).
    return build_tree([
        rec(0, [1, 2], [3, 4]),  # shared main prefix: targets 3 4
        rec(1, [1, 2, 3, 4, 10], [11, 12]),  # M
        rec(2, [1, 2, 3, 4, 20], [21], role=Role.MAIN_SUMMARY),  # S1
        rec(3, [1, 2, 3, 4, 30], [31, 32, 33], role=Role.MAIN_SUMMARY),  # S2
        rec(4, [50, 51], [52], role=Role.SUB),  # U
        rec(5, [50, 51, 52, 53], [54], role=Role.SUB_SUMMARY),  # X
        rec(6, [1, 2, 3, 4, 40], [], role=Role.MAIN),  # D: no output at all
    ])


def test_selection_priority_claims_and_drops():
    tree = priority_tree()
    assert tree.num_leaves == 5  # U is a prefix of X, so U is not a leaf
    for seed in range(20):
        sel = select_trajectories(tree, None, np.random.default_rng(seed))
        got = [(t.role, t.num_targets) for t in sel.trajectories]
        # MAIN leaves first (M, D in random order; D claims nothing and is dropped), then the two
        # summaries in random order, then the sub summary.
        first_main = got[0]
        if sel.order.index(leaf_by_tokens(tree, [1, 2, 3, 4, 40])) == 0:
            # D first: claims the shared targets 3 4 → it is kept with 2 targets, then M gets 2
            assert got[:2] == [(Role.MAIN, 2), (Role.MAIN, 2)] and sel.dropped == 0
        else:
            assert first_main == (Role.MAIN, 4) and sel.dropped == 1
        assert sorted(got[-3:-1]) == [(Role.MAIN_SUMMARY, 1), (Role.MAIN_SUMMARY, 3)]
        assert got[-1] == (Role.SUB_SUMMARY, 2)
        assert sel.num_targets == 2 + 2 + 1 + 3 + 2


def test_selection_j_max_seeded_and_seq_len():
    tree = priority_tree()
    a = select_trajectories(tree, 2, np.random.default_rng(123))
    b = select_trajectories(tree, 2, np.random.default_rng(123))
    assert [t.leaf for t in a.trajectories] == [t.leaf for t in b.trajectories]
    assert len(a.trajectories) == 2
    for t in a.trajectories:
        assert t.role in (Role.MAIN, Role.MAIN_SUMMARY)
    # J_max=1 from M: path [1 2 3 4 10 11 12], cut after the last target → 7 tokens
    for seed in range(10):
        sel = select_trajectories(tree, 1, np.random.default_rng(seed))
        assert len(sel.trajectories) == 1
        t = sel.trajectories[0]
        assert (t.num_targets, t.seq_len) in {(4, 7), (2, 4)}  # M, or D cut after 4 → [1 2 3 4]
    with pytest.raises(ValueError, match="rng"):
        select_trajectories(tree, 1)
    with pytest.raises(ValueError, match="j_max"):
        select_trajectories(tree, 0, np.random.default_rng(0))


def test_helper_calls_are_never_selected_nor_targets():
    """A harness's background calls (Role.HELPER: titles, bash-prefix checks) are recorded but never
    trained: not in the tree, no leaf, no selected trajectory, no micro-step target."""
    from gyre.trajectory.packing import ExecutionSample, pack_step

    helper_out = [70, 71, 72]
    recs = [
        rec(0, [1, 2, 3], [4, 5]),
        rec(1, [1, 2, 9], helper_out, role=Role.HELPER, lp=[-9.5] * 3),  # shares the prefix [1, 2]
        rec(2, [1, 2, 3, 4, 5, 6], [7]),
        rec(3, [60, 61], [73], role=Role.HELPER, lp=[-9.5]),  # a helper's own tree
    ]
    tree = build_tree(recs)
    assert tree.stats.helper_calls == 2 and tree.stats.calls == 2
    assert tree.num_leaves == 1 and set(tree.call_roles.tolist()) == {int(Role.MAIN)}
    assert not set(helper_out + [73]) & set(tree.tokens.tolist())
    sel = select_trajectories(tree, None, np.random.default_rng(0))
    assert [t.role for t in sel.trajectories] == [Role.MAIN] and sel.num_targets == 3
    steps = pack_step([ExecutionSample("e", tree, sel, 1.0)], 64)
    targets = {int(t) for ms in steps for t in ms.targets[ms.target_mask]}
    assert targets == {4, 5, 7}
    assert all(-9.5 not in ms.behavior_logprobs.tolist() for ms in steps)
    only = build_tree([recs[3]])  # an execution of helper calls only: nothing to train
    assert only.num_leaves == 0 and only.stats.helper_calls == 1
    assert select_trajectories(only, 5, np.random.default_rng(0)).trajectories == []


def test_the_call_tree_indents_each_call_under_the_call_its_input_extends():
    """`python -m gyre.trajectory --calls` (issue 53's docs item: it printed counts, not the tree).
    Hand-built: 0 a root; 1 continues 0 (0's input + output, then a tool result); 2 a new context
    (a sub-agent); 3 continues 1; 4 continues 2; 5 starts like 0 but diverges (a retry): a root."""
    from gyre.trajectory.__main__ import call_tree

    records = [rec(0, [1, 2], [3]), rec(1, [1, 2, 3, 9], [4]), rec(2, [7, 8], [5], role=Role.HELPER),
               rec(3, [1, 2, 3, 9, 4, 9], [6]), rec(4, [7, 8, 5, 9], [6], role=Role.HELPER), rec(5, [1, 2, 6], [3])]
    lines = call_tree(records[::-1])  # any order in, call order out
    assert [(len(ln) - len(ln.lstrip()), ln.split()[1], ln.rsplit("(", 1)[1]) for ln in lines] == [
        (0, "0", "new context)"), (2, "1", "extends call 0)"), (0, "2", "new context)"),
        (4, "3", "extends call 1)"), (2, "4", "extends call 2)"), (0, "5", "new context)")]
    assert lines[2].split(":")[0].strip() == "call 2 helper" and "6 in, 1 out, v0, stop" in lines[3]
