"""The paper's case-study shape (docs/design.md §5): 636 requests, 1347 message nodes, 10 leaves,
1716 node occurrences if every leaf were expanded, 369 duplicates saved — built by hand.

Rendering. Every message starts with a role token and is marked as a message start:
  system / user / tool message = [ROLE, b, b]      (3 tokens; b = a fresh body token)
  assistant message            = [ASST] + output   (4 tokens; output = [b, b, END], sampled)
A call's input ends with the [ASST] header (a message start); its output is 3 sampled tokens.

Execution (calls in brackets):
  main agent, system prompt SYS_M, 5 epochs separated by compaction:
    epoch e = 0..3: user_e, c_e main calls each followed by a tool message, then a summarize
                    request and the summary call (MAIN_SUMMARY)            c = 80, 75, 70, 65
    epoch 4:        user_4, c_4 = 200 main calls, a tool message between consecutive calls;
                    call 181 is first sampled and abandoned (a retry), then sampled again.
  sub-agents, system prompt SYS_S: A compacts once (epoch a: 40 calls + summary call
  (SUB_SUMMARY); epoch b: 30 calls), B: 40 calls, C: 30 calls (last call of each thread is not
  followed by a tool message).
  Parallel tool calls: the first 30 calls of main epoch 0, the first 20 of epoch 1 and the first
  19 of sub-agent B are followed by two tool messages instead of one: P = 69 extra messages.

Hand count.
  requests = 630 (thread calls) + 4 main summaries + 1 sub summary + 1 abandoned attempt = 636.
  leaves   = 4 MAIN_SUMMARY + 2 MAIN (epoch 4, abandoned attempt) + 1 SUB_SUMMARY + 3 SUB = 10.
  messages on each root-to-leaf path (occurrences):
    main summary leaves: 2 + 2c_e + 2        → 164 + 154 + 144 + 134 = 596
    epoch 4:             2 + 2·200 − 1       = 401
    abandoned attempt:   2 + 2·180 + 1       = 363
    sub A epoch a:       2 + 2·40 + 2        = 84;  epoch b: 2 + 2·30 − 1 = 61
    sub B: 2 + 2·40 − 1 = 81; sub C: 2 + 2·30 − 1 = 61
    parallel tool extras                     = 69
    total = 596 + 401 + 363 + 84 + 61 + 81 + 61 + 69 = 1716
  shared (saved): SYS_M on 6 main-side leaves (5 saved), SYS_S on 4 sub leaves (3 saved),
    the abandoned attempt shares user_4 + 180·(assistant, tool) with epoch 4 (361 saved):
    369 saved, 1716 − 369 = 1347 unique message nodes.
  tokens: 636 assistant messages · 4 + 711 other messages · 3 = 4677, minus positions shared
    inside messages: SYS_M/SYS_S share their role token (1), the 5 main user messages and the 4
    sub user messages share theirs (4 + 3), the retry shares its [ASST] header (1): 4668.
  expanded tokens: 816 assistant messages on the leaf paths · 4 + 900 others · 3 = 5964.
  targets: 636 · 3 = 1908 unique, 816 · 3 = 2448 expanded.
  radix segments: [SYS] | main rest + USER | 4 summary epochs | epoch-4 trunk, its 2 branches |
    sub rest + USER | 4 sub leaves = 14; segment occurrences 4·3 + 2·4 + 4·3 = 32.
"""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from gyre.trajectory.packing import ExecutionSample, pack_step
from gyre.trajectory.record import CallRecord, Role
from gyre.trajectory.selection import select_trajectories
from gyre.trajectory.tree import build_tree

SYS, USER, ASST, TOOL, END = 1, 2, 3, 4, 5


class Builder:
    def __init__(self) -> None:
        self.fresh = itertools.count(100)
        self.records: list[CallRecord] = []

    def body(self, role: int) -> list[int]:
        return [role, next(self.fresh), next(self.fresh)]

    def call(self, th: dict, role: Role, keep: bool = True) -> None:
        inp = th["tokens"] + [ASST]
        marks = th["marks"] + [len(th["tokens"])]
        out = [next(self.fresh), next(self.fresh), END]
        self.records.append(
            CallRecord("case", len(self.records), role, np.array(inp), np.array(out), np.full(3, -0.5), 0,
                       message_starts=np.array(marks))
        )
        if keep:
            th["tokens"], th["marks"] = inp + out, marks

    def msg(self, th: dict, tokens: list[int]) -> None:
        th["marks"].append(len(th["tokens"]))
        th["tokens"] += tokens

    def thread(self, sys_msg: list[int], role: Role, summary_role: Role, calls: int, parallel: int = 0,
               summarize: bool = False, retry_at: int | None = None) -> None:
        th = {"tokens": [], "marks": []}
        self.msg(th, sys_msg)
        self.msg(th, self.body(USER))
        for k in range(1, calls + 1):
            if k == retry_at:
                self.call(th, role, keep=False)  # sampled, then abandoned and re-requested
            self.call(th, role)
            if k < calls or summarize:
                self.msg(th, self.body(TOOL))
                if k <= parallel:
                    self.msg(th, self.body(TOOL))
        if summarize:
            self.msg(th, self.body(USER))
            self.call(th, summary_role)


def build_case_study() -> list[CallRecord]:
    b = Builder()
    sys_m, sys_s = b.body(SYS), b.body(SYS)
    for c, par in zip((80, 75, 70, 65), (30, 20, 0, 0)):
        b.thread(sys_m, Role.MAIN, Role.MAIN_SUMMARY, c, parallel=par, summarize=True)
    b.thread(sys_m, Role.MAIN, Role.MAIN_SUMMARY, 200, retry_at=181)
    b.thread(sys_s, Role.SUB, Role.SUB_SUMMARY, 40, summarize=True)
    b.thread(sys_s, Role.SUB, Role.SUB_SUMMARY, 30)
    b.thread(sys_s, Role.SUB, Role.SUB_SUMMARY, 40, parallel=19)
    b.thread(sys_s, Role.SUB, Role.SUB_SUMMARY, 30)
    return b.records


@pytest.fixture(scope="module")
def case():
    recs = build_case_study()
    random.Random(0).shuffle(recs)
    return recs, build_tree(recs)


def test_case_study_stats(case):
    _, tree = case
    s = tree.stats
    assert s.calls == 636
    assert s.leaves == 10
    assert s.message_nodes == 1347
    assert s.message_occurrences == 1716
    assert s.message_duplicates_saved == 369
    assert s.leaves_by_role == {"MAIN": 2, "MAIN_SUMMARY": 4, "SUB": 3, "SUB_SUMMARY": 1}
    assert s.unique_tokens == 4668
    assert s.expanded_tokens == 5964
    assert s.duplicate_tokens_saved == 5964 - 4668
    assert s.unique_target_tokens == 1908
    assert s.expanded_target_tokens == 2448
    assert s.token_segments == 14
    assert s.segment_occurrences == 32


def test_case_study_selection(case):
    _, tree = case
    summary_targets = {(c + 1) * 3 for c in (80, 75, 70, 65)}  # 243, 228, 213, 198
    seen_first = set()
    for seed in range(12):
        sel = select_trajectories(tree, 5, np.random.default_rng(seed))
        roles = [t.role for t in sel.trajectories]
        assert roles == [Role.MAIN, Role.MAIN] + [Role.MAIN_SUMMARY] * 3 and sel.dropped == 0
        first, second = sel.trajectories[0].num_targets, sel.trajectories[1].num_targets
        # epoch 4 first: 200 calls · 3 = 600, then the abandoned attempt adds its own 3;
        # abandoned attempt first: 181 · 3 = 543, then epoch 4 adds calls 181..200: 60.
        assert (first, second) in {(600, 3), (543, 60)}
        seen_first.add(first)
        rest = [t.num_targets for t in sel.trajectories[2:]]
        assert set(rest) <= summary_targets and len(set(rest)) == 3
        assert sel.num_targets == 603 + sum(rest)
    assert seen_first == {600, 543}  # uniform within a priority: both orders occur
    sel1 = select_trajectories(tree, 1, np.random.default_rng(0))
    assert sel1.num_targets in (600, 543)
    # fwd-bwd tokens: epoch-4 path 3 + 3 + 200·4 + 199·3 = 1403; abandoned path 6 + 181·4 + 180·3 = 1270
    assert sel1.num_tokens == {600: 1403, 543: 1270}[sel1.num_targets]
    full = select_trajectories(tree, None, np.random.default_rng(0))
    assert len(full.trajectories) == 10 and full.num_targets == 1908 and full.num_tokens == 5964


def test_case_study_packs_with_exact_weights(case):
    _, tree = case
    sel = select_trajectories(tree, None, np.random.default_rng(3))
    micro = pack_step([ExecutionSample("case", tree, sel, -2.0)], max_tokens=2048, num_executions=4)
    assert sum(m.num_targets for m in micro) == 1908
    w = np.concatenate([m.token_weight[m.target_mask].numpy() for m in micro])
    assert np.all(w == 2.0 / (4 * 1908))
    assert sum(m.num_tokens for m in micro) == 5964
    assert bool(micro[0].exec_split[0])  # 5964 tokens cannot fit in one 2048-token micro-step
