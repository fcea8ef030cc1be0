"""Property tests over random executions (compaction, sub-agents, retries, edited histories),
checked against a brute-force oracle on token-prefix tuples (tests/trajectory/sim.py)."""

from __future__ import annotations

import math
import random
from collections import Counter

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gyre.trajectory.packing import ExecutionSample, pack_step
from gyre.trajectory.selection import select_trajectories
from gyre.trajectory.tree import build_tree
from tests.trajectory.sim import (
    all_prefixes,
    leaf_sequences,
    message_stats,
    random_execution,
    sampled_prefixes,
    seq_of,
    unpack,
)

SETTINGS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
executions = st.tuples(st.integers(0, 2**32 - 1), st.integers(1, 30), st.sampled_from([2, 4, 50]))


@SETTINGS
@given(executions)
def test_tree_matches_oracle(ex):
    seed, n_events, vocab = ex
    records = random_execution(seed, n_events, vocab)
    random.Random(seed).shuffle(records)  # the tree must not depend on record order
    tree = build_tree(records)
    sampled = sampled_prefixes(records)
    prefixes = all_prefixes(records)
    leaves = leaf_sequences(records)

    assert tree.stats.unique_tokens == len(prefixes)
    assert tree.stats.unique_target_tokens == len(sampled)
    assert tree.stats.leaves == len(leaves)
    assert tree.stats.expanded_tokens == sum(len(s) for s in leaves)
    assert tree.stats.expanded_target_tokens == sum(1 for s in leaves for p in range(len(s)) if s[: p + 1] in sampled)
    assert (tree.stats.message_nodes, tree.stats.message_occurrences) == message_stats(records)
    # every leaf path is some call's whole sequence, with that call's role (best if several)
    got = {tuple(tree.leaf_tokens(k).tolist()): int(tree.leaf_role[k]) for k in range(tree.num_leaves)}
    assert got == leaves
    # per-position provenance: target iff sampled at that exact prefix, with its log-prob
    for k in range(tree.num_leaves):
        segs = tree.leaf_path(k)
        toks = tree.path_array(segs, tree.tokens).tolist()
        tgt = tree.path_array(segs, tree.is_target)
        lp = tree.path_array(segs, tree.logprob)
        for p in range(len(toks)):
            key = tuple(toks[: p + 1])
            assert bool(tgt[p]) == (key in sampled)
            if tgt[p]:
                assert lp[p] == np.float32(sampled[key])


@SETTINGS
@given(executions, st.one_of(st.none(), st.integers(1, 6)), st.integers(0, 2**16))
def test_selection_and_packing_invariants(ex, j_max, sel_seed):
    seed, n_events, vocab = ex
    records = random_execution(seed, n_events, vocab)
    tree = build_tree(records)
    sel = select_trajectories(tree, j_max, np.random.default_rng(sel_seed))
    sampled = sampled_prefixes(records)

    # J <= J_max; every considered leaf is accounted for
    assert j_max is None or len(sel.trajectories) <= j_max
    if j_max is None or len(sel.trajectories) < j_max:
        assert len(sel.trajectories) + sel.dropped == tree.num_leaves
    # role priority: no leaf of a better role was skipped while a worse one was chosen
    roles = [int(r) for r in tree.leaf_role]
    if sel.trajectories:
        worst = max(int(t.role) for t in sel.trajectories)
        assert sum(1 for r in roles if r < worst) <= len(sel.trajectories) + sel.dropped
        assert [int(t.role) for t in sel.trajectories] == sorted(int(t.role) for t in sel.trajectories)

    A = 0.75
    L = sel.num_targets
    max_len = max([t.seq_len for t in sel.trajectories], default=2)
    rng = random.Random(sel_seed)
    for max_tokens in (max_len, max_len + rng.randint(0, 40), 10**6):
        micro = pack_step([ExecutionSample("e", tree, sel, A)], max(max_tokens, 2), num_executions=3)
        assert all(m.num_tokens <= max(max_tokens, 2) for m in micro)
        trained = Counter()
        wsum = []
        for toks, tg in unpack(micro):
            for pos, lp, e, w in tg:
                key = tuple(toks[: pos + 2])
                # trained => sampled by the policy, same id, same context, same log-prob
                assert key in sampled, "a context token became a target"
                assert np.float32(lp) == np.float32(sampled[key])
                assert e == 0
                trained[key] += 1
                wsum.append(w)
        assert max(trained.values(), default=1) == 1, "a target trained twice"
        assert len(trained) == L
        if L:
            assert math.isclose(math.fsum(wsum), -A / 3, rel_tol=1e-12)
        # trained set = sampled targets on the union of the chosen paths
        chosen_paths = [tuple(tree.leaf_tokens(t.leaf).tolist()) for t in sel.trajectories]
        on_paths = {s[: p + 1] for s in chosen_paths for p in range(len(s))}
        assert set(trained) == {k for k in sampled if k in on_paths}
    if j_max is None:
        assert L == len(sampled)  # unlimited: every sampled token is trained exactly once


@settings(max_examples=25, deadline=None)
@given(st.lists(executions, min_size=1, max_size=4), st.integers(0, 2**16), st.integers(0, 200))
def test_weights_sum_per_execution_however_packed(exs, sel_seed, extra):
    samples = []
    rng = np.random.default_rng(sel_seed)
    for i, (seed, n_events, vocab) in enumerate(exs):
        recs = random_execution(seed, n_events, vocab)
        tree = build_tree(recs)
        samples.append(ExecutionSample(f"e{i}", tree, select_trajectories(tree, 3, rng), float(rng.normal())))
    longest = max(t.seq_len for s in samples for t in s.selection.trajectories)
    E = len(samples)
    for max_tokens in (longest, longest + extra):
        micro = pack_step(samples, max_tokens)
        per_exec: dict[int, list[float]] = {}
        for m in micro:
            assert m.num_tokens <= max_tokens
            assert m.cu_seqlens[-1] == m.num_tokens
            for e, w in zip(m.exec_index[m.target_mask].tolist(), m.token_weight[m.target_mask].tolist()):
                per_exec.setdefault(e, []).append(w)
            assert (m.token_weight[~m.target_mask] == 0).all() and (m.exec_index[~m.target_mask] == -1).all()
        for i, s in enumerate(samples):
            assert len(per_exec.get(i, [])) == s.num_targets
            if s.num_targets:
                assert math.isclose(math.fsum(per_exec[i]), -s.advantage / E, rel_tol=1e-12, abs_tol=1e-15)
        # an execution that fits is never split
        for i, s in enumerate(samples):
            if s.selection.num_tokens <= max_tokens:
                assert not bool(micro[0].exec_split[i])
                assert sum(1 for m in micro if (m.exec_index == i).any()) <= 1
