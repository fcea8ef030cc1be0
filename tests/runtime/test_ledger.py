"""The run ledger on its own, against hand-computed values: group and step lifecycles, a step's
metrics fields, each execution's accounting (calls, sink errors, outcome, reward, an incomplete
TITO), switch latencies, and the cell timeline (time per state; intervals tile the wall interval)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gyre.executions.evaluator import RewardResult, RewardStatus
from gyre.runtime.cell import CellState, LEGAL, time_per_state, timeline_intervals
from gyre.executions.tasks import ExecutionSpec, Group, Task
from gyre.runtime.ledger import GroupPhase, LedgerError, RunLedger, StepPhase, missing_records
from gyre.runtime.samples import GroupWork

R, D, J, T, P, S = (CellState.ROLLOUT, CellState.DRAINING, CellState.JOINING, CellState.TRAIN, CellState.PUBLISHING,
                    CellState.RESUMING)


def _spec(gid: str, n: int) -> Group:
    task = Task.from_json({"task_id": gid, "instruction": "x", "harness": ["true"], "evaluator": {"command": ["true"]}})
    return Group(gid, task, [ExecutionSpec(f"{gid}.{i}", task, gid, i) for i in range(n)])


class _Result:  # the fields of a runner ExecutionResult the ledger reads
    def __init__(self, execution_id: str, reward: RewardResult | None = None) -> None:
        self.execution_id = execution_id
        self.index = int(execution_id.rsplit(".", 1)[1])
        self.reward = reward


# ----------------------------------------------------------------------------- timeline
def test_intervals_and_time_per_state_by_hand():
    ivs = timeline_intervals([("draining", 3.0), ("joining", 4.5), ("train", 6.0), ("resuming", 9.0),
                              ("rollout", 9.5)], 1.0, 12.0)
    assert ivs == [(R, 1.0, 3.0), (D, 3.0, 4.5), (J, 4.5, 6.0), (T, 6.0, 9.0), (S, 9.0, 9.5), (R, 9.5, 12.0)]
    assert time_per_state(ivs) == {"rollout": 4.5, "draining": 1.5, "joining": 1.5, "train": 3.0, "resuming": 0.5}
    # no transition: the whole interval in ROLLOUT; a zero-length visit still shows its state
    assert timeline_intervals([], 2.0, 5.0) == [(R, 2.0, 5.0)]
    assert time_per_state(timeline_intervals([("draining", 2.0)], 2.0, 2.0)) == {"rollout": 0.0, "draining": 0.0}


def test_ledger_timeline_feeds_cell_times_and_plot_intervals():
    led = RunLedger(num_cells=2)
    led.begin(100.0)
    for dst, t in (("draining", 103.0), ("joining", 104.0), ("train", 105.0)):
        led.transition(1, dst, t)
    assert led.cell_times(110.0) == {"0": {"rollout": 10.0},
                                     "1": {"rollout": 3.0, "draining": 1.0, "joining": 1.0, "train": 5.0}}
    assert led.intervals(110.0)[1] == [(R, 100.0, 103.0), (D, 103.0, 104.0), (J, 104.0, 105.0), (T, 105.0, 110.0)]
    with pytest.raises(LedgerError, match="begin"):
        RunLedger(1).intervals(1.0)


def _walks():
    """Legal state walks (as gyre.runtime.cell allows) with non-negative gaps between transitions."""
    def walk(draw):
        state, out = R, []
        for _ in range(draw(st.integers(0, 12))):
            nxt = sorted(LEGAL[state], key=lambda s: s.value)
            state = draw(st.sampled_from(nxt))
            out.append(state)
        gaps = draw(st.lists(st.floats(0.0, 50.0), min_size=len(out) + 1, max_size=len(out) + 1))
        return out, gaps
    return st.composite(lambda draw: walk(draw))()


@settings(max_examples=200, deadline=None)
@given(_walks(), st.floats(-1e3, 1e3))
def test_time_per_state_sums_to_the_wall_interval_and_intervals_tile_it(walk, start):
    states, gaps = walk
    t, transitions = start, []
    for s, g in zip(states, gaps):
        t += g
        transitions.append((s.value, t))
    end = t + gaps[-1]
    ivs = timeline_intervals(transitions, start, end)
    assert ivs[0][1] == start and ivs[-1][2] == end
    assert all(a[2] == b[1] for a, b in zip(ivs, ivs[1:]))  # each interval starts where the last ended
    assert all(b >= a for _, a, b in ivs)
    assert [s for s, _, _ in ivs] == [R, *states]
    assert sum(time_per_state(ivs).values()) == pytest.approx(end - start, abs=1e-9)


# ----------------------------------------------------------------------------- groups and steps
def _ledger_with_two_ready_groups() -> RunLedger:
    led = RunLedger(num_cells=2)
    led.begin(0.0)
    led.add_group(0, _spec("a", 2), version=0)
    led.add_group(1, _spec("b", 2), version=1)
    for eid in ("a.0", "a.1", "b.1", "b.0"):
        led.evaluated(_Result(eid))
    led.set_work(0, GroupWork([["ms0"], ["ms1"]], [1.0, None], dropped_trajectories=2))
    led.set_work(1, GroupWork([["ms2"]], [0.0, 0.5]))
    return led


def test_group_record_lookup_and_lifecycle():
    led = _ledger_with_two_ready_groups()
    rec, index = led.of_execution("b.1")
    assert (rec.index, rec.group_id, rec.version, index) == (1, "b", 1, 1)
    assert [r.execution_id for r in rec.evaluated] == ["b.1", "b.0"] and rec.phase is GroupPhase.READY
    with pytest.raises(LedgerError, match="unknown execution"):
        led.of_execution("zzz")
    with pytest.raises(LedgerError, match="dispatched twice"):
        led.add_group(0, _spec("c", 1), version=0)
    with pytest.raises(LedgerError, match="evaluated while ready"):
        led.evaluated(_Result("a.0"))
    with pytest.raises(LedgerError, match="ready -> ready"):
        led.set_work(0, GroupWork([[]], [0.0, 0.0]))


def test_a_step_row_from_claims_metrics_and_decision_by_hand():
    led = _ledger_with_two_ready_groups()
    for cell in (0, 1, 0):
        led.claim(3, cell)
    led.merge_metrics(3, {"loss": 0.25, "num_executions": 2.0, "num_clipped": 1.0, "micro_steps": 1.0})
    led.merge_metrics(3, {"loss": 0.5, "num_executions": 1.0, "micro_steps": 2.0})
    rec = led.decide(3, cells=(0, 1), groups=[1, 0], final_in_burst=True, valid=3, grad_scale=4 / 3)
    assert rec.phase is StepPhase.REDUCING and rec.staleness == [2, 3]  # d = 3 − v_d
    with pytest.raises(LedgerError, match="reducing"):
        led.claim(3, 1)
    led.close(3)
    assert led.groups[0].phase is GroupPhase.CONSUMED and led.groups[0].work.bundles == []
    assert led.groups[0].rewards == [1.0, None]
    row = led.step_fields(3, end=10.0)
    assert row["cells_in_step"] == 2
    assert row["claims_by_cell"] == {"0": 2, "1": 1} and row["claim_order"] == [0, 1, 0]
    assert row["final_in_burst"] is True and row["groups"] == 2
    assert row["group_rewards"] == [[0.0, 0.5], [1.0]] and row["rewards"] == [0.0, 0.5, 1.0]
    assert row["reward_mean"] == pytest.approx(0.5) and row["reward_count"] == 3 and row["executions_valid"] == 3
    assert row["staleness"] == [2, 3] and row["staleness_mean"] == 2.5
    assert row["dropped_trajectories"] == 2  # group 0's 2, group 1's none
    assert row["loss"] == pytest.approx(0.75 * 4 / 3) and row["clip_frac"] == pytest.approx(1 / 3)
    assert row["micro_steps"] == 3.0
    assert row["cell_time_s"] == {"0": {"rollout": 10.0}, "1": {"rollout": 10.0}}
    assert led.staleness_by_step() == {"3": [2, 3]}
    with pytest.raises(LedgerError, match="closed while done"):
        led.close(3)


def test_a_step_without_valid_executions_logs_zero_loss_and_an_open_step_has_no_staleness():
    led = _ledger_with_two_ready_groups()
    led.merge_metrics(0, {"loss": 0.7, "num_executions": 1.0})
    led.decide(0, cells=(0,), groups=[0], final_in_burst=False, valid=0, grad_scale=None)
    led.claim(1, 0)  # step 1 is open at the end of the run
    assert led.steps[0].loss_metrics()["loss"] == 0.0
    assert led.staleness_by_step() == {"0": [0]}


# ----------------------------------------------------------------------------- executions
def test_an_executions_accounting_lives_in_its_record():
    led = RunLedger(num_cells=1)
    led.add_group(0, _spec("a", 3), version=0)
    led.add_group(1, _spec("b", 1), version=0, carried=True)
    led.closed("a.0", calls=2)
    led.closed("a.1", calls=3, sink_errors=1)
    for eid, outcome in (("a.0", "completed"), ("a.1", "completed"), ("a.2", "timed_out")):
        led.finished(eid, outcome)
    ok = RewardResult("a.0", RewardStatus.VALID, 1.0)
    led.evaluated(_Result("a.0", ok))
    led.evaluated(_Result("a.2", RewardResult("a.2", RewardStatus.PLACEHOLDER, 0.0)))
    led.evaluated(_Result("a.1", RewardResult("a.1", RewardStatus.VALID, 0.5)))
    e0 = led.execution("a.0")
    assert (e0.group, e0.index, e0.calls, e0.sink_errors, e0.outcome, e0.reward) == (0, 0, 2, 0, "completed", ok)
    assert led.outcomes() == {"completed": 2, "timed_out": 1}  # b.0 (carried) did not run here
    assert led.carried_over == 1
    with pytest.raises(LedgerError, match="unknown execution zzz"):
        led.closed("zzz", calls=1)

    # a.0: its 2 records; a.1: the sink lost one; a.2: no file (it never called the model)
    tito = {"a.0": (["r0", "r1"], False), "a.1": (["r0", "r1"], False)}
    scored = led.scored(0, lambda eid: tito.get(eid, ([], False)))
    assert [(s.execution_id, s.outcome.value, s.records) for s in scored] == [
        ("a.0", 1.0, ["r0", "r1"]), ("a.1", None, []), ("a.2", 0.0, [])]
    assert led.incomplete_tito() == {"a.1": "the proxy could not write 1 of its 3 call records"}


@settings(max_examples=200, deadline=None)
@given(st.one_of(st.none(), st.integers(0, 5)), st.integers(0, 2), st.integers(0, 5), st.booleans())
def test_records_are_complete_exactly_when_nothing_failed_tore_or_went_missing(calls, sink_errors, records, torn):
    missing = missing_records(calls, sink_errors, records, torn)
    complete = not sink_errors and not torn and (calls is None or records == calls)
    assert (missing is None) == complete


def test_switch_latencies_are_measured_from_the_command_to_the_answer_and_reach_the_row():
    led = _ledger_with_two_ready_groups()
    led.switch_sent(1, 10.0)
    led.switched(1, "to_train", 12.5)
    led.switched(0, "to_rollout", 20.0)  # no switch sent (the burst ended first): 0
    led.decide(0, cells=(0,), groups=[0], final_in_burst=False, valid=1, grad_scale=4.0)
    led.close(0)
    row = led.step_fields(0, end=30.0)
    assert led.switch_latencies == {"to_train": [2.5], "to_rollout": [0.0]}
    assert row["switch_to_train_s"] == 2.5 and row["switch_to_rollout_s"] == 0.0


def test_a_group_is_complete_exactly_when_each_dispatched_execution_is_evaluated():
    led = RunLedger(1)
    led.add_group(0, _spec("g", 3), version=0)
    seen = [led.evaluated(_Result(f"g.{i}")).complete for i in (2, 0, 1)]
    assert seen == [False, False, True]  # the third of three, in any order
