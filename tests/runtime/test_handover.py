"""The memory hand-over at a cell's switches (gyre/runtime/worker.py, docs/design.md §3): entering
rollout the actor's state leaves the device before the engine resumes; entering training the
engine releases first, then the actor comes back; each part is timed, reported, and lands in the
ledger's rows and summary. One worker on one process with a recording engine and a real CpuActor."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from gyre.backends.actors.cpu_actor import CpuActor
from gyre.runtime import messages as m
from gyre.runtime.ledger import RunLedger
from gyre.runtime.worker import CellWorker
from tests.backends.helpers import tiny_model


class _Log(list):
    def send(self, dst, msg):  # the control plane: reports to the controller
        self.append(msg)


class _Engine:
    def __init__(self, log, actor_of):
        self.log, self.actor_of = log, actor_of

    def _note(self, what):  # where the actor's state is when the engine acts
        self.log.append((what, self.actor_of().memory.offloaded))

    def release(self):
        self._note("release")

    def resume(self):
        self._note("resume")

    def update(self, params, version):
        self._note("update")


def _worker(offload: bool):
    reports, calls = _Log(), []
    topo = SimpleNamespace(cell=0, rank=0, position=0, is_core=True)
    weights = SimpleNamespace(fetch_published=lambda v: (v, {}), latest=lambda: 0)
    worker = CellWorker(topo, None, reports, weights, None, make_actor=None, offload_actor=offload)
    worker.engine = _Engine(calls, lambda: worker.actor)
    worker.actor = CpuActor(tiny_model(seed=0), is_core=True)  # handed over in ROLLOUT, as the job does
    return worker, reports, calls


def test_actor_leaves_the_device_in_rollout_and_comes_back_after_the_engine_released():
    worker, reports, calls = _worker(offload=True)
    assert worker.actor.memory.offloaded  # built at start-up while the cell serves rollouts
    worker.handle(m.ToTrain())
    assert calls == [("release", True)] and not worker.actor.memory.offloaded
    joined = next(r for r in reports if isinstance(r, m.Joined))
    assert set(joined.handover_s) == {"engine_release", "actor_restore", "snapshot"}
    assert joined.handover_s["actor_restore"] > 0
    worker.handle(m.ToRollout(version=0))
    assert calls[1:] == [("resume", True), ("update", True)]  # the engine resumes into freed memory
    back = next(r for r in reports if isinstance(r, m.RolledBack))
    assert set(back.handover_s) == {"actor_offload", "engine_resume", "engine_load"} and back.handover_s["actor_offload"] > 0


def test_no_offload_keeps_the_actor_resident():
    worker, reports, calls = _worker(offload=False)
    ptr = next(worker.actor.model.parameters()).data_ptr()
    worker.handle(m.ToTrain())
    worker.handle(m.ToRollout(version=0))
    assert calls == [("release", False), ("resume", False), ("update", False)]
    assert next(worker.actor.model.parameters()).data_ptr() == ptr  # never copied
    back = next(r for r in reports if isinstance(r, m.RolledBack))
    assert back.handover_s["actor_offload"] == 0.0


def test_the_ledger_rows_and_summary_carry_the_handover():
    led = RunLedger(num_cells=1)
    assert led.handover_summary() == {}
    led.handover({"engine_release": 0.5, "actor_restore": 2.0, "snapshot": 0.0})
    led.handover({"actor_offload": 1.0, "engine_resume": 0.25, "engine_load": 0.1})
    led.handover({"engine_release": 0.5, "actor_restore": 4.0, "snapshot": 0.0})
    s = led.handover_summary()
    assert s["actor_restore"] == {"mean": 3.0, "max": 4.0, "count": 2}
    assert s["actor_offload"] == {"mean": 1.0, "max": 1.0, "count": 1}
    assert (led._last("actor_restore"), led._last("actor_offload")) == (4.0, 1.0)
