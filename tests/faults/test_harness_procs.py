"""Harness processes in a real job under `--executions.runner.sandbox none` (issue 36, items 2, 5).

One job (torchrun, 2 gloo ranks, unsandboxed: what `auto` falls back to without bubblewrap):

* group 0: two harnesses that each leave 200 daemons (setsid + double fork: 400 in all) and
  write 100 kB of stdout under a 4 KiB log cap, then make their model call and exit 0. When
  step 0's row is written, the 400 daemons are gone (before: 266 of 400 outlived even the job),
  and each stdout.log is within the cap plus one marker line that names the flag;
* group 1: two sleeper harnesses that never end. torchrun is then SIGKILLed (alone, as an
  operator or a node agent would): its ranks die within 2 s and no harness process is left
  (before: ranks and harnesses lived on 5–20 s, beside a relaunch).
"""

import json
import os
import signal
import sys
import time
import uuid

import pytest

from tests.jobs import AWK_EVALUATOR, FAULTS, RUNS, SLEEPER, marked, reap, start, wait_for, write_task_rows

pytestmark = [pytest.mark.multirank, pytest.mark.jobs]

CAP = 4096


def _children(pid: int) -> list[int]:
    try:
        return [int(p) for p in open(f"/proc/{pid}/task/{pid}/children").read().split()]
    except OSError:
        return []


def _daemons(marker: str) -> list[int]:
    """Live `sleep MARKER` processes: the detach harness's daemons (not the sleepers' children)."""
    want, out = b"sleep\0" + marker.encode() + b"\0", []
    for p in marked(marker):
        try:
            if open(f"/proc/{p}/cmdline", "rb").read() == want:
                out.append(p)
        except OSError:
            pass
    return out


def _alive(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def test_daemons_die_with_their_execution_logs_are_capped_and_a_killed_torchrun_takes_everything(tmp_path):
    marker = f"{5000 + uuid.uuid4().int % 1000}.{uuid.uuid4().int % 10**6:06d}"  # a `sleep` argument
    detach = {"harness": [sys.executable, str(FAULTS / "detach_harness.py"), marker, "200", "tiny", "100000"],
              "evaluator": {"command": AWK_EVALUATOR}}
    sleeper = {"harness": [sys.executable, str(SLEEPER), marker], "evaluator": {"command": AWK_EVALUATOR}}
    tasks = write_task_rows(tmp_path / "tasks.jsonl", [detach, sleeper, sleeper, sleeper])
    run = tmp_path / "run"
    cmd = RUNS["harness_procs"].command(tasks, run, "--executions.runner.log-cap-bytes", str(CAP))
    proc = start(cmd, tmp_path, tmp_path / "log.txt")
    log = lambda: (tmp_path / "log.txt").read_text()[-6000:]  # noqa: E731
    g0 = [run / "executions" / f"t0.a0.g0.{i}" for i in range(2)]
    g1 = [run / "executions" / f"t1.a0.g1.{i}" for i in range(2)]
    try:
        wait_for(lambda: (run / "metrics.jsonl").is_file() and (run / "metrics.jsonl").read_text().strip(), 240, proc,
                 "step 0's row")
        wait_for(lambda: all((d / "workspace" / "called").exists() for d in g1), 120, proc, "group 1's calls")
        left = _daemons(marker)
        ranks = _children(proc.pid)
        assert len(ranks) == 2, ranks
        os.kill(proc.pid, signal.SIGKILL)  # torchrun alone, not its process group
        proc.wait()
        t0 = time.monotonic()
        while (any(map(_alive, ranks)) or marked(marker)) and time.monotonic() - t0 < 10:
            time.sleep(0.05)
        gone_s = time.monotonic() - t0
        survivors = [p for p in ranks if _alive(p)] + marked(marker)
    finally:
        reap(proc, marker)
        for p in _children(proc.pid):
            os.kill(p, signal.SIGKILL)
    # Group 0: every daemon was alive outside its harness's session, and none outlived its execution.
    for d in g0:
        result = json.loads((d / "result.json").read_text())
        assert result["outcome"] == "completed", result
        assert json.loads((d / "workspace" / "daemons.json").read_text())["alive_elsewhere"] == 200
        out = (d / "stdout.log").read_bytes()
        assert CAP < len(out) <= CAP + 200 and out.endswith(b"THE END\n"), (len(out), out[-300:])
        assert out.count(b"--executions.runner.log-cap-bytes") == 1
    assert left == [], f"{len(left)} of 400 daemons outlived their executions\n{log()}"
    # The killed torchrun: ranks and harnesses gone at once.
    assert survivors == [] and gone_s < 2.0, (survivors, gone_s)
    assert "torchrun (pid" in log() and "is gone" in log()
