"""A scheduler death in a rank's SGLang engine is a diagnosed failure, not a core dump (issue 30
item 2). SGLang's scheduler SIGQUITs its parent when it fails (managers/scheduler.py:6373); its own
handler is installed only when the engine starts on the main thread (entrypoints/engine.py:1969-1992),
and Gyre starts it on the engine server's thread: without the job's watch the rank died of
SIGQUIT's default action (returncode -3). Run in a real process (tests/runtime/engine_sigquit_rank.py):
the rank's command loop, the adapter over the conformance fake, whose scheduler dies as SGLang's does.
"""

from __future__ import annotations

import json
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _rank(tmp_path: Path, crash_on: str, commands: str) -> tuple[int, list[dict], str]:
    def no_core() -> None:  # SIGQUIT's default action dumps core: not into the test's directory
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    proc = subprocess.run([sys.executable, "-m", "tests.runtime.engine_sigquit_rank", str(tmp_path), crash_on, commands],
                          cwd=ROOT, capture_output=True, text=True, timeout=120, preexec_fn=no_core)
    lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    return proc.returncode, lines, proc.stdout + proc.stderr


@pytest.mark.parametrize("crash_on, commands, command", [
    ("ReleaseMemoryOccupationReqInput", "ToTrain", "ToTrain"),  # e.g. the idle assertion
    ("ResumeMemoryOccupationReqInput", "ToTrain,ToRollout", "ToRollout"),  # e.g. an OOM on resume
    ("_SReq", "", "no command (it was waiting for one)"),  # a kernel error serving a call, between commands
])
def test_a_scheduler_death_is_the_ranks_diagnosed_failure(tmp_path, crash_on, commands, command):
    rc, lines, log = _rank(tmp_path, crash_on, commands)
    assert rc != -signal.SIGQUIT, f"the rank died of SIGQUIT, undiagnosed:\n{log[-3000:]}"
    assert rc == 1, log[-3000:]
    failed = [x for x in lines if x["type"] == "Failed"]
    assert len(failed) == 1, lines  # reported once, to the controller
    f = failed[0]
    assert f["command"] == command and f["rank"] == 0
    # Names the engine, and its last log lines hold the scheduler's own words (the fake logs them as
    # SGLang's scheduler does, scheduler.py:6372, then signals).
    assert f["error"].startswith("EngineDied: engine rank0 (sglang) died"), f["error"]
    assert "Scheduler hit an exception" in f["error"] and f"fails handling {crash_on}" in f["error"], f["error"]
    assert lines[-1] == {"type": "exit", "error": "WorkerFailed: rank 0 failed"}


def test_the_watch_raises_once_names_the_engine_and_leaves_no_trace(caplog):
    """In this process (pytest's main thread): the first SIGQUIT is EngineDied with the engine's
    last log lines, a later one (another TP scheduler, the watchdog) is logged only, none while
    the engine stops; uninstall puts the previous handler back and stops collecting log lines."""
    import logging
    import os
    import time

    from gyre.backends.engines.engine_host import SigquitWatch
    from gyre.errors import EngineDied

    def quit_and_wait() -> None:
        os.kill(os.getpid(), signal.SIGQUIT)
        time.sleep(0.2)  # the handler runs on this (main) thread at the next check

    before = signal.getsignal(signal.SIGQUIT)
    watch = SigquitWatch("rank4 (sglang)", lines=3)
    assert watch.install()
    try:
        logging.getLogger("sglang.srt.managers.scheduler").error("Scheduler hit an exception: line 1\nline 2\nOOM")
        logging.getLogger("unrelated").error("not the engine's")
        with pytest.raises(EngineDied) as e:
            quit_and_wait()
        assert str(e.value).startswith("engine rank4 (sglang) died")
        # the last 3 lines, of the engine's loggers only
        assert str(e.value).endswith("ERROR sglang.srt.managers.scheduler: Scheduler hit an exception: line 1\n"
                                     "    line 2\n    OOM"), str(e.value)
        quit_and_wait()  # the second: logged, not raised
        assert "SIGQUIT again" in caplog.text
    finally:
        watch.uninstall()
    assert signal.getsignal(signal.SIGQUIT) == before
    logging.getLogger("sglang").error("after")
    assert "after" not in "\n".join(watch.tail.lines)

    stopping = SigquitWatch("rank0 (sglang)")
    stopping.install()
    try:
        stopping.stopping = True
        quit_and_wait()  # the engine's own processes ended by its stop: no failure
    finally:
        stopping.uninstall()


def test_the_watch_is_not_installed_off_the_main_thread():
    import threading

    from gyre.backends.engines.engine_host import SigquitWatch

    before, out = signal.getsignal(signal.SIGQUIT), []
    t = threading.Thread(target=lambda: out.append(SigquitWatch("x").install()))
    t.start()
    t.join()
    assert out == [False] and signal.getsignal(signal.SIGQUIT) == before
