"""gyre.runtime.attempts: run.json's attempts and the run's totals over them, and the groups one
attempt carries over to the next (what a resume decides from groups.jsonl is proven through
`rundir.resolve` in tests/runtime/test_rundir.py)."""

import json

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from gyre.runtime.attempts import attempt_groups, carriable, carried_group, end_attempt, record_ranks, run_totals, \
    write_manifest


def _result(run, execution_id, reward):
    (run / "executions" / execution_id).mkdir(parents=True)
    (run / "executions" / execution_id / "result.json").write_text(json.dumps({"reward": reward}))


_ENDED = st.fixed_dictionaries({
    "steps": st.integers(0, 50), "wall_s": st.floats(0, 1e4), "calls": st.integers(0, 10**6),
    "aborted_calls": st.integers(0, 5), "reroutes": st.integers(0, 100), "engine_stalls": st.integers(0, 9),
    "sink_errors": st.integers(0, 9), "lost_in_flight": st.integers(0, 9), "carried_over_groups": st.integers(0, 3),
    "redispatched_groups": st.integers(0, 3),
    "execution_outcomes": st.dictionaries(st.sampled_from(["completed", "crashed", "killed", "cancelled"]),
                                          st.integers(0, 99), max_size=4),
    "incomplete_tito": st.dictionaries(st.text("abc", min_size=1, max_size=4), st.just("assistant tokens"), max_size=3),
    "error": st.one_of(st.none(), st.just("interrupted by SIGTERM")),
})


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(attempts=st.lists(st.one_of(st.none(), _ENDED), min_size=1, max_size=5))
def test_the_summary_adds_up_every_attempt_that_ended_and_names_those_that_did_not(tmp_path_factory, attempts):
    """summary.json's "run": each attempt that reached its end is recorded in run.json and added
    in; one whose rank 0 died (None here: no end record) is named, never counted as zeros."""
    run = tmp_path_factory.mktemp("run")
    for k, summary in enumerate(attempts):
        assert write_manifest(run, {}, 2) == k
        if summary is not None:
            totals = end_attempt(run, k, {**summary, "mode": "gyre", "staleness_by_step": [1.0]})
    recorded = json.loads((run / "run.json").read_text())["attempts"]
    assert [("ended" in a) for a in recorded] == [s is not None for s in attempts]
    ended = [s for s in attempts if s is not None]
    if not ended:
        return
    # the last call's totals saw every attempt so far (those after the last ended one did not end)
    assert totals["attempts"] == len(attempts[:max(k for k, s in enumerate(attempts) if s is not None) + 1])
    assert totals["attempts_not_ended"] == [k for k, s in enumerate(attempts) if s is None and k < totals["attempts"]]
    assert totals == run_totals(recorded[:totals["attempts"]])
    assert totals["steps"] == ended[-1]["steps"]
    for key in ("calls", "aborted_calls", "reroutes", "engine_stalls", "sink_errors", "lost_in_flight"):
        assert totals[key] == sum(s[key] for s in ended), key
    assert totals["wall_s"] == pytest.approx(sum(s["wall_s"] for s in ended))
    assert totals["incomplete_tito"] == sum(len(s["incomplete_tito"]) for s in ended)
    for outcome in ("completed", "crashed", "killed", "cancelled"):
        assert totals["execution_outcomes"].get(outcome, 0) == sum(s["execution_outcomes"].get(outcome, 0) for s in ended)
    assert [e["attempt"] for e in totals["errors"]] == [k for k, s in enumerate(attempts)
                                                      if s is not None and s["error"] and k < totals["attempts"]]


def test_an_attempt_stopped_by_torchruns_sigterm_names_the_rank_that_died_first(tmp_path):
    """A rank killed outright sends no report; torchrun SIGTERMs the others and the controller
    sees only "interrupted by SIGTERM". The rank whose recorded process is gone is named first."""
    import subprocess
    import sys

    from gyre.runtime import peers

    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        alive = peers.identity(0)
        ident = {**alive, "rank": 1, "pid": victim.pid, "start": peers._start_ticks(victim.pid)}
        third = {**alive, "rank": 2}  # alive (this process), not stopped: slow, not dead
        write_manifest(tmp_path, {}, 3)
        record_ranks(tmp_path, 0, [alive, ident, third])
        assert peers.dead([alive, ident, third]) == []
    finally:
        victim.kill()
        victim.wait()
    error = "interrupted by SIGTERM (received by rank 0); stopped gracefully after 2 steps"
    summary = {"error": error, "interrupted": "SIGTERM", "ranks_not_stopped": [1, 2], "steps": 2}
    totals = end_attempt(tmp_path, 0, summary)
    assert summary["dead_ranks"] == [1]
    assert summary["error"].startswith("rank 1 died (its process ended without a report") and summary["error"].endswith(error)
    assert totals["errors"] == [{"attempt": 0, "error": summary["error"]}]
    assert json.loads((tmp_path / "run.json").read_text())["attempts"][0]["ended"]["dead_ranks"] == [1]
    # A SIGTERM from outside (scancel, Ctrl-C): every rank alive, the error stays the signal's.
    write_manifest(tmp_path, {}, 3)
    record_ranks(tmp_path, 1, [alive, {**alive, "rank": 1}])
    summary = {"error": error, "interrupted": "SIGTERM", "ranks_not_stopped": [1], "steps": 2}
    end_attempt(tmp_path, 1, summary)
    assert summary["error"] == error and "dead_ranks" not in summary
    # Another host's rank cannot be looked up: never named dead.
    assert peers.dead([{**ident, "host": "elsewhere"}]) == []


# ----------------------------------------------------------------------------- carry-over, in-process
def _dataset(*task_ids):
    from gyre.executions.tasks import Dataset, Task

    return Dataset([Task.from_json({"task_id": t, "instruction": "x", "harness": ["true"],
                                    "evaluator": {"command": ["true"]}}) for t in task_ids])


def test_an_attempt_dispatches_the_lost_tasks_first_then_fresh_ones_with_ids_of_its_own(tmp_path, caplog):
    groups = attempt_groups(2, ("b", "gone", "a"), _dataset("a", "b", "c"), 2, shuffle=False, seed=0)
    first = [next(groups) for _ in range(5)]
    # the lost tasks in order (one that left the dataset is named and skipped), then the dataset's order
    assert [g.group_id for g in first] == ["b.a2.g0", "a.a2.g1", "a.a2.g2", "b.a2.g3", "c.a2.g4"]
    assert [e.execution_id for e in first[0].executions] == ["b.a2.g0.0", "b.a2.g0.1"]
    assert [e.index for e in first[4].executions] == [0, 1] and first[4].executions[1].group_id == "c.a2.g4"
    assert "task gone of a lost group is no longer in the dataset" in caplog.text


def test_only_groups_whose_task_and_n_are_unchanged_are_carried_and_their_rewards_come_from_disk(tmp_path, caplog):
    from gyre.executions.evaluator import RewardStatus

    rows = ({"group_id": "a.a0.g0", "task_id": "a", "version": 1, "executions": ["a.a0.g0.0", "a.a0.g0.1"]},
            {"group_id": "z.a0.g1", "task_id": "z", "version": 1, "executions": ["z.a0.g1.0", "z.a0.g1.1"]},
            {"group_id": "b.a0.g2", "task_id": "b", "version": 0, "executions": ["b.a0.g2.0"]})
    kept = carriable(rows, _dataset("a", "b"), 2)
    assert kept == [rows[0]]  # z left the dataset; b was sampled with N = 1
    assert "2 groups of earlier attempts cannot be carried over" in caplog.text
    _result(tmp_path, "a.a0.g0.0", {"status": "valid", "reward": 1.0})
    _result(tmp_path, "a.a0.g0.1", {"status": "placeholder", "reward": 0.0})
    group, results = carried_group(tmp_path, _dataset("a", "b"), rows[0])
    assert group.group_id == "a.a0.g0" and group.task.task_id == "a"
    assert [(e.execution_id, e.index, e.dispatch_version) for e in group.executions] == [
        ("a.a0.g0.0", 0, 1), ("a.a0.g0.1", 1, 1)]  # v_d stays the version it was sampled at
    assert [(r.execution_id, r.index, r.reward.status, r.reward.reward) for r in results] == [
        ("a.a0.g0.0", 0, RewardStatus.VALID, 1.0), ("a.a0.g0.1", 1, RewardStatus.PLACEHOLDER, 0.0)]
