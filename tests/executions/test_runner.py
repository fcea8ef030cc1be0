"""Harness runner with real subprocesses: timeouts kill whole trees, crashes, launch failures,
separate workspaces, environment, counters under concurrency, shutdown, remote mode."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

from gyre.executions.config import EvaluatorConfig, RunnerConfig
from gyre.executions.evaluator import Evaluator, Outcome, RewardStatus
from gyre.executions.runner import EventKind, ExecutionPhase, HarnessRunner, LocalKeys, _Live
from gyre.runtime.proxy_access import GyreProxyAccess
from gyre.executions.tasks import EvaluatorSpec, Task

from tests.executions.helpers import spec, wait_dead, write_script


def run(coro):
    return asyncio.run(coro)


def make_runner(tmp_path: Path, **kw) -> HarnessRunner:
    ev_kw = kw.pop("evaluator_cfg", {})
    # These tests watch the harness from outside (pid files and stamps beside its workspace), which a
    # sandbox forbids on purpose; the unisolated path is what they test (isolation: tests/security).
    kw.setdefault("sandbox", "none")
    cfg = RunnerConfig(run_dir=str(tmp_path / "runs"), kill_grace_s=kw.pop("kill_grace_s", 0.5), **kw)
    return HarnessRunner(cfg, Evaluator(EvaluatorConfig(retry_backoff_s=0.0, timeout_s=10, **ev_kw)))


SPAWNER = """
    import os, subprocess, sys, time
    pidfile = sys.argv[1]
    pids = [os.getpid()]
    # a plain child, a grandchild via a shell, and a child that leaves the process group
    pids.append(subprocess.Popen(["sleep", "1000"]).pid)
    sh = subprocess.Popen(["sh", "-c", "sleep 1000 & echo $! ; wait"], stdout=subprocess.PIPE, text=True)
    pids.append(sh.pid); pids.append(int(sh.stdout.readline()))
    pids.append(subprocess.Popen(["sleep", "1000"], process_group=0).pid)
    with open(pidfile, "w") as f:
        f.write(" ".join(map(str, pids)))
    {tail}
"""


def test_timeout_kills_whole_tree(tmp_path):
    pidfile = tmp_path / "pids"
    script = write_script(tmp_path, "h.py", SPAWNER.format(tail="time.sleep(1000)"))
    task = Task(task_id="t", instruction="x", evaluator=EvaluatorSpec("python", lambda ws, t: 0.5),
                harness=[sys.executable, str(script), str(pidfile)], timeout_s=1.5)
    runner = make_runner(tmp_path)

    async def main():
        t = runner.dispatch(spec(task, "e0"))
        return await t

    res = run(main())
    assert res.outcome is Outcome.TIMED_OUT
    assert 1.4 < res.wall_s < 15.0  # the limit, plus the kill on a loaded machine
    pids = [int(p) for p in pidfile.read_text().split()]
    assert len(pids) == 5
    assert wait_dead(pids) == [], "orphans left behind"
    # A timed-out execution is evaluated (partial progress counts), not a placeholder.
    assert res.reward.status is RewardStatus.VALID and res.reward.reward == 0.5


def test_exit_leaving_background_children_kills_them(tmp_path):
    pidfile = tmp_path / "pids"
    script = write_script(tmp_path, "h.py", SPAWNER.format(tail="sys.exit(0)"))
    task = Task(task_id="t", instruction="x", evaluator=EvaluatorSpec("python", lambda ws, t: 1.0),
                harness=[sys.executable, str(script), str(pidfile)], timeout_s=30)
    res = run(_one(make_runner(tmp_path), task))
    assert res.outcome is Outcome.COMPLETED and res.exit_code == 0
    pids = [int(p) for p in pidfile.read_text().split()]
    assert wait_dead(pids) == []


async def _one(runner, task, eid="e0"):
    return await runner.dispatch(spec(task, eid))


def test_crash_gets_placeholder_and_evaluate_policy(tmp_path):
    script = write_script(tmp_path, "crash.py", """
        import os, signal, sys
        open("progress.txt", "w").write("half")
        if sys.argv[1] == "exit":
            sys.exit(3)
        os.kill(os.getpid(), signal.SIGSEGV)
    """)
    calls = []

    def ev(ws, task):
        calls.append(ws)
        return 0.5 if (ws / "progress.txt").exists() else 0.0

    for mode, want_rc in (("exit", 3), ("signal", -11)):
        task = Task(task_id=f"c{mode}", instruction="x", evaluator=EvaluatorSpec("python", ev),
                    harness=[sys.executable, str(script), mode])
        res = run(_one(make_runner(tmp_path / mode), task))
        assert res.outcome is Outcome.CRASHED and res.exit_code == want_rc
        assert res.reward.status is RewardStatus.PLACEHOLDER and res.reward.reward == 0.0
    assert calls == []  # placeholder: the evaluator is not consulted
    res = run(_one(make_runner(tmp_path / "ev", evaluator_cfg={"on_crash": "evaluate"}), task))
    assert res.outcome is Outcome.CRASHED
    assert res.reward.status is RewardStatus.VALID and res.reward.reward == 0.5


def test_launch_failure_is_placeholder_and_counted(tmp_path):
    task = Task(task_id="t", instruction="x", evaluator=EvaluatorSpec("python", lambda ws, t: 1.0),
                harness=[str(tmp_path / "no-such-harness")])
    runner = make_runner(tmp_path)
    res = run(_one(runner, task))
    assert res.outcome is Outcome.LAUNCH_FAILED and "no-such-harness" in res.error
    assert res.reward.status is RewardStatus.PLACEHOLDER and res.reward.reward == 0.0
    assert runner.counters.snapshot() == (1, 0, 1)
    # missing template directory is a launch failure too, naming the path
    bad = Task(task_id="u", instruction="x", evaluator=EvaluatorSpec("python", lambda ws, t: 1.0),
               harness=[sys.executable, "-c", "pass"], workspace=str(tmp_path / "missing-template"))
    res = run(_one(make_runner(tmp_path / "b"), bad))
    assert res.outcome is Outcome.LAUNCH_FAILED and "missing-template" in res.error


def test_workspaces_are_separate_and_env_points_at_proxy(tmp_path, monkeypatch):
    monkeypatch.setenv("GYRE_TEST_CONTROLLER_SECRET", "do-not-leak")
    template = tmp_path / "template"
    (template / "sub").mkdir(parents=True)
    (template / "sub" / "shared.txt").write_text("template\n")
    script = write_script(tmp_path, "ws.py", """
        import json, os
        with open("sub/shared.txt", "a") as f:
            f.write(os.environ["GYRE_EXECUTION_ID"] + "\\n")
        keys = ["OPENAI_BASE_URL", "OPENAI_API_KEY", "ANTHROPIC_BASE_URL", "ANTHROPIC_API_KEY", "GYRE_MODEL",
                "OPENAI_MODEL", "ANTHROPIC_MODEL", "GYRE_WORKSPACE", "GYRE_TEST_CONTROLLER_SECRET", "GYRE_TASK_ID"]
        env = {k: os.environ.get(k) for k in keys}
        env["cwd"] = os.getcwd()
        env["instruction"] = open(os.environ["GYRE_INSTRUCTION_FILE"]).read()
        json.dump(env, open("env.json", "w"))
    """)
    task = Task(task_id="ws", instruction="fill the files", evaluator=EvaluatorSpec("python", lambda ws, t: 1.0),
                harness=["{python}", str(script)], workspace=str(template), files={"inline/a.txt": "A"})
    keys = LocalKeys(url="http://127.0.0.1:4321")
    runner = HarnessRunner(RunnerConfig(run_dir=str(tmp_path / "runs"), model_name="policy-x"), None, keys)

    async def main():
        return await asyncio.gather(*[runner.dispatch(spec(task, f"e{i}", index=i)) for i in range(4)])

    results = run(main())
    seen_keys = set()
    for i, res in enumerate(results):
        assert res.outcome is Outcome.COMPLETED
        ws = res.workspace
        assert (ws / "sub" / "shared.txt").read_text() == f"template\ne{i}\n"
        assert (ws / "inline" / "a.txt").read_text() == "A"
        env = json.loads((ws / "env.json").read_text())
        assert env["cwd"] == str(ws) == env["GYRE_WORKSPACE"]
        assert env["OPENAI_BASE_URL"] == "http://127.0.0.1:4321/v1"
        assert env["ANTHROPIC_BASE_URL"] == "http://127.0.0.1:4321"
        assert env["OPENAI_API_KEY"] == env["ANTHROPIC_API_KEY"] and env["OPENAI_API_KEY"].startswith("gyre-")
        seen_keys.add(env["OPENAI_API_KEY"])
        assert env["GYRE_MODEL"] == env["OPENAI_MODEL"] == env["ANTHROPIC_MODEL"] == "policy-x"
        assert env["GYRE_TEST_CONTROLLER_SECRET"] is None
        assert env["instruction"] == "fill the files"
        assert (res.exec_dir / "stdout.log").exists() and (res.exec_dir / "result.json").exists()
        assert json.loads((res.exec_dir / "result.json").read_text())["outcome"] == "completed"
        assert res.exec_dir.parent == tmp_path / "runs"
    assert len(seen_keys) == 4  # one key per execution
    assert keys.keys == {}  # every key revoked at the end
    assert (template / "sub" / "shared.txt").read_text() == "template\n"  # template untouched


def test_stdout_stderr_captured(tmp_path):
    task = Task(task_id="io", instruction="x", evaluator=EvaluatorSpec("python", lambda ws, t: 1.0),
                harness=[sys.executable, "-c", "import sys; print('to-out'); print('to-err', file=sys.stderr); sys.exit(0)"])
    res = run(_one(make_runner(tmp_path), task))
    assert (res.exec_dir / "stdout.log").read_text() == "to-out\n"
    assert (res.exec_dir / "stderr.log").read_text() == "to-err\n"


def test_counters_under_concurrency(tmp_path):
    """12 executions, at most 3 at once: d ≥ p ≥ f at every event, p − f ≤ 3, the harnesses'
    own clocks never overlap more than 3, and the counts end at 12/12/12."""
    script = write_script(tmp_path, "sl.py", """
        import os, sys, time
        t0 = time.time()
        time.sleep(float(sys.argv[1]))
        open(os.path.join(sys.argv[2], os.environ["GYRE_EXECUTION_ID"]), "w").write(f"{t0} {time.time()}")
    """)
    stamps = tmp_path / "stamps"
    stamps.mkdir()
    events = []
    cfg = RunnerConfig(run_dir=str(tmp_path / "runs"), max_concurrency=3, sandbox="none")  # stamps outside the workspace
    runner = HarnessRunner(cfg, Evaluator(EvaluatorConfig(retry_backoff_s=0)), on_event=events.append)
    durations = [0.05, 0.4, 0.1, 0.3, 0.05, 0.2, 0.15, 0.05, 0.35, 0.1, 0.25, 0.05]

    async def main():
        tasks = []
        for i, d in enumerate(durations):
            task = Task(task_id=f"t{i}", instruction="x", evaluator=EvaluatorSpec("python", lambda ws, t: 1.0),
                        harness=[sys.executable, str(script), str(d), str(stamps)])
            tasks.append(runner.dispatch(spec(task, f"e{i}")))
        assert runner.counters.dispatched == 12  # counted at dispatch, before any start
        return await asyncio.gather(*tasks)

    results = run(main())
    assert all(r.outcome is Outcome.COMPLETED for r in results)
    for ev in events:
        d, p, f = ev.counters
        assert d >= p >= f and p - f <= 3
    assert runner.counters.snapshot() == (12, 12, 12)
    by_kind = {k: [e for e in events if e.kind is k] for k in EventKind}
    assert all(len(v) == 12 for v in by_kind.values())
    q_kinds = []
    while not runner.events.empty():
        q_kinds.append(runner.events.get_nowait().kind)
    assert len(q_kinds) == 48
    # per execution, events come in lifecycle order
    for i in range(12):
        kinds = [e.kind for e in events if e.execution_id == f"e{i}"]
        assert kinds == [EventKind.DISPATCHED, EventKind.STARTED, EventKind.FINISHED, EventKind.EVALUATED]
    spans = [tuple(map(float, (stamps / f"e{i}").read_text().split())) for i in range(12)]
    points = sorted([(s, 1) for s, _ in spans] + [(e, -1) for _, e in spans], key=lambda x: (x[0], x[1]))
    level = peak = 0
    for _, delta in points:
        level += delta
        peak = max(peak, level)
    assert peak <= 3
    assert peak >= 2  # the limit was actually exercised


def test_shutdown_cancels_and_still_evaluates(tmp_path):
    script = write_script(tmp_path, "slow.py", "import time\nopen('started', 'w').write('1')\ntime.sleep(1000)\n")
    task = Task(task_id="s", instruction="x", harness=[sys.executable, str(script)],
                evaluator=EvaluatorSpec("python", lambda ws, t: 1.0 if (ws / "started").exists() else 0.0))
    runner = make_runner(tmp_path, max_concurrency=1)

    async def main():
        ts = [runner.dispatch(spec(task, f"e{i}")) for i in range(3)]
        for _ in range(200):
            if runner.counters.started == 1 and (tmp_path / "runs" / "e0" / "workspace" / "started").exists():
                break
            await asyncio.sleep(0.02)
        await runner.shutdown()
        return [t.result() for t in ts]

    results = run(main())
    assert [r.outcome for r in results] == [Outcome.CANCELLED] * 3
    assert results[0].exit_code is not None and results[0].reward.reward == 1.0
    assert results[1].exit_code is None  # never started
    assert runner.counters.snapshot() == (3, 1, 3)


def test_illegal_transition_raises():
    task = Task(task_id="x", instruction="x", evaluator=EvaluatorSpec("python", lambda ws, t: 1.0))
    live = _Live(spec(task, "e"))
    with pytest.raises(RuntimeError, match="DISPATCHED → EVALUATED"):
        live.move(ExecutionPhase.EVALUATED)
    live.move(ExecutionPhase.STARTED)
    with pytest.raises(RuntimeError, match="STARTED → STARTED"):
        live.move(ExecutionPhase.STARTED)


def test_duplicate_dispatch_rejected(tmp_path):
    task = Task(task_id="x", instruction="x", evaluator=EvaluatorSpec("python", lambda ws, t: 1.0),
                harness=[sys.executable, "-c", "pass"])
    runner = make_runner(tmp_path)

    async def main():
        t = runner.dispatch(spec(task, "e"))
        with pytest.raises(ValueError, match="already dispatched"):
            runner.dispatch(spec(task, "e"))
        await t

    run(main())


def test_remote_mode_plumbing_with_local_shell(tmp_path):
    """Remote mode with a stand-in for ssh/rsync (bash on this host): the workspace goes out,
    the harness runs in the remote copy with the env, and the result comes back to be scored."""
    remote_root = tmp_path / "remote"
    script = write_script(tmp_path, "r.py", """
        import os
        open("out.txt", "w").write(os.getcwd() + "|" + os.environ["OPENAI_API_KEY"][:5] + "|" + os.environ["GYRE_INSTRUCTION"])
    """)
    cfg = RunnerConfig(
        run_dir=str(tmp_path / "runs"), sandbox_hosts=["hostA", "hostB"],
        remote_shell=["bash", "-c"], remote_root=str(remote_root),
        remote_push=["bash", "-c", "mkdir -p {remote} && cp -a {local}/. {remote}/ && echo {host} > {remote}/.host"],
        remote_pull=["bash", "-c", "cp -a {remote}/. {local}/"],
    )
    task = Task(task_id="r", instruction="remote hello", harness=[sys.executable, str(script)],
                evaluator=EvaluatorSpec("python", lambda ws, t: 1.0 if (ws / "out.txt").exists() else 0.0))
    runner = HarnessRunner(cfg, Evaluator(EvaluatorConfig()))

    async def main():
        return await asyncio.gather(*[runner.dispatch(spec(task, f"e{i}")) for i in range(2)])

    results = run(main())
    assert {r.host for r in results} == {"hostA", "hostB"}
    for r in results:
        assert r.outcome is Outcome.COMPLETED and r.reward.reward == 1.0
        cwd, key, instr = (r.workspace / "out.txt").read_text().split("|")
        assert cwd == str(remote_root / r.execution_id / "workspace")
        assert key == "gyre-" and instr == "remote hello"
        assert (r.workspace / ".host").read_text().strip() == r.host


def test_gyre_proxy_access_sums_closed_executions_and_puts_each_call_count_in_the_ledger():
    """The controller's totals (summary.json: calls, aborted_calls, ...; the rows' unmatched turns)
    and each execution's calls and unwritten records (the health check, the TITO completeness
    check) come from what the proxy reports when an execution closes; the latter live in the
    execution's ledger record, the one place the controller reads them."""
    from gyre.executions.tasks import ExecutionSpec, Group
    from gyre.runtime.ledger import LedgerError, RunLedger

    from gyre.proxy.state import CallStats

    closing = {"e0": CallStats(calls=3, aborted_calls=1, spliced_turns=2, unmatched_turns=1, roles={"MAIN": 3}),
               "e1": CallStats(calls=2, unmatched_turns=2, sink_errors=1, inflight=1),
               "e2": CallStats()}

    class Proxy:
        def issue_key(self, execution_id):
            return f"key-{execution_id}"

        def close_execution(self, execution_id):
            return closing.pop(execution_id)

    task = Task(task_id="t", instruction="x", evaluator=EvaluatorSpec("python", lambda ws, t: 1.0), harness=["true"])
    ledger = RunLedger(num_cells=1)
    ledger.add_group(0, Group("g", task, [ExecutionSpec(f"e{i}", task, "g", i) for i in range(3)]), version=0)
    access = GyreProxyAccess(Proxy(), "http://127.0.0.1:9/", ledger)
    assert access.url == "http://127.0.0.1:9" and access.open_execution("e0", "g") == "key-e0"
    access.close_execution("e0")
    assert access.take_unmatched() == 1 and access.take_unmatched() == 0
    access.close_execution("e1")
    access.close_execution("e2")  # never called the model: closed with nothing counted
    assert dict(access.totals) == {"calls": 5, "aborted_calls": 1, "spliced_turns": 2, "unmatched_turns": 3,
                                   "tolerated_turns": 0, "reroutes": 0, "sink_errors": 1, "inflight": 1}
    assert access.take_unmatched() == 2
    assert [(e.calls, e.sink_errors) for e in ledger.executions.values()] == [(3, 0), (2, 1), (0, 0)]
    assert access.calls_made("e0") == 3 and access.calls_made("e2") == 0
    with pytest.raises(LedgerError, match="unknown execution"):
        access.calls_made("never-dispatched")
    assert GyreProxyAccess(Proxy(), "http://x").calls_made("e0") is None  # no ledger: unknown, as LocalKeys
