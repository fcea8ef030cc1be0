"""benchmarks/fault_bench.py reads what a fault cost from the run directory's records
(benchmarks/fault_figures.py): hand-made journals and summaries, figures counted by hand; and
runs the two-node fault with launch.sh's own torchrun line."""

import sys

import pytest

from benchmarks.fault_bench import node_command
from benchmarks.fault_figures import calls_recomputed, cell, journal_losses, merge, table


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
    assert out["goal_faults"] == ["rank0", "satellite"]


def test_node1_measured_counts_toward_the_goal_and_is_no_longer_listed_as_not_measured():
    base = _raw(100.0)
    cells = {"node1": {"rank0": cell(base, _raw(150, 2, 1)), "process": cell(base, _raw(130, 0, 0, 1))}}
    out = table(cells)
    assert out["node1"]["process"]["time_lost_s"] == 30.0 and out["not_measured"] == {}
    assert out["goal_met"] is True and out["goal_faults"] == ["node1"]
    cells["node1"]["process"] = cell(base, _raw(130, 2, 1))  # the two-node restart lost a group
    assert table(cells)["goal_met"] is False
    skipped = table({}, {"node1": "skipped: no root"})  # asked for, but the namespaces could not be made
    assert skipped["node1"] is None and skipped["not_measured"] == {"node1": "skipped: no root"}
    assert skipped["goal_met"] is False


def _record(commit, cells, runs):
    return {"git_commit": commit, "machine": {"cpus": 2}, "versions": {}, "config": {"faults": ",".join(cells)},
            "runs": runs, "figures": table(cells)}


def test_merge_keeps_the_other_kinds_and_their_commit_and_recomputes_the_goal_over_all():
    base = _raw(100.0)
    sat = {"rank0": cell(base, _raw(160, 4, 2)), "process": cell(base, _raw(145, 0, 0, 2))}
    old = _record("aaa", {"satellite": sat}, {"rank0-undisturbed": {"wall_s": 100.0}, "rank0-satellite": {"wall_s": 160}})
    assert old["figures"]["node1"] is None
    good = {"rank0": cell(base, _raw(150, 2, 1)), "process": cell(base, _raw(120, 0, 0))}
    new = _record("bbb", {"node1": good}, {"rank0-node1": {"wall_s": 150}})
    out = merge(old, new)
    f = out["figures"]
    assert f["satellite"] == sat and f["node1"] == good and f["not_measured"] == {}
    assert f["goal_met"] is True and f["goal_faults"] == ["node1", "satellite"]
    assert out["commit_by_fault"] == {"satellite": "aaa", "node1": "bbb"}
    assert out["git_commit"] == "bbb" and out["earlier"]["git_commit"] == "aaa"
    assert sorted(out["runs"]) == ["rank0-node1", "rank0-satellite", "rank0-undisturbed"]
    # node1's loss fails the merged goal, though the old file's goal was met
    lossy = _record("ccc", {"node1": {**good, "process": cell(base, _raw(120, 2, 1))}}, {})
    assert old["figures"]["goal_met"] is True and merge(old, lossy)["figures"]["goal_met"] is False
    # a kind measured again is the new run's, at the new commit; merging twice keeps the first commit
    sat2 = {**sat, "process": cell(base, _raw(140, 0, 0, 5))}
    again = merge(out, _record("ddd", {"satellite": sat2}, {}))
    assert again["figures"]["satellite"] == sat2 and again["figures"]["node1"] == good
    assert again["commit_by_fault"] == {"node1": "bbb", "satellite": "ddd"}


def test_the_two_node_agents_run_launch_shs_restart_line_with_this_python():
    addrs = ["10.9.8.1", "10.9.8.2"]
    for node in (0, 1):
        argv = node_command(node, addrs, 29517, "bench-x", ["--job", "train", "--run-dir", "/r"])
        assert argv[:5] == ["env", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1", sys.executable, "-m", "torch.distributed.run"]
        m = argv.index("-m", 5)
        assert dict(zip(argv[5:m:2], argv[6:m:2])) == {
            "--nnodes": "2", "--nproc-per-node": "1", "--rdzv-backend": "c10d", "--rdzv-endpoint": "10.9.8.1:29517",
            "--rdzv-id": "gyre-bench-x", "--rdzv-conf": f"is_host={1 - node}", "--local-addr": addrs[node],
            "--max-restarts": "1"}, argv
        assert argv[m:] == ["-m", "gyre.run", "--job", "train", "--run-dir", "/r"]
