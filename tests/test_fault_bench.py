"""benchmarks/fault_bench.py reads what a fault cost from the run directory's records
(benchmarks/fault_figures.py): hand-made journals and summaries, figures counted by hand."""

import pytest

from benchmarks.fault_figures import calls_recomputed, cell, journal_losses, table


def _dispatched(g, attempt, *execs):
    return {"kind": "dispatched", "attempt": attempt, "group_id": g, "task_id": "t", "version": 0, "executions": list(execs)}


def test_a_lost_group_counts_once_with_the_executions_of_its_dispatch_before_the_loss():
    journal = [
        _dispatched("g1", 0, "g1.a0.0", "g1.a0.1"),
        _dispatched("g2", 0, "g2.a0.0", "g2.a0.1"),
        {"kind": "trained", "group_id": "g1", "step": 0},
        _dispatched("g3", 0, "g3.a0.0", "g3.a0.1", "g3.a0.2"),
        _dispatched("g4", 0, "g4.a0.0", "g4.a0.1"),
        {"kind": "lost", "group_id": "g2", "attempt": 1},  # in flight at the kill: 2 executions
        {"kind": "lost", "group_id": "g3", "attempt": 1},  # 3 executions
        _dispatched("g4", 1, "g4.a1.0", "g4.a1.1"),  # carried over (evaluated): not lost
        _dispatched("g5", 1, "g5.a1.0"),
        {"kind": "trained", "group_id": "g4", "step": 3},
    ]
    assert journal_losses(journal) == (2, 5)
    assert journal_losses([r for r in journal if r["kind"] != "lost"]) == (0, 0)
    # a group lost twice (two restarts) ran again twice; each time its own dispatch's executions
    again = journal + [_dispatched("g5", 1, "g5.a1.0", "g5.a1.1"), {"kind": "lost", "group_id": "g5", "attempt": 2}]
    assert journal_losses(again) == (3, 7)


def test_calls_recomputed_add_up_per_router_rank0_plane_and_are_cumulative_on_the_process_plane():
    summaries = {0: {"dead_engine_calls": 3}, 1: {"dead_engine_calls": 5}}
    assert calls_recomputed(summaries, "rank0") == 8  # a router per attempt
    assert calls_recomputed(summaries, "process") == 5  # one router: the last summary holds the run
    assert calls_recomputed({1: {"dead_engine_calls": 2}}, "rank0") == 2  # attempt 0's rank 0 was killed: no summary
    assert calls_recomputed({0: {"steps": 1}}, "process") is None  # a summary from before the figure existed
    with pytest.raises(ValueError, match="--planes"):
        calls_recomputed(summaries, "gpu")


def _raw(wall, cancelled=0, again=0, calls=0):
    return {"executions_cancelled": cancelled, "groups_run_again": again, "calls_recomputed": calls, "wall_s": wall,
            "steps_completed": 10, "versions_continuous": True, "attempts": 2, "carried_over_groups": 0,
            "lost_in_flight_summary": cancelled, "returncode": 0, "hit": True}


def test_a_cell_is_the_disturbed_runs_losses_and_its_wall_less_the_undisturbed_one():
    c = cell(_raw(100.0), _raw(130.5, cancelled=4, again=2, calls=3))
    assert (c["cancelled"], c["groups_run_again"], c["calls_recomputed"], c["time_lost_s"], c["wall_ratio"]) == \
        (4, 2, 3, 30.5, 1.3)


def test_the_goal_is_met_only_when_every_process_plane_fault_lost_nothing():
    base = _raw(100.0)
    good = {"satellite": {"rank0": cell(base, _raw(120, 4, 2)), "process": cell(base, _raw(110, 0, 0, 3))},
            "rank0": {"rank0": cell(base, _raw(140, 6, 3)), "process": cell(base, _raw(115, 0, 0, 6))}}
    out = table(good)
    assert out["goal_met"] is True  # the rank0 plane's losses are the baseline, not the goal
    assert out["node1"] is None and "node1" in out["not_measured"]
    bad = {**good, "rank0": {**good["rank0"], "process": cell(base, _raw(115, 0, 1))}}
    assert table(bad)["goal_met"] is False
    assert table({"satellite": {"rank0": cell(base, _raw(120, 4, 2))}})["goal_met"] is False  # nothing measured on process
