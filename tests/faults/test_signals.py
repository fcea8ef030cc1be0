"""Ctrl-C, scancel and Slurm preemption stop a run gracefully (issue 19, finding 3).

A real job (torchrun, 2 gloo ranks) is interrupted mid-run: one step done, two sleeper harnesses
running (each with a background `sleep` child), two evaluations in flight (their temporary
directories exist). Afterwards the run directory holds the summary (saying "interrupted by
SIG…"), the event log, the plot and a checkpoint at the version of the last step in
metrics.jsonl; the job exits non-zero within the shutdown bound; and no process of the run is
left: none of the harnesses, their children or the evaluators (found by a marker on their
command lines, across pid namespaces), no evaluator temporary directory.

SIGINT goes to torchrun's whole process group (the terminal's Ctrl-C) with harnesses unsandboxed
(no pid namespace to help); SIGTERM goes to torchrun alone (scancel, preemption; torchrun forwards
it to the ranks) with the default sandbox. Before this, both left every harness alive and wrote
no summary, events or plot.
"""

import json
import os
import signal
import sys
import time
import uuid

import pytest

from gyre.executions import scratch

from tests.jobs import (AWK_EVALUATOR, RUNS, SLEEPER, marked, reap, start, tiny_task, wait_for,
                        write_task_rows)

pytestmark = [pytest.mark.multirank, pytest.mark.jobs]

SHUTDOWN_S = 25.0


def _rank_pid(torchrun: int, rank: int) -> int | None:
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                ppid = int(open(f"/proc/{name}/stat").read().rsplit(")", 1)[1].split()[1])
                env = open(f"/proc/{name}/environ", "rb").read().split(b"\0")
            except OSError:
                continue
            if ppid == torchrun and f"RANK={rank}".encode() in env:
                return int(name)
    return None


@pytest.mark.parametrize("sig, sandbox", [(signal.SIGINT, "none"), (signal.SIGTERM, "auto"), ("rank-death", "none")],
                         ids=["sigint-group-unsandboxed", "sigterm-torchrun-sandboxed", "rank-death"])
def test_a_signal_mid_run_stops_it_gracefully_and_leaves_no_process(tmp_path, sig, sandbox):
    """rank-death: rank 1 is SIGKILLed; torchrun then SIGTERMs the others, which stop gracefully
    (rank 1 never reports stopping, and is named)."""
    marker = str(uuid.uuid4().int % 10**10).rjust(10, "1")  # digits: also a valid `sleep` argument
    slow_eval = ["sh", "-c", f"sleep 300 # {marker}\necho 0.5"]
    tasks = write_task_rows(tmp_path / "tasks.jsonl", [
        tiny_task(1, 8),
        {**tiny_task(1, 8), "evaluator": {"command": slow_eval}},
        {"harness": [sys.executable, str(SLEEPER), marker], "evaluator": {"command": AWK_EVALUATOR}},
        {"harness": [sys.executable, str(SLEEPER), marker], "evaluator": {"command": AWK_EVALUATOR}},
    ])
    run, tmpdir = tmp_path / "run", tmp_path / "tmp"
    tmpdir.mkdir()
    # What an earlier run's rank 0 left when it was SIGKILLed mid-evaluation: the run sweeps it at start.
    dead = tmpdir / f"{scratch.PREFIX}999999-deadbeef"
    (dead / "gyre-eval-12345678").mkdir(parents=True)
    (dead / scratch.LOCK).touch()
    cmd = RUNS["signals"].command(tasks, run, "--executions.runner.sandbox", sandbox,
                                  "--train.shutdown-timeout-s", str(SHUTDOWN_S))
    proc = start(cmd, tmp_path, tmp_path / "log.txt", TMPDIR=str(tmpdir))
    log = lambda: (tmp_path / "log.txt").read_text()[-6000:]  # noqa: E731
    try:
        def mid_run():
            rows = (run / "metrics.jsonl").read_text().splitlines() if (run / "metrics.jsonl").exists() else []
            children = [p for p in marked(marker) if open(f"/proc/{p}/cmdline", "rb").read().startswith(b"sleep\0")]
            try:  # a directory the run removes while it is walked (a start-up probe's): look again
                evals = [p for p in tmpdir.rglob("gyre-eval-*") if dead not in p.parents]
            except FileNotFoundError:
                return False
            return len(rows) >= 1 and len(children) >= 2 and len(evals) >= 2  # the sleepers' children, 2 evaluators
        wait_for(mid_run, 150, proc, "a step done, sleepers running, evaluations in flight")
        t0 = time.monotonic()
        if sig == "rank-death":
            os.kill(_rank_pid(proc.pid, 1), signal.SIGKILL)  # the OOM killer, a segfault in a library
        elif sig == signal.SIGINT:
            os.killpg(proc.pid, sig)  # Ctrl-C: the terminal signals the foreground process group
        else:
            proc.send_signal(sig)  # scancel / preemption: torchrun, which forwards it to the ranks
        rc = proc.wait(SHUTDOWN_S + 30)
        took = time.monotonic() - t0
        gone_by = time.monotonic() + 3.0  # a process the kernel is still tearing down: polled, not a fixed 1 s
        while (left := marked(marker)) and time.monotonic() < gone_by:
            time.sleep(0.1)
    finally:
        reap(proc, marker)

    name = "SIGTERM" if sig == "rank-death" else signal.Signals(sig).name  # torchrun's, after the death
    assert rc != 0, log()
    # torchrun notices a dead rank within its monitor interval, then signals the others
    assert took < SHUTDOWN_S + (15 if sig == "rank-death" else 5), (took, log())
    assert left == [], f"{len(left)} processes of the run survived: {left}\n{log()}"
    assert list(tmpdir.rglob("gyre-eval-*")) == []  # the evaluators' (in scratch roots) and the dead run's
    assert [p.name for p in tmpdir.iterdir() if p.name.startswith(scratch.PREFIX)] == []  # removed at exit

    summary = json.loads((run / "summary.json").read_text())
    assert summary["interrupted"] == name and f"interrupted by {name}" in summary["error"], summary["error"]
    assert summary["ranks_not_stopped"] == ([1] if sig == "rank-death" else [])
    assert summary["execution_outcomes"].get("cancelled", 0) >= 2  # the sleepers
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert summary["steps"] == len(rows) >= 1
    assert (run / "events.jsonl").read_text().strip() and (run / "role_timeline.png").stat().st_size > 0
    # The core's checkpoint holds the version of the last step written: weights and optimizer agree.
    ckpt = run / "checkpoints" / f"step_{len(rows):06d}"
    assert json.loads((ckpt / "gyre_actor.json").read_text())["version"] == len(rows) == rows[-1]["version"]
    assert (ckpt / "model.safetensors").exists() and (ckpt / "optimizer.pt").exists()
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [ckpt.name]
