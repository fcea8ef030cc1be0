"""Cell state machine: legal cycle, illegal transitions raise, latencies from the log."""

import itertools

import pytest
from hypothesis import given, strategies as st

from gyre.runtime.cell import LEGAL, CellState, CellStateMachine, IllegalTransition


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_full_cycle_and_latencies():
    clk = FakeClock()
    m = CellStateMachine(cell=0, clock=clk)
    for dt, dst in [(10, CellState.DRAINING), (2, CellState.JOINING), (1.5, CellState.TRAIN),
                    (20, CellState.PUBLISHING), (1, CellState.RESUMING), (3, CellState.ROLLOUT)]:
        clk.t += dt
        m.to(dst)
    clk.t += 4
    # Hand-computed: to_train = DRAINING(10)→JOINING(12) = 2; to_rollout = RESUMING(34.5)→ROLLOUT(37.5) = 3.
    assert m.switch_latencies() == {"to_train": [2.0], "to_rollout": [3.0]}
    t = m.time_in()
    assert t["rollout"] == 10 + 4 and t["draining"] == 2 and t["joining"] == 1.5
    assert t["train"] == 20 and t["publishing"] == 1 and t["resuming"] == 3
    assert m.train_fraction() == pytest.approx((1.5 + 20 + 1) / 41.5)


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
def test_random_walks_time_adds_up(dsts, dts):
    clk = FakeClock()
    m = CellStateMachine(cell=0, clock=clk)
    for dst, dt in zip(dsts, dts):
        clk.t += dt
        try:
            m.to(dst)
        except IllegalTransition:
            pass
    clk.t += 1
    assert sum(m.time_in().values()) == pytest.approx(clk.t)
    for a, b in zip(m.log, m.log[1:]):
        assert b.src is a.dst and b.dst in LEGAL[a.dst]
