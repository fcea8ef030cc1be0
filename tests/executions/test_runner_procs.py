"""Harness processes under `--executions.runner.sandbox none` (issue 36, items 2, 5, 7), with the
real runner and real processes:

* 400 daemons (setsid + double fork) a harness leaves are all gone when its execution ends,
  whether it exited or was stopped (before the CONTAIN subreaper: 266 of 400 outlived the job);
* a harness that writes far more than `log_cap_bytes` completes, and its log keeps head, a
  marker naming the cap, and tail (before: 1 GB of stdout accepted);
* a rank whose torchrun-like parent is SIGKILLed dies at once, with its harnesses' daemons
  (before: 5–20 s, beside a relaunch);
* a harness killed from outside before its first model call is excluded from its group, not
  evaluated to a valid 0 (before: a valid 0.0 that dragged its group's baseline).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from gyre.executions import logcap
from gyre.executions.config import EvaluatorConfig, RunnerConfig
from gyre.executions.evaluator import Evaluator, Outcome, RewardStatus
from gyre.proxy.state import CallStats
from gyre.executions.health import classify
from gyre.executions.runner import HarnessRunner
from gyre.executions.tasks import EvaluatorSpec, Group, Task
from gyre.runtime.ledger import RunLedger
from gyre.runtime.proxy_access import GyreProxyAccess
from gyre.runtime.samples import outcome
from tests.executions.helpers import spec, write_script
from tests.jobs import marked

ROOT = Path(__file__).resolve().parents[2]
DETACH = ROOT / "tests" / "faults" / "detach_harness.py"

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux process tree")


def _marker() -> str:
    """A unique `sleep` argument: seconds, so `sleep MARKER` runs (for about 5000 s)."""
    return f"{5000 + uuid.uuid4().int % 1000}.{uuid.uuid4().int % 10**6:06d}"


def _gone(marker: str, timeout: float = 3.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while marked(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = marked(marker)
    for pid in left:  # never leave them to the next test
        os.kill(pid, signal.SIGKILL)
    return left


def _runner(tmp_path: Path, proxy=None, **kw) -> HarnessRunner:
    cfg = RunnerConfig(run_dir=str(tmp_path / "runs"), sandbox="none", kill_grace_s=kw.pop("kill_grace_s", 0.5), **kw)
    return HarnessRunner(cfg, Evaluator(EvaluatorConfig(retry_backoff_s=0.0, timeout_s=10)), proxy)


def _one(runner: HarnessRunner, task: Task, eid: str = "e0"):
    async def main():
        return await runner.dispatch(spec(task, eid))
    return asyncio.run(main())


@pytest.mark.parametrize("then", ["exit", "hang"])
def test_400_double_forked_daemons_die_with_their_execution(tmp_path, then):
    """exit: the harness exits 0 leaving them; hang: the run stops it (the runner's SIGTERM, grace, SIGKILL)."""
    marker = _marker()
    task = Task(task_id="t", instruction="x", evaluator=EvaluatorSpec("command", ["echo", "1"]),
                harness=[sys.executable, str(DETACH), marker, "400", then], timeout_s=300)
    runner = _runner(tmp_path)

    async def main():
        t = runner.dispatch(spec(task, "e0"))
        if then == "hang":
            while not (runner.run_dir / "e0" / "workspace" / "daemons.json").exists():
                await asyncio.sleep(0.1)
            await runner.shutdown()
        return await t

    try:
        res = asyncio.run(main())
    finally:
        left = _gone(marker)
    spawned = json.loads((res.workspace / "daemons.json").read_text())
    assert spawned["alive_elsewhere"] == 400  # all 400 ran, in sessions of their own
    assert res.outcome is (Outcome.COMPLETED if then == "exit" else Outcome.CANCELLED), res
    assert left == [], f"{len(left)} of 400 daemons outlived their execution"
    assert res.reward.status is RewardStatus.VALID  # evaluated as before


def test_a_harness_writing_past_the_log_cap_completes_and_its_log_keeps_head_marker_and_tail(tmp_path):
    cap = 64 * 1024
    script = write_script(tmp_path, "chatty.py", """
        import os, sys
        os.write(1, b"FIRST LINE\\n")
        for i in range(40000):  # ~3.4 MB, 50x the cap: blocks forever if nobody drains the pipe
            os.write(1, b"line %06d of a chatty harness, and more words here\\n" % i)
            if i % 1000 == 0:
                os.write(2, b"e" * 4000)
        os.write(1, b"LAST LINE\\n")
        open("done", "w").close()
    """)
    task = Task(task_id="t", instruction="x", harness=[sys.executable, str(script)], timeout_s=60,
                evaluator=EvaluatorSpec("python", lambda ws, t: 1.0 if (ws / "done").exists() else 0.0))
    res = _one(_runner(tmp_path, log_cap_bytes=cap), task)
    assert res.outcome is Outcome.COMPLETED and res.reward.reward == 1.0, res
    out = (res.exec_dir / "stdout.log").read_bytes()
    assert cap < len(out) <= cap + 200, len(out)
    assert out.startswith(b"FIRST LINE\n") and out.endswith(b"LAST LINE\n")
    marker_line = [ln for ln in out.split(b"\n") if ln.startswith(b"[gyre: stdout.log capped")]
    assert len(marker_line) == 1 and b"--executions.runner.log-cap-bytes" in marker_line[0], marker_line
    written = len(b"FIRST LINE\n") + len(b"LAST LINE\n") + 40000 * len(b"line 000000 of a chatty harness, and more words here\n")
    dropped = int(marker_line[0].split(b"): ")[1].split()[0])
    assert dropped == written - (cap - cap // 4) - cap // 4
    err = (res.exec_dir / "stderr.log").read_bytes()
    assert cap < len(err) <= cap + 200 and err.count(b"capped at") == 1


def test_capped_log_keeps_everything_under_the_cap_and_names_a_write_error(tmp_path):
    log = logcap.CappedLog(tmp_path / "a.log", 1000)
    for _ in range(10):
        log.feed(b"x" * 99)
    log.feed(b"y" * 10)  # exactly the cap: nothing dropped, no marker
    log.close()
    assert (tmp_path / "a.log").read_bytes() == b"x" * 990 + b"y" * 10
    full = logcap.CappedLog(Path("/dev/full"), 1000, "execution e stdout.log")
    full.feed(b"z" * 5000)  # the disk is full: the feed goes on, the error is kept
    full.close()
    assert full.error and "execution e stdout.log" in full.error and "No space" in full.error
    with pytest.raises(ValueError, match="log_cap_bytes"):
        HarnessRunner(RunnerConfig(run_dir=str(tmp_path / "r"), log_cap_bytes=0))


RANK = textwrap.dedent("""
    import asyncio, sys
    from gyre.executions.config import RunnerConfig
    from gyre.executions.procs import watch_parent
    from gyre.executions.runner import HarnessRunner
    from gyre.executions.tasks import EvaluatorSpec, ExecutionSpec, Task

    watch_parent("the test's torchrun")
    run_dir, detach, marker = sys.argv[1:4]
    async def main():
        runner = HarnessRunner(RunnerConfig(run_dir=run_dir, sandbox="none", timeout_s=3600))
        task = Task(task_id="t", instruction="x", harness=[sys.executable, detach, marker, "20", "hang"],
                    evaluator=EvaluatorSpec("command", ["true"]))
        runner.dispatch(ExecutionSpec(execution_id="e0", task=task, group_id="g", index=0))
        await asyncio.sleep(3600)
    asyncio.run(main())
""")
TORCHRUN = "import subprocess, sys, time; subprocess.Popen(sys.argv[1:]); time.sleep(3600)"


def test_a_sigkilled_torchrun_takes_its_rank_and_the_harness_daemons_with_it(tmp_path):
    marker = _marker()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    agent = subprocess.Popen([sys.executable, "-c", TORCHRUN, sys.executable, "-c", RANK, str(tmp_path / "runs"),
                              str(DETACH), marker], env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        # the agent, the rank, the harness's shim, the harness and its 20 daemons
        while len(marked(marker)) < 24 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(marked(marker)) == 24, marked(marker)
        rank = int(Path(f"/proc/{agent.pid}/task/{agent.pid}/children").read_text().split()[0])
        agent.send_signal(signal.SIGKILL)
        agent.wait()
        t0 = time.monotonic()
        while Path(f"/proc/{rank}").exists() and time.monotonic() - t0 < 5:
            try:
                if Path(f"/proc/{rank}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                    break
            except OSError:
                break
            time.sleep(0.02)
        rank_s = time.monotonic() - t0
    finally:
        left = _gone(marker)
        if agent.poll() is None:
            agent.kill()
    assert rank_s < 2.0, f"the rank outlived its torchrun by {rank_s:.1f}s"
    assert left == [], f"{len(left)} processes outlived the killed torchrun"


class _Proxy:
    """The proxy's side of GyreProxyAccess: what closing an execution reports."""

    def __init__(self, calls: int) -> None:
        self.calls = calls

    def issue_key(self, execution_id):
        return f"key-{execution_id}"

    def close_execution(self, execution_id):
        return CallStats(calls=self.calls)


@pytest.mark.parametrize("calls", [0, 1])
def test_a_harness_killed_before_its_first_call_is_excluded_not_a_valid_zero(tmp_path, calls):
    script = write_script(tmp_path, "h.py", """
        import os, time
        open("pid", "w").write(str(os.getpid()))
        time.sleep(600)
    """)
    task = Task(task_id="t", instruction="x", evaluator=EvaluatorSpec("python", lambda ws, t: 0.0),
                harness=[sys.executable, str(script)], timeout_s=60)
    ledger = RunLedger(num_cells=1)  # where the controller's access keeps each execution's calls
    ledger.add_group(0, Group("g0", task, [spec(task, "e0")]), version=0)
    runner = _runner(tmp_path, proxy=GyreProxyAccess(_Proxy(calls), "http://127.0.0.1:9", ledger))

    async def main():
        t = runner.dispatch(spec(task, "e0"))
        pid_file = runner.run_dir / "e0" / "workspace" / "pid"
        while not pid_file.exists() or not pid_file.read_text():
            await asyncio.sleep(0.05)
        os.kill(int(pid_file.read_text()), signal.SIGKILL)  # from outside, as the OOM killer
        return await t

    res = asyncio.run(main())
    assert res.outcome is Outcome.KILLED
    written = json.loads((res.exec_dir / "result.json").read_text())
    if calls == 0:
        assert res.reward.status is RewardStatus.EXCLUDED and not res.reward.attempts  # not evaluated
        assert outcome(res.reward).valid is False  # out of its group's statistics and of E
        assert "before its first model call" in written["error"]
        assert written["reward"]["status"] == "excluded" and "first model call" in written["reward"]["detail"]["excluded"]
        failure = classify(res, calls)
        assert failure.reason == "no_model_calls" and "first model call" in failure.detail
    else:  # it had called the model: its workspace is evaluated, as after a timeout
        assert res.reward.status is RewardStatus.VALID and res.reward.reward == 0.0
        assert outcome(res.reward).valid is True and "first model call" not in written["error"]
