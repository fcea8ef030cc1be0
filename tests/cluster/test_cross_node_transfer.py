"""Weights and KV migration across two nodes (issue 35, item 3): two network namespaces on this
machine (`tests.cluster.netns`), one torchrun a node (static rendezvous, --nnodes 2, MASTER_ADDR =
node 0's address), one rank a node, the tiny job in Gyre's mode with --proxy.migration always.
Each cell's calls move to the other cell's engine when it switches to train, so every migration
crosses the nodes.

* Mooncake (weights and KV) with the default --transfer.host auto: each rank advertises its own
  node's address, node 1's rank reads the core's snapshots over Mooncake, calls migrate with 0
  tokens recomputed and no fallback, and the run ends with its summary.
* The torch weight transport with gloo KV migration: the same, over gloo.
* The old default (--transfer.host 127.0.0.1 for every rank): node 1's reads fail, and the run
  stops promptly with an error naming both addresses and leaves its summary, instead of node 0
  waiting 600 s.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.cluster.netns import TwoNodes, problem
from tests.distributed import netns_problem
from tests.jobs import RUNS, env, rows, tiny_task, write_task_rows

pytestmark = [pytest.mark.slow, pytest.mark.multirank, pytest.mark.jobs]
PORT = 29500  # the namespaces are fresh: nothing else can hold a port in them
STEPS = 2


@pytest.fixture(scope="module")
def nodes():
    why = problem()
    if why:
        pytest.skip(why)
    with TwoNodes() as n:
        yield n


def _command(nodes: TwoNodes, node: int, run_dir: Path, tasks: Path, *extra: str) -> list[str]:
    # RUNS["cross_node"]: paced decoding keeps calls running when a cell switches to train, so they are rerouted.
    rendezvous = ("--nnodes", "2", "--node-rank", str(node), "--master-addr", nodes.addr[0], "--master-port", str(PORT))
    return RUNS["cross_node"].command(tasks, run_dir, "--train.steps", str(STEPS), *extra, torchrun=rendezvous)


def _run(nodes: TwoNodes, tmp_path: Path, *extra: str, timeout: float = 150) -> tuple[list[int], str, Path]:
    run_dir = tmp_path / "run"
    # In file order, one short task, then long ones (4 turns of 64 paced tokens): the short group
    # is ready first and the core enters training while the long calls run on both engines, so
    # some of them are on the core's engine and move.
    short, long = tiny_task(turns=1, tokens=8), tiny_task(turns=4, tokens=64)
    tasks = write_task_rows(tmp_path / "tasks.jsonl", [short, long, long, long] * 2)
    logs = [tmp_path / f"node{i}.log" for i in (0, 1)]
    procs = [nodes.popen(i, _command(nodes, i, run_dir, tasks, *extra), cwd=tmp_path, env=env(),
                         stdout=logs[i].open("w"), stderr=subprocess.STDOUT, start_new_session=True)
             for i in (0, 1)]
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            if any(p.poll() not in (None, 0) for p in procs):  # one node failed: the other has 30 s to follow
                deadline = min(deadline, time.monotonic() + 30)
            time.sleep(0.5)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    log = "\n".join(f"===== node {i}\n" + logs[i].read_text() for i in (0, 1))
    return [p.returncode for p in procs], log, run_dir


def _stats(run_dir: Path) -> dict[int, dict]:
    return {int(p.stem.split("_")[1]): json.loads(p.read_text()) for p in (run_dir / "transport").glob("rank_*.json")}


def _migrations(run_dir: Path) -> dict:
    summary = json.loads((run_dir / "summary.json").read_text())
    return summary["migration"]


def _check_moved(nodes: TwoNodes, run_dir: Path, log: str, weights: str) -> None:
    assert [r["step"] for r in rows(run_dir / "metrics.jsonl")] == list(range(STEPS))
    stats = _stats(run_dir)
    assert sorted(stats) == [0, 1] and all(s["transport"] == weights for s in stats.values()), stats
    assert stats[1]["fetches"] >= 1 and stats[1]["bytes_by_path"][weights] > 0, stats[1]  # node 1 read the core
    assert stats[1]["bytes_by_path"]["store"] == 0, stats[1]  # not one parameter byte through the store
    mig = _migrations(run_dir)
    assert mig["migrated"] >= 1 and mig["bytes_moved"] > 0, (mig, log[-6000:])
    assert mig["tokens_recomputed"] == 0 and mig["recomputed"] == 0 and mig["fallbacks"] == 0, mig


def test_mooncake_weights_and_kv_cross_nodes_with_per_node_hosts(nodes, tmp_path):
    if netns_problem() and "mooncake" in (netns_problem() or ""):
        pytest.skip(netns_problem())
    codes, log, run_dir = _run(nodes, tmp_path, "--transfer.transport", "mooncake",
                               "--proxy.migration-transport", "mooncake")
    assert codes == [0, 0], log[-8000:]
    for node in (0, 1):  # each rank advertised its own node's address, and said so
        assert f"advertising {nodes.addr[node]}:" in log, log[-8000:]
    _check_moved(nodes, run_dir, log, "mooncake")


def test_torch_weights_and_gloo_kv_cross_nodes(nodes, tmp_path):
    codes, log, run_dir = _run(nodes, tmp_path, "--transfer.transport", "torch", "--proxy.migration-transport", "gloo")
    assert codes == [0, 0], log[-8000:]
    _check_moved(nodes, run_dir, log, "torch")


def test_one_loopback_host_for_every_rank_fails_promptly_naming_both_hosts(nodes, tmp_path):
    """The old default: every rank advertises 127.0.0.1. Every rank probes the core's engine at
    start-up and the job is refused on both nodes at once, naming the addresses (it used to fail
    node 1's first read while node 0 waited 600 s)."""
    if netns_problem() and "mooncake" in (netns_problem() or ""):
        pytest.skip(netns_problem())
    codes, log, _ = _run(nodes, tmp_path, "--transfer.transport", "mooncake", "--transfer.host", "127.0.0.1",
                         timeout=120)
    # Both exited by themselves (not killed at the timeout): a refused config, rank 0 says it.
    assert codes[0] > 0 and codes[1] >= 0, (codes, log[-8000:])
    assert "cannot reach rank 0's Mooncake engine at 127.0.0.1:" in log, log[-8000:]
    assert "rank 1 (advertising 127.0.0.1)" in log and "transfer_sync_read from 127.0.0.1:" in log, log[-8000:]
