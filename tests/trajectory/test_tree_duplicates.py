"""Records that reuse call ids (a proxy restarted before call ids outlived it wrote [0, 1, 2, 0, 0])
never cost their execution: exact repeats are dropped, other calls kept under fresh ids."""

from __future__ import annotations

import random

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gyre.trajectory.record import CallRecord, Role
from gyre.trajectory.tree import build_tree, unique_call_ids
from tests.trajectory.sim import all_prefixes, leaf_sequences, random_execution, sampled_prefixes, seq_of


def rec(cid, inp, out, role=Role.MAIN, lp=None):
    lp = [-1.0 - k for k in range(len(out))] if lp is None else lp
    return CallRecord("e", cid, role, np.array(inp), np.array(out), np.array(lp), 0)


def test_restart_ids_hand_worked():
    # the file: [0, 1, 2, 0, 0], the last an exact repeat of the first 0 of the second life
    recs = [rec(0, [1], [2]), rec(1, [1, 2, 3], [4]), rec(2, [1, 2, 3, 4, 5], [6]),
            rec(0, [1, 2, 3, 4, 5, 6, 7], [8]), rec(0, [1, 2, 3, 4, 5, 6, 7], [8])]
    out, dropped, renumbered = unique_call_ids(recs)
    assert [r.call_id for r in out] == [0, 1, 2, 3] and (dropped, renumbered) == (1, 1)
    assert [r.call_id for r in recs] == [0, 1, 2, 0, 0]  # the caller's records are not changed
    tree = build_tree(recs)
    assert tree.call_ids.tolist() == [0, 1, 2, 3]
    assert (tree.stats.duplicate_calls, tree.stats.renumbered_calls) == (1, 1)
    assert tree.leaf_tokens(0).tolist() == [1, 2, 3, 4, 5, 6, 7, 8]
    assert tree.stats.unique_target_tokens == 4  # 2, 4, 6, 8: every call's output once
    # same id, same tokens, another role or log-prob: another call, kept
    assert unique_call_ids([rec(0, [1], [2]), rec(0, [1], [2], role=Role.SUB)])[1:] == (0, 1)
    assert unique_call_ids([rec(0, [1], [2]), rec(0, [1], [2], lp=[-3.0])])[1:] == (0, 1)


def _identity(r: CallRecord) -> tuple:
    return (r.call_id, int(r.role), seq_of(r), len(r.input_ids), r.output_logprobs.tobytes(), r.output_versions.tobytes(),
            r.message_starts.tobytes())


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**32 - 1), st.integers(1, 30), st.sampled_from([2, 4, 50]), st.lists(st.floats(0, 1), max_size=3),
       st.integers(0, 4))
def test_planted_duplicates_keep_every_distinct_call_once(seed, n_events, vocab, restarts, copies):
    calls = random_execution(seed, n_events, vocab)
    # the restart bug: after each restart point, call ids start again at 0
    cuts = sorted({int(f * len(calls)) for f in restarts})
    planted, life_start = [], 0
    for i, r in enumerate(calls):
        if i in cuts:
            life_start = i
        planted.append(CallRecord(r.execution_id, i - life_start, r.role, r.input_ids, r.output_ids, r.output_logprobs,
                                  r.policy_version, output_versions=r.output_versions, message_starts=r.message_starts))
    # and exact repeats of some records, written later in the file
    rng = random.Random(seed)
    for _ in range(copies):
        k = rng.randrange(len(planted))
        planted.insert(rng.randrange(k + 1, len(planted) + 1), planted[k])
    distinct = len({_identity(r) for r in planted})

    tree = build_tree(planted)  # never raises

    assert tree.stats.calls == distinct
    assert tree.stats.duplicate_calls == len(planted) - distinct
    assert len(set(tree.call_ids.tolist())) == distinct
    # every call's tokens are in the tree, each sampled position a target, as without the bug
    assert tree.stats.unique_tokens == len(all_prefixes(calls))
    assert tree.stats.unique_target_tokens == len(sampled_prefixes(calls))
    got = {tuple(tree.leaf_tokens(k).tolist()): int(tree.leaf_role[k]) for k in range(tree.num_leaves)}
    assert got == leaf_sequences(calls)
