"""A satellite joins a step in progress (docs/design.md §3), on real gloo ranks with the real cell
workers, control plane, snapshot board and CPU actors; the controller's part is scripted so the
join is deterministic: the core trains the step's first micro-step, *then* cell 1 is switched
to training, pulls the core's current snapshot, and claims the rest. The update of that step must
equal training every micro-step on the core alone (≤ 1e-6); so must a non-final step (whose new
parameters are broadcast over the prefix group), the burst's final step, and the first step of
the next burst, for which the satellite must pull the core's new snapshot again.
"""

import threading

import numpy as np
import pytest
import torch
import torch.distributed as dist

from gyre.backends.transfer.weights import SnapshotBoard
from gyre.runtime.control import CONTROLLER, ControlPlane, default_store
from gyre.runtime.messages import (Joined, Reduce, RequestWork, RolledBack, StepDone, Stop, ToRollout, ToTrain,
                                   TrainWork, Transition, WorkDone)
from tests.distributed import run_ranks

pytestmark = pytest.mark.multirank

VOCAB = 64
# Every step's executions are scored (6 of B·N = 6), so the |E| rescale is 1: the replay below
# calls optimizer_step() with its default.
EVERY_EXECUTION_VALID = dict(grad_scale=1.0)


def _config():
    from gyre.backends.models.hf import model_config

    return model_config("tiny", VOCAB)


def _records(rng: np.random.Generator, eid: str):
    """Two calls of one execution; the second's input extends the first (a branching-free chain)."""
    from gyre.trajectory.record import CallRecord, Role

    prompt = rng.integers(0, VOCAB, 12)
    out1 = rng.integers(0, VOCAB, 10)
    tool = rng.integers(0, VOCAB, 6)
    out2 = rng.integers(0, VOCAB, 9)
    lp = lambda n: -rng.uniform(0.5, 4.0, n)  # noqa: E731
    return [
        CallRecord(eid, 0, Role.MAIN, prompt, out1, lp(10), 0),
        CallRecord(eid, 1, Role.MAIN, np.concatenate([prompt, out1, tool]), out2, lp(9), 0),
    ]


def _bundles(seed: int):
    """Two groups of three executions → micro-step bundles (one execution per micro-step)."""
    from gyre.runtime.samples import group_work
    from gyre.trajectory.advantages import Outcome
    from gyre.trajectory.materialize import ScoredExecution

    rng = np.random.default_rng(seed)
    bundles = []
    for g in range(2):
        items = [ScoredExecution(f"g{g}e{i}", Outcome.scored(float(rng.uniform())), records=_records(rng, f"g{g}e{i}"))
                 for i in range(3)]
        work = group_work(f"g{g}", 0, items, num_executions=6, max_tokens=40, j_max=5, normalize_std=True,
                          rng=np.random.default_rng(seed + g))
        bundles.extend(work.bundles)
    return bundles


def _drive(cp: ControlPlane, steps: list[list], audit: dict) -> None:
    """The scripted controller: step 0 — core alone first, then cell 1 joins mid-step;
    step 1 — both cells from the start, non-final (parameters broadcast), then the final step 2."""
    def expect(kind, cell=None):
        while True:
            m = cp.recv(timeout=120)
            if type(m) is kind and (cell is None or m.cell == cell):
                return m
            if type(m) not in (Transition, RequestWork, WorkDone, Joined, RolledBack):
                raise AssertionError(f"unexpected {m}")

    def grant(cell, step, i, bundle):
        key = f"ms/{step}/{i}/{cell}"
        cp.put_blob(key, bundle)
        cp.send(cell, TrainWork(step=step, group=0, item=i, key=key, version=step))
        audit.setdefault(step, []).append((cell, bundle))
        expect(WorkDone, cell)

    cp.send(0, ToTrain())
    expect(Joined, 0)
    bundles = steps[0]
    grant(0, 0, 0, bundles[0])  # the step is in progress on the core ...
    cp.send(1, ToTrain())  # ... when the satellite switches and joins it
    expect(Joined, 1)
    for i, b in enumerate(bundles[1:], start=1):
        grant(1 if i % 2 else 0, 0, i, b)
    for step, final in ((0, False), (1, False), (2, True)):
        if step > 0:
            for i, b in enumerate(steps[step]):
                grant(i % 2, step, i, b)
        for c in (0, 1):
            cp.send(c, Reduce(step=step, k=2, final=final, **EVERY_EXECUTION_VALID))
        expect(StepDone, 0)
    # Burst end: both back to rollout; next burst both join again and train step 3 (final). The
    # satellite last trained at version 2 and must pull version 3 from the board, not reuse its own.
    for c in (0, 1):
        cp.send(c, ToRollout(version=3))
        expect(RolledBack, c)
    for c in (0, 1):
        cp.send(c, ToTrain())
        expect(Joined, c)
    for i, b in enumerate(steps[3]):
        grant(1 - i % 2, 3, i, b)
    for c in (0, 1):
        cp.send(c, Reduce(step=3, k=2, final=True, **EVERY_EXECUTION_VALID))
    expect(StepDone, 0)
    for r in range(dist.get_world_size()):
        cp.send(r, Stop())


def _rank(tmp: str):
    from gyre.backends.actors.cpu_actor import CpuActor
    from gyre.backends.models.hf import build_model
    from gyre.runtime.worker import CellWorker
    from gyre.config import ParallelConfig
    from gyre.topology import Topology

    torch.set_num_threads(1)
    rank = dist.get_rank()
    topo = Topology.from_config(ParallelConfig(), dist.get_world_size(), rank)
    groups = topo.create_groups()
    store = default_store()
    board = SnapshotBoard(store)
    cp = ControlPlane(store, rank)
    core = None
    if rank == 0:
        core = CpuActor(build_model(_config(), seed=3), is_core=True)
        board.post(0, core.export_parameters())
    dist.barrier()

    def make_actor(is_core):
        a = CpuActor(build_model(_config(), seed=100 + rank), is_core=is_core)  # different init: must be overwritten
        a.version = -1
        return a

    worker = CellWorker(topo, groups, cp, board, None, make_actor, audit_dir=f"{tmp}/audit")
    worker.actor = core
    audit: dict = {}
    driver = None
    if rank == 0:
        driver = threading.Thread(target=_drive, args=(ControlPlane(store.clone(), CONTROLLER),
                                                       [_bundles(s) for s in (11, 12, 13, 14)], audit))
        driver.start()
    while worker.handle(cp.recv(timeout=300)):
        pass
    if driver is not None:
        driver.join()
        return {s: [(c, b) for c, b in items] for s, items in audit.items()}
    return worker.sm.log[0].dst.value if worker.sm.log else None


def test_satellite_joins_mid_step_and_matches_core_alone(tmp_path):
    from gyre.backends.actors.cpu_actor import CpuActor
    from gyre.backends.models.hf import build_model
    from gyre.runtime.samples import train_bundle

    out = run_ranks(_rank, 3, str(tmp_path))
    audit = out[0]
    assert out[2] is None  # cell 2 never left rollout: outside the prefix, never blocked
    cells = [c for c, _ in audit[0]]
    assert cells[0] == 0 and 1 in cells[1:]  # the core started the step alone; cell 1 joined it
    for step in (0, 1, 2, 3):
        before = torch.load(tmp_path / "audit" / f"before_{step:06d}.pt", weights_only=False)
        after = torch.load(tmp_path / "audit" / f"after_{step:06d}.pt", weights_only=False)
        alone = CpuActor(build_model(_config()), is_core=True)
        alone.import_parameters(before["params"])
        alone.optimizer.load_state_dict(before["optimizer"])
        for _, bundle in audit[step]:
            train_bundle(alone, bundle)
        for n, p in alone.model.named_parameters():
            assert torch.allclose(p.grad, before["grads"][n], rtol=1e-5, atol=1e-8), (step, n)
        alone.optimizer_step()
        for n, p in alone.export_parameters().items():
            assert (p - after["params"][n]).abs().max().item() <= 1e-6, (step, n)
        if step > 0:  # the step trained at the previous step's parameters on both cells
            prev = torch.load(tmp_path / "audit" / f"after_{step - 1:06d}.pt", weights_only=False)
            for n, p in before["params"].items():
                assert torch.equal(p, prev["params"][n])
