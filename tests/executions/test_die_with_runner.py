"""Harness trees die with the process that runs them, however it ends: a rank SIGKILLed (OOM, a
forced stop, torchrun's SIGKILL after its shutdown timeout) leaves no harness process behind,
neither the harness nor its background children, under every local sandbox that works here.
(Before PR_SET_PDEATHSIG and the `none` reaper, every harness outlived a killed runner.)"""

import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from gyre.executions.sandbox import bwrap_works

ROOT = Path(__file__).resolve().parents[2]

RUNNER = textwrap.dedent("""
    import asyncio, sys
    from gyre.executions.config import RunnerConfig
    from gyre.executions.runner import HarnessRunner
    from gyre.executions.tasks import EvaluatorSpec, ExecutionSpec, Task

    run_dir, sandbox, marker = sys.argv[1], sys.argv[2], sys.argv[3]
    async def main():
        runner = HarnessRunner(RunnerConfig(run_dir=run_dir, sandbox=sandbox, timeout_s=3600))
        argv = ["/bin/sh", "-c", f"sleep {marker}1 & sleep {marker}2 & exec sleep {marker}3"]
        for i in range(2):
            runner.dispatch(ExecutionSpec(execution_id=f"e{i}", task=Task(task_id="t", instruction="x", harness=argv,
                                                                    evaluator=EvaluatorSpec("command", ["true"])),
                                          group_id="g", index=i))
        print("dispatched", flush=True)
        await asyncio.sleep(3600)
    asyncio.run(main())
""")


def _marked(marker: str) -> list[int]:
    """Pids of the `sleep`s whose argument is `marker` (found by /proc, across pid namespaces)."""
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                cmd = Path(f"/proc/{name}/cmdline").read_bytes().decode(errors="replace").split("\0")
                state = Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if cmd[0].endswith("sleep") and any(a.startswith(marker) for a in cmd[1:]) and state not in ("Z", "X"):
                out.append(int(name))
    return out


@pytest.mark.parametrize("sandbox", ["none", "bwrap"])
def test_a_killed_runner_takes_every_harness_process_with_it(tmp_path, sandbox):
    if sandbox == "bwrap" and not bwrap_works():
        pytest.skip("bubblewrap does not work on this machine")
    marker = f"{3000 + uuid.uuid4().int % 1000}.{uuid.uuid4().int % 10**6:06d}"  # a unique `sleep` argument
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", RUNNER, str(tmp_path / "runs"), sandbox, marker], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while len(_marked(marker)) < 6 and time.monotonic() < deadline:  # 2 harnesses × 3 sleeps
            time.sleep(0.1)
        assert len(_marked(marker)) == 6, proc.stderr.read() if proc.poll() is not None else _marked(marker)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    deadline = time.monotonic() + 5
    while _marked(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = _marked(marker)
    for pid in left:  # do not leave them to the next test
        os.kill(pid, signal.SIGKILL)
    assert left == [], f"{len(left)} harness processes outlived the killed runner"


def test_the_reaper_runs_a_harness_named_relative_to_its_workspace_and_passes_its_status_on(tmp_path):
    import asyncio

    from gyre.executions import sandbox
    from gyre.executions.config import RunnerConfig

    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "run.sh").write_text("#!/bin/sh\nexit 3\n")
    (ws / "run.sh").chmod(0o755)
    prep = lambda argv: asyncio.run(sandbox.prepare("none", cfg=RunnerConfig(kill_grace_s=1.0), execution_id="e", exec_dir=tmp_path,  # noqa: E731
                                                    ws=ws, argv=argv, env={"PATH": os.defpath}))
    launch = prep(["./run.sh"])
    rc = subprocess.run(launch.argv, cwd=launch.cwd, env=launch.env).returncode
    assert launch.exit_code(rc) == 3
    killed = prep(["/bin/sh", "-c", "kill -9 $$"])
    assert killed.exit_code(subprocess.run(killed.argv, cwd=killed.cwd, env=killed.env).returncode) == -9
    with pytest.raises(FileNotFoundError, match="nope.sh"):
        prep(["./nope.sh"])  # a launch failure, as without the reaper
