"""The step row and summary.json from a hand-built ledger and hand-built sources, against
hand-computed values (no job: `gyre.runtime.summary` is pure)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from gyre.executions.evaluator import RewardResult, RewardStatus
from gyre.executions.tasks import ExecutionSpec, Group, Task
from gyre.proxy.router import RerouteRecord
from gyre.runtime.ledger import RunLedger
from gyre.runtime.rundir import RunDir
from gyre.scheduler import SchedulerConfig
from gyre.runtime.samples import GroupWork
from gyre.runtime.summary import Progress, RunEnd, build_summary, clock, end_lines, step_row


def _spec(gid: str, n: int) -> Group:
    task = Task.from_json({"task_id": gid, "instruction": "x", "harness": ["true"], "evaluator": {"command": ["true"]}})
    return Group(gid, task, [ExecutionSpec(f"{gid}.{i}", task, gid, i) for i in range(n)])


def _ledger() -> RunLedger:
    """Two groups of 2 trained in step 0 at t = 100..110; a.1's TITO lost a record."""
    led = RunLedger(num_cells=2)
    led.begin(100.0)
    led.add_group(0, _spec("a", 2), version=0)
    led.add_group(1, _spec("b", 2), version=0, carried=True)
    led.closed("a.0", calls=1)
    led.closed("a.1", calls=2)
    for eid, outcome in (("a.0", "completed"), ("a.1", "crashed")):
        led.finished(eid, outcome)
    for eid, r in (("a.0", 1.0), ("a.1", 0.0), ("b.0", 0.5), ("b.1", 0.0)):
        led.evaluated(SimpleNamespace(execution_id=eid, index=int(eid[-1]), reward=RewardResult(eid, RewardStatus.VALID, r)))
    led.scored(0, lambda eid: (["rec"], False))  # a.1: 1 record for its 2 calls
    led.set_work(0, GroupWork([["ms"]], [1.0, None], dropped_trajectories=1))
    led.set_work(1, GroupWork([["ms"]], [0.5, 0.0]))
    led.claim(0, 0)
    led.merge_metrics(0, {"loss": 0.3, "num_executions": 3.0, "micro_steps": 2.0})
    led.transition(1, "draining", 104.0)
    led.switch_sent(1, 103.0)
    led.switched(1, "to_train", 104.5)
    led.handover({"actor_restore": 0.25})
    led.decide(0, cells=(0,), groups=[0, 1], final_in_burst=True, valid=3, grad_scale=4 / 3)
    led.close(0)
    return led


def test_the_step_row_from_the_ledger_and_its_named_sources_by_hand():
    led = _ledger()
    sched = SimpleNamespace(water_level=4, dispatched=12, finished=8)
    rerouted = [RerouteRecord("c1", "cell1", "cell0", "recompute", 7, 0, 0.5),
                RerouteRecord("c2", "cell1", "pool0", "migrate", 0, 4096, 0.25)]
    row = step_row(led, 0, 110.0, step_time_s=10.0, scheduler=sched, reroutes=5, rerouted=rerouted,
                   unmatched_turns=2, sink_errors=1, stats={"grad_norm": 0.5, "version": 7})
    assert (row["step"], row["version"], row["time_s"], row["step_time_s"]) == (0, 1, 10.0, 10.0)
    assert (row["water_level"], row["dispatched"], row["finished"]) == (4, 12, 8)
    assert row["reroutes"] == 5 and row["reroutes_migrated"] == 1 and row["reroutes_recomputed"] == 1
    assert row["reroute_tokens_recomputed"] == 7 and row["reroute_bytes_moved"] == 4096
    assert row["reroute_latency_s_migrated"] == 0.25 and row["reroute_latency_s_recomputed"] == 0.5
    assert row["unmatched_turns"] == 2 and row["sink_errors"] == 1 and row["incomplete_tito"] == 1
    assert row["switch_to_train_s"] == 1.5 and row["switch_to_rollout_s"] is None
    assert row["rewards"] == [1.0, 0.5, 0.0] and row["reward_mean"] == pytest.approx(0.5)
    assert row["executions_valid"] == 3 and row["dropped_trajectories"] == 1
    assert row["loss"] == pytest.approx(0.3 * 4 / 3) and row["micro_steps"] == 2.0
    assert row["actor_restore_s"] == 0.25
    assert row["cell_time_s"] == {"0": {"rollout": 10.0}, "1": {"rollout": 4.0, "draining": 6.0}}
    assert row["grad_norm"] == 0.5 and row["version"] == 1  # step + 1; the actor's own "version" is not copied


def test_summary_json_from_the_ledger_and_its_named_sources_by_hand():
    led = _ledger()
    sc = SchedulerConfig(mode="async")
    how = RunEnd(steps=1, end=130.0, cancelled_at_end=2, ranks_not_stopped=[3], error="boom",
                 interrupted="SIGTERM", silent_rank=3, last_checkpoint_s=1.5)
    router = {"reroutes": 5, "migration": {"mode": "off"}, "engine_failures": 1, "engine_stalls": 0, "dead_engine_calls": 1}
    run = RunDir(Path("unused"), attempt=2, start_version=0, redo_tasks=("x", "y"), lost_in_flight=4)
    rows = [{"step": s, "rewards": r, "group_rewards": [r]} for s, r in enumerate(([0.0, 0.0], [1.0, 1.0]))]
    summary = build_summary(led, how, scheduler=sc, shutdown_timeout_s=25.0, seed=0, fractions={0: 0.25, 1: 0.0},
                            router=router, proxy_totals={"calls": 9, "aborted_calls": 1}, worst_unmatched=[], sink_errors=1,
                            health={"crashed": 1}, measured_staleness=[0, 1], run=run, rows=rows)
    assert summary["steps"] == 1 and summary["wall_s"] == 30.0 and summary["mode"] == "async"
    assert summary["train_fraction"] == {"0": 0.25, "1": 0.0}
    assert summary["switch_latency_s"] == {"to_train": 1.5, "to_rollout": None}
    assert summary["handover_s"] == {"actor_restore": {"mean": 0.25, "max": 0.25, "count": 1}}
    assert (summary["reroutes"], summary["engine_failures"], summary["engine_stalls"]) == (5, 1, 0)
    assert summary["dead_engine_calls"] == 1
    assert summary["calls"] == 9 and summary["aborted_calls"] == 1 and summary["spliced_turns"] == 0
    assert summary["execution_outcomes"] == {"completed": 1, "crashed": 1}  # the carried group did not run here
    assert summary["incomplete_tito"] == {"a.1": "1 TITO records for its 2 calls"} and summary["sink_errors"] == 1
    assert (summary["attempt"], summary["lost_in_flight"], summary["redispatched_groups"]) == (2, 4, 2)
    assert summary["carried_over_groups"] == 1 and summary["cancelled_at_end"] == 2
    assert summary["measured_staleness_mean"] == 0.5 and summary["staleness_by_step"] == {"0": [0, 0]}
    assert summary["failed_executions"] == {"crashed": 1}
    assert (summary["error"], summary["interrupted"], summary["silent_rank"]) == ("boom", "SIGTERM", 3)
    assert summary["ranks_not_stopped"] == [3] and summary["last_checkpoint_s"] == 1.5
    assert summary["shutdown_timeout_s"] == 25.0
    assert summary["reward_trend"]["diff"] == pytest.approx(1.0)  # 0.0 → 1.0 over the two rows
    one_row = build_summary(led, how, scheduler=sc, shutdown_timeout_s=25.0, seed=0, fractions={}, router=router,
                            proxy_totals={}, worst_unmatched=[], sink_errors=0, health={}, measured_staleness=[], run=run, rows=rows[:1])
    assert "reward_trend" not in one_row and one_row["measured_staleness_mean"] is None and one_row["calls"] == 0


def _row(step, rewards, step_time_s):
    return {"step": step, "rewards": rewards, "reward_mean": sum(rewards) / len(rewards), "loss": 0.25,
            "clip_frac": 0.0, "staleness_mean": 0.5, "step_time_s": step_time_s}


def test_the_progress_line_has_step_executions_reward_so_far_and_an_eta_from_measured_steps():
    sched = SimpleNamespace(ready_unassigned=1, water_level=3, cells_in_training=0, started=10, finished=8)
    p = Progress(steps=5, window=2)
    first = p.step(_row(0, [1.0, 0.0], 10.0), sched, now=10.0)
    # 4 steps left at 10 s a step
    assert first == ("step 1/5 | executions 8 done, 2 running | reward 0.500 (mean so far 0.500) | loss 0.25 clip "
                     "0.00 d 0.50 | 10.0s/step, ETA 40s")
    second = p.step(_row(1, [1.0, 1.0], 20.0), sched, now=30.0)
    assert "reward 1.000 (mean so far 0.750)" in second and "15.0s/step, ETA 45s" in second  # 3 left × (10+20)/2
    third = p.step(_row(2, [0.0, 0.0], 40.0), sched, now=70.0)
    assert "30.0s/step, ETA 1m00s" in third  # window 2: (20+40)/2 = 30, 2 left
    p.step(_row(3, [1.0], 1.0), sched, now=71.0)
    assert p.step(_row(4, [1.0], 1.0), sched, now=72.0).endswith("ETA done")


def test_between_steps_the_wait_is_said_once_then_at_a_doubling_gap():
    sched = SimpleNamespace(ready_unassigned=2, water_level=3, cells_in_training=1, started=6, finished=4)
    p = Progress(steps=4, idle_every_s=60.0)
    said = [t for t in range(0, 1000) if p.idle(sched, 0, now=float(t))]
    assert said == [60, 180, 420, 900]  # gaps 60, 120, 240, 480
    line = Progress(steps=4, idle_every_s=60.0)
    line.step(_row(0, [1.0], 30.0), sched, now=0.0)
    msg = line.idle(sched, 1, now=61.0)
    assert msg.startswith("step 2/4 in progress: executions 4 done, 2 running, 2 groups ready to train")
    assert "no step for 1m01s" in msg and "ETA 1m30s" in msg  # 3 steps left × 30 s


def test_clock_reads_as_a_person_writes_durations():
    assert [clock(x) for x in (0, 59.4, 60, 3599, 3600, 7380)] == ["0s", "59s", "1m00s", "59m59s", "1h00m", "2h03m"]


def test_the_end_lines_count_executions_and_groups_and_lead_with_the_fitted_rise():
    from gyre.runtime.outputs import reward_trend

    # 8 steps of 2 groups of 4: the first quarter (2 steps) is 16 executions in 4 groups
    rows = [{"step": i, "rewards": [float(i >= 4)] * 8, "group_rewards": [[float(i >= 4)] * 4] * 2} for i in range(8)]
    trend = reward_trend(rows, 2, resamples=200)
    summary = {"steps": 8, "wall_s": 120.4, "execution_outcomes": {"completed": 30, "cancelled": 2},
               "cancelled_at_end": 2, "calls": 64, "aborted_calls": 1, "error": None, "ranks_not_stopped": [],
               "reward_trend": trend}
    lines = end_lines(summary, "runs/x")
    assert lines[0] == "run ended after 8 steps in 2m00s"
    assert lines[1].startswith(f"reward: fitted rise {trend['fitted_rise']:+.3f} over 8 steps, 95% interval [")
    assert "first 2 / last 2 steps: 0.000 → 1.000 (+1.000" in lines[1]
    assert "16 executions in 4 groups vs 16 executions in 4 groups" in lines[1]
    assert lines[2] == "executions: 32 (2 cancelled, 30 completed); 2 still running at the end were cancelled"
    assert lines[3] == "model calls: 64, 1 aborted" and lines[-1].startswith("report: python -m gyre.report runs/x")
    flat = {**trend, "fitted_rise_ci95_low": -0.1, "fitted_rise_ci95_high": 0.1}
    assert "(no clear change)" in end_lines({**summary, "reward_trend": flat}, "runs/x")[1]


_FULL_DISK = """
import json, resource, signal, sys
from pathlib import Path
from gyre.runtime.outputs import write_json
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
resource.setrlimit(resource.RLIMIT_FSIZE, (200, 200))  # the disk fills 200 bytes into any file
path = Path(sys.argv[1])
try:
    write_json(path, {"steps": 7, "notes": ["x" * 50] * 20})
    print("written")
except OSError as e:
    print("refused", e.errno)
"""


def test_a_json_output_written_onto_a_full_disk_keeps_the_old_file_whole_and_leaves_no_temporary(tmp_path):
    """Issue 53 item 7: a full disk left an empty summary.json and a run.json.tmp. The disk is
    full 200 bytes into any file (RLIMIT_FSIZE in a child process)."""
    import errno
    import subprocess
    import sys

    path = tmp_path / "summary.json"
    path.write_text(json.dumps({"steps": 3}))
    r = subprocess.run([sys.executable, "-c", _FULL_DISK, str(path)], capture_output=True, text=True, timeout=60,
                       cwd=Path(__file__).resolve().parents[2])
    assert r.stdout.split() == ["refused", str(errno.EFBIG)], r.stdout + r.stderr
    assert json.loads(path.read_text()) == {"steps": 3}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]
    from gyre.runtime.outputs import write_json

    write_json(path, {"steps": 4})  # with room, the new file replaces the old one whole
    assert json.loads(path.read_text()) == {"steps": 4} and sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]
