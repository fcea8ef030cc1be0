"""An execution's records in the proxy (gyre/proxy/state.py): `CallStats` counts calls as a fold
over them, checked against a plain tally written out by hand."""

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gyre.proxy.admission import Allowance
from gyre.proxy.render import UNMATCHED_KINDS, Rendered
from gyre.proxy.state import CallStats, ExecutionState
from gyre.trajectory.record import Role


def test_two_calls_hand_counted():
    a = Rendered(ids=[1], spliced=2, unmatched=1, tolerated=1, unmatched_kinds=["split"])
    b = Rendered(ids=[1], spliced=1, unmatched=2, unmatched_kinds=["split", "edited"])
    s = CallStats().with_call(a, Role.MAIN, reroutes=1, aborted=False).with_call(b, Role.SUB, reroutes=0, aborted=True)
    assert s == CallStats(calls=2, spliced_turns=3, unmatched_turns=3, tolerated_turns=1, reroutes=1, aborted_calls=1,
                          unmatched_kinds={"split": 2, "edited": 1}, roles={"MAIN": 1, "SUB": 1})
    assert s.counts() == {"calls": 2, "spliced_turns": 3, "unmatched_turns": 3, "tolerated_turns": 1, "reroutes": 1,
                          "aborted_calls": 1, "sink_errors": 0, "inflight": 0}


def test_stats_are_frozen_and_adding_a_call_leaves_the_old_ones_alone():
    before = CallStats().with_call(Rendered(ids=[1], unmatched=1, unmatched_kinds=["split"]), Role.MAIN, 0, False)
    after = before.with_call(Rendered(ids=[1], unmatched=1, unmatched_kinds=["split"]), Role.MAIN, 0, False)
    assert (before.unmatched_kinds, before.roles) == ({"split": 1}, {"MAIN": 1})  # not shared with `after`
    assert (after.unmatched_kinds, after.roles) == ({"split": 2}, {"MAIN": 2})
    with pytest.raises(dataclasses.FrozenInstanceError):
        after.calls = 0


calls = st.lists(st.tuples(st.integers(0, 3), st.lists(st.sampled_from(UNMATCHED_KINDS), max_size=3), st.integers(0, 2),
                           st.integers(0, 2), st.sampled_from(list(Role)), st.booleans()), max_size=12)


@settings(max_examples=100, deadline=None)
@given(calls)
def test_the_fold_equals_a_plain_tally(calls):
    s, tally, roles, kinds = CallStats(), dict.fromkeys(("calls", "spliced", "unmatched", "tolerated", "reroutes", "aborted"), 0), {}, {}
    for spliced, unmatched_kinds, tolerated, reroutes, role, aborted in calls:
        r = Rendered(ids=[1], spliced=spliced + tolerated, unmatched=len(unmatched_kinds), tolerated=tolerated,
                     unmatched_kinds=unmatched_kinds)
        s = s.with_call(r, role, reroutes, aborted)
        tally["calls"] += 1
        tally["spliced"] += spliced + tolerated
        tally["unmatched"] += len(unmatched_kinds)
        tally["tolerated"] += tolerated
        tally["reroutes"] += reroutes
        tally["aborted"] += aborted
        roles[role.name] = roles.get(role.name, 0) + 1
        for k in unmatched_kinds:
            kinds[k] = kinds.get(k, 0) + 1
    assert (s.calls, s.spliced_turns, s.unmatched_turns, s.tolerated_turns, s.reroutes, s.aborted_calls) == tuple(tally.values())
    assert s.roles == roles and s.unmatched_kinds == kinds
    assert sum(s.unmatched_kinds.values()) == s.unmatched_turns and sum(s.roles.values()) == s.calls


def test_an_execution_is_composed_of_its_records():
    a, b = ExecutionState("a"), ExecutionState("b")
    assert a.stats == CallStats() and isinstance(a.allowance, Allowance)
    assert a.allowance is not b.allowance and a.turns is not b.turns  # nothing shared between executions
    assert [next(a.call_ids), next(a.call_ids), next(b.call_ids)] == [0, 1, 0]
