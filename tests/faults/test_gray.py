"""A frozen rank (issue 19, finding 4): SIGSTOP on cell 1's only rank while harnesses call the model.

What the design says (docs/design.md §1, §3): an engine that stops producing tokens is handled
like a drained one: each of its calls continues on another engine from the tokens it has within
`--proxy.engine-progress-timeout-s`, and it gets no new calls while it fails its health check,
so no harness waits out its own timeout. A rank that owes the controller an answer and says
nothing for `--train.control-timeout-s` cannot be stopped cleanly (it may hold a collective), so
the run fails with an error naming it, after the usual failure path: harnesses killed, the
other ranks stopped, the core's checkpoint, summary, events. When the frozen rank thaws after
that, it finds its queued `Load`s behind a `Stop`: it skips them (their snapshots are gone with
the core) and stops, instead of crashing on an evicted snapshot.
"""

import json
import os
import signal
import time
from pathlib import Path

import pytest

from tests.jobs import RUNS, reap, start, tiny_task, wait_for, write_task_rows

pytestmark = [pytest.mark.multirank, pytest.mark.jobs]

PROGRESS_S, CONTROL_S = 3.0, 15.0


def _rank_pid(torchrun: int, rank: int) -> int | None:
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                stat = Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()
                env = Path(f"/proc/{name}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if int(stat[1]) == torchrun and f"RANK={rank}".encode() in env:
                return int(name)
    return None


def test_a_frozen_engine_rank_loses_its_calls_in_time_and_is_named(tmp_path):
    tasks = write_task_rows(tmp_path / "tasks.jsonl", [tiny_task(8, 16)] * 4)
    run = tmp_path / "run"
    cmd = RUNS["gray"].command(tasks, run, "--proxy.engine-progress-timeout-s", str(PROGRESS_S),
                               "--train.control-timeout-s", str(CONTROL_S))
    proc = start(cmd, tmp_path, tmp_path / "log.txt")
    log = lambda: (tmp_path / "log.txt").read_text()  # noqa: E731
    frozen = None
    try:
        wait_for(lambda: (run / "metrics.jsonl").exists() and (run / "metrics.jsonl").read_text().strip(), 240, proc,
                 "step 0")
        frozen = _rank_pid(proc.pid, 1)
        assert frozen is not None
        os.kill(frozen, signal.SIGSTOP)
        t0 = time.monotonic()
        wait_for(lambda: (run / "summary.json").exists(), CONTROL_S + 120, proc, "the summary")
        named_after = time.monotonic() - t0
        time.sleep(1.0)
        os.kill(frozen, signal.SIGCONT)  # thawed after the job ended: its queue holds Loads and a Stop
        rc = proc.wait(120)
    finally:
        if frozen is not None:
            try:
                os.kill(frozen, signal.SIGCONT)
            except OSError:
                pass
        reap(proc, str(run))
    text = log()
    summary = json.loads((run / "summary.json").read_text())
    assert rc != 0
    assert summary["silent_rank"] == 1 and "rank 1 has sent nothing" in summary["error"], summary["error"]
    assert named_after < CONTROL_S + 60, named_after
    # The frozen engine's calls moved on within the progress limit: none failed, no harness timed out.
    assert summary["engine_stalls"] >= 1 and summary["reroutes"] >= 1, text[-4000:]
    assert f"engine cell1 sent no token for {PROGRESS_S:.1f}s" in text
    assert summary["aborted_calls"] == 0 and "timed_out" not in summary["execution_outcomes"]
    assert summary["execution_outcomes"].get("crashed", 0) == 0
    assert summary["incomplete_tito"] == {} and summary["sink_errors"] == 0  # every record of every call written
    # The core checkpointed at the last step's version; the thawed rank stopped without touching evicted snapshots.
    rows = (run / "metrics.jsonl").read_text().splitlines()
    assert (run / "checkpoints" / f"step_{len(rows):06d}" / "gyre_actor.json").exists()
    assert summary["ranks_not_stopped"] == [1]
    assert "queued loads" in text and "skipped: a Stop follows them" in text, text[-4000:]
    assert "rank 1: stopped early by the controller" in text and "rank 1 failed" not in text, text[-4000:]
