"""Cell state machine: legal cycle, illegal transitions raise, every transition logged with its time
(the timeline built from the reported transitions is tested in tests/runtime/test_ledger.py)."""

import itertools

import pytest
from hypothesis import given, strategies as st

from gyre.runtime.cell import LEGAL, CellState, CellStateMachine, IllegalTransition


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_full_cycle_is_logged_with_its_times():
    clk = FakeClock()
    m = CellStateMachine(cell=0, clock=clk)
    walk = [(10, CellState.DRAINING), (2, CellState.JOINING), (1.5, CellState.TRAIN),
            (20, CellState.PUBLISHING), (1, CellState.RESUMING), (3, CellState.ROLLOUT)]
    for dt, dst in walk:
        clk.t += dt
        m.to(dst)
    # Hand-computed: each transition at the running sum of the gaps, from the state before it.
    assert [(t.src, t.dst, t.time) for t in m.log] == [
        (CellState.ROLLOUT, CellState.DRAINING, 10.0), (CellState.DRAINING, CellState.JOINING, 12.0),
        (CellState.JOINING, CellState.TRAIN, 13.5), (CellState.TRAIN, CellState.PUBLISHING, 33.5),
        (CellState.PUBLISHING, CellState.RESUMING, 34.5), (CellState.RESUMING, CellState.ROLLOUT, 37.5)]
    assert m.state is CellState.ROLLOUT


def test_satellite_cannot_publish_and_joining_can_go_back():
    m = CellStateMachine(cell=2, clock=FakeClock())
    m.to(CellState.DRAINING)
    m.to(CellState.JOINING)
    m.to(CellState.RESUMING)  # burst ended before it claimed work
    m.to(CellState.ROLLOUT)
    m.to(CellState.DRAINING)
    m.to(CellState.JOINING)
    m.to(CellState.TRAIN)
    with pytest.raises(IllegalTransition):
        m.to(CellState.PUBLISHING)


@pytest.mark.parametrize("src,dst", [(a, b) for a, b in itertools.product(CellState, CellState) if b not in LEGAL[a]])
def test_every_illegal_transition_raises(src, dst):
    m = CellStateMachine(cell=0, clock=FakeClock())
    m.state = src
    with pytest.raises(IllegalTransition):
        m.to(dst)
    assert m.state is src and not m.log


@given(st.lists(st.sampled_from(list(CellState)), max_size=40), st.lists(st.floats(0, 5), min_size=40, max_size=40))
def test_random_walks_log_only_legal_transitions_in_time_order(dsts, dts):
    clk = FakeClock()
    m = CellStateMachine(cell=0, clock=clk)
    for dst, dt in zip(dsts, dts):
        clk.t += dt
        try:
            m.to(dst)
        except IllegalTransition:
            pass
    assert [t.time for t in m.log] == sorted(t.time for t in m.log)
    assert m.log[0].src is CellState.ROLLOUT if m.log else m.state is CellState.ROLLOUT
    for a, b in zip(m.log, m.log[1:]):
        assert b.src is a.dst and b.dst in LEGAL[a.dst]
