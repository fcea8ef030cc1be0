"""A tiny training job per weight transport (`--transfer.transport`), for real: torchrun, 3 gloo
ranks, tiny model, 2 steps in one burst of the Async baseline (cells 0 and 1 train, so a step
they share ends with its new parameters broadcast to cell 1; cell 2 only rolls out and loads
published versions). From the per-rank counts the
job writes (run_dir/transport/rank_<r>.json):
  * satellites read snapshots one-sidedly (their engines' first weights, the published version),
    and a broadcast over a prefix group happened;
  * torch and mooncake: not one parameter byte went through torchrun's store.
The torch transport (the default) is checked on tests/runtime/test_train_e2e.py's run, and the
store transport on that file's Async baseline (the same shape of run: Async, cells 0 and 1
training), instead of jobs of their own.
Mooncake runs inside a private network namespace (it listens on every interface) or is skipped.
Also: `python -m gyre.run --help-all` documents the transfer options and their choices.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.distributed import netns_problem
from tests.jobs import RUNS, env, tiny_task, write_task_rows

ROOT = Path(__file__).resolve().parents[2]
STEPS = 2


def _command(run_dir: Path, tasks: Path, transport: str) -> list[str]:
    # tests/jobs.py RUNS["transports"]: 3 ranks, Async with 2 training cells, a paced actor (~0.5 s
    # a micro-step) that keeps the core from claiming every item of a step before cell 1 (whose
    # first actor build takes seconds) asks for work: cell 1 joins. The harness goes through the
    # openai SDK here: with the stdlib tiny harness cell 1 did not join (twice, on a loaded
    # machine; the cause is not understood yet: the run's timing, not the wire, is the suspect).
    return RUNS["transports"].command(tasks, run_dir, "--transfer.transport", transport, steps=STEPS)


def _run(tmp_path: Path, transport: str, prefix: list[str] = ()) -> dict:
    run_dir = tmp_path / "run"
    # Rewards that never tie: a group whose rewards are all equal makes no micro-step (zero advantage),
    # and a step of only such groups would give cell 1 nothing to join for, and nothing to broadcast.
    untied = {**tiny_task(1, 24, sdk=True), "evaluator": {"command": [sys.executable, "-c",
                                                                       "import random; print(random.random())"]}}
    cmd = _command(run_dir, write_task_rows(tmp_path / "tasks.jsonl", [untied] * 4), transport)
    if prefix:  # inside a private network namespace: bring loopback up first
        cmd = [*prefix, "sh", "-c", "ip link set lo up && exec " + " ".join(f"'{c}'" for c in cmd)]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env())
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-5000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(STEPS))
    stats = {int(p.stem.split("_")[1]): json.loads(p.read_text()) for p in (run_dir / "transport").glob("rank_*.json")}
    assert sorted(stats) == [0, 1, 2], stats
    return stats


def check_stats(stats: dict, transport: str, steps: int = STEPS) -> None:
    """What every rank's run_dir/transport/rank_<r>.json must show after `steps` steps (rank 0 the
    core, every other rank a satellite). tests/runtime/test_train_e2e.py checks the default
    transport (torch) on its 4-rank run with this too."""
    assert all(s["transport"] == transport for s in stats.values())
    assert stats[0]["posts"] == steps + 1  # version 0 and one per step
    satellites = [s for r, s in stats.items() if r != 0]
    assert satellites
    assert all(s["fetches"] >= 1 for s in satellites)  # one-sided reads by the satellites
    assert stats[0]["broadcasts"] >= 1 and any(s["broadcasts"] >= 1 for s in satellites)
    path = {"store": "store", "torch": "torch", "mooncake": "mooncake"}[transport]
    assert all(s["bytes_by_path"][path] > 0 for s in satellites)
    if transport == "torch":
        assert stats[0]["served"] >= 2  # the core's server answered the satellites' reads
    if transport != "store":
        for rank, s in stats.items():
            assert s["bytes_by_path"]["store"] == 0, (rank, s)  # no parameter byte through the store


@pytest.mark.jobs
@pytest.mark.multirank
def test_a_tiny_job_over_mooncake_inside_a_private_netns(tmp_path):
    problem = netns_problem()
    if problem:
        pytest.skip(problem)
    prefix = ["unshare", "--net"] + ([] if os.geteuid() == 0 else ["--map-root-user"])
    check_stats(_run(tmp_path, "mooncake", prefix), "mooncake")


def test_help_lists_the_transfer_options_and_their_choices():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "COLUMNS": "200"}
    out = subprocess.run([sys.executable, "-m", "gyre.run", "--help-all"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, env=env).stdout
    for flag in ("--transfer.transport", "--transfer.keep", "--transfer.verify", "--transfer.timeout-s",
                 "--backend.engine", "--backend.actor", "--train.torch-threads"):
        assert flag in out, flag
    assert "{store,torch,mooncake}" in out and "{cpu,sglang}" in out and "{cpu,megatron}" in out
    assert "--engine.threads" not in out  # one owner of the thread count
