"""Hand-overs inside a cell of two ranks (TP = 2), on real gloo ranks (issue 30 item 4, audit N4).

Position 0's engine spans every GPU of its cell (SGLang's TP ranks), while each position holds
its own actor. So, on every hand-over, across the cell:
  * rollout → train: the engine's release (position 0) ends before any position restores its actor;
  * train → rollout: every position's actor offload ends before the engine resumes (position 0);
  * start-up: the engine's start, where SGLang measures the free memory of every GPU of the cell
    (and refuses a > 10 % imbalance), ends before the other positions build their actors.
Each rank runs `CellWorker` with a stand-in engine and actor that log what they do to one shared
file, a line per event appended in one write: the file's line order is the order across ranks.
The work that must come first is made slow (0.6 s: position 0's engine start and release, the
other positions' offload) and every rank gets each command at the same moment, as the controller
sends it to the whole cell: without the cell's barrier the race shows every time.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from tests.distributed import run_ranks

pytestmark = pytest.mark.multirank

SLOW = 0.6
ROUNDS = 2


class _Log:
    def __init__(self, path: str, rank: int, cell: int, position: int) -> None:
        self.path, self.who, self.phase = path, f"{rank} {cell} {position}", "start"

    def __call__(self, event: str) -> None:
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        try:
            os.write(fd, f"{self.who} {self.phase} {event}\n".encode())
        finally:
            os.close(fd)


class _Host:
    """Position 0's engine host: started in its constructor (SGLang measures memory then)."""

    def __init__(self, log: _Log) -> None:
        self.log = log
        time.sleep(SLOW)
        log("engine_started")

    def release(self) -> None:
        time.sleep(SLOW)
        self.log("engine_released")

    def resume(self) -> None:
        self.log("engine_resume")

    def update(self, params, version) -> None:
        pass


class _Actor:
    def __init__(self, log: _Log, position: int) -> None:
        self.log, self.position, self.version = log, position, 0
        log("actor_built")

    def restore(self) -> None:
        self.log("actor_restore")

    def offload(self) -> int:
        if self.position > 0:
            time.sleep(SLOW)
        self.log("actor_offloaded")
        return 0


class _Control:
    def send(self, to, report) -> None:
        pass

    def try_recv(self):
        return None


class _Weights:
    def latest(self) -> int:
        return 0

    def fetch_published(self, version: int):
        return version, {}


def _cell_of_two(path: str) -> None:
    from gyre.config import ParallelConfig
    from gyre.runtime.messages import ToRollout, ToTrain
    from gyre.runtime.worker import CellWorker
    from gyre.topology import Topology

    world, rank = dist.get_world_size(), dist.get_rank()
    topo = Topology.from_config(ParallelConfig(cell_size=2, tp=2), world, rank)
    groups = topo.create_groups()
    log = _Log(path, rank, topo.cell, topo.position)
    dist.barrier()  # every rank starts together
    host = _Host(log) if topo.position == 0 else None  # as job.py: the engine first, on position 0
    worker = CellWorker(topo, groups, _Control(), _Weights(), host, lambda is_core: _Actor(log, topo.position))
    worker.first_actor(None)
    for r in range(ROUNDS):
        for name, cmd in (("to_train", ToTrain()), ("to_rollout", ToRollout(version=r + 1))):
            dist.barrier()  # the controller sends the command to every rank of the cell at once
            log.phase = f"{name}{r}"
            worker.handle(cmd)
    dist.barrier()


def _first(events: list[tuple], phase: str, event: str, cell: int, position: int | None = None) -> int:
    return min(i for i, (c, p, ph, ev) in enumerate(events)
               if (c, ph, ev) == (cell, phase, event) and (position is None or p == position))


def _last(events: list[tuple], phase: str, event: str, cell: int) -> int:
    return max(i for i, (c, p, ph, ev) in enumerate(events) if (c, ph, ev) == (cell, phase, event))


def test_every_handover_in_a_cell_waits_for_the_other_positions(tmp_path):
    path = tmp_path / "events"
    world = 4  # two cells of two: the core and a satellite
    run_ranks(_cell_of_two, world, str(path))
    events = []
    for line in Path(path).read_text().splitlines():
        rank, cell, position, phase, event = line.split()
        events.append((int(cell), int(position), phase, event))
    for cell in (0, 1):
        # start-up: the engine measured memory before the other position built its actor
        assert _first(events, "start", "engine_started", cell) < _first(events, "start", "actor_built", cell, 1), events
        for r in range(ROUNDS):
            # rollout → train: release (position 0) before any restore
            assert _last(events, f"to_train{r}", "engine_released", cell) < \
                _first(events, f"to_train{r}", "actor_restore", cell), (cell, r, events)
            # train → rollout: every position's offload before the resume (position 0)
            offloads = [i for i, e in enumerate(events) if e[0] == cell and e[2:] == (f"to_rollout{r}", "actor_offloaded")]
            assert len(offloads) == 2, events
            assert max(offloads) < _first(events, f"to_rollout{r}", "engine_resume", cell), (cell, r, events)
