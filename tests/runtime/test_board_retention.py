"""The snapshot board never strands a slow rank (issue: a satellite told to load a version the
board had already evicted died with KeyError at the end of the CPU demo).

Retention rule under test: the newest `keep` versions plus the newest published one. A rank
asked for a published version that was evicted meanwhile loads the newest published version and
says so (its later `Load` commands name that version anyway).
"""

import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from gyre.runtime.cell import CellState
from gyre.config import ParallelConfig
from gyre.backends.transfer.weights import SnapshotBoard
from gyre.runtime.control import CONTROLLER, ControlPlane
from gyre.runtime.messages import Load, Loaded, ToRollout
from gyre.runtime.worker import CellWorker
from gyre.topology import Topology


def _params(v: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((3, 2), float(v)), "b": torch.tensor([v, -v])}


class _Engine:
    """Records what a worker asks its engine to load (the EngineHost calls the worker makes)."""

    def __init__(self) -> None:
        self.loaded: list[tuple[int, float]] = []

    def update(self, params, version):
        self.loaded.append((version, float(params["w"][0, 0])))

    def resume(self):
        pass


def _slow_satellite(store):
    topo = Topology.from_config(ParallelConfig(), world_size=4, rank=2)
    engine = _Engine()
    worker = CellWorker(topo, None, ControlPlane(store, 2), SnapshotBoard(store), engine, make_actor=None)
    return worker, engine


def test_a_satellite_told_to_load_an_evicted_version_loads_the_newest_published():
    store = dist.HashStore()
    core_board = SnapshotBoard(store, keep=2)
    core_board.post(0, _params(0), published=True)
    for v in range(1, 19):  # bursts of 2 steps: versions 2, 4, ..., 18 are published
        core_board.post(v, _params(v), published=v % 2 == 0)
    worker, engine = _slow_satellite(store)
    # Its mailbox still holds load(2) from long ago; version 2 is gone from the board.
    assert not core_board.has(2)
    worker.handle(Load(version=2))
    assert engine.loaded == [(18, 18.0)] and worker.version == 18
    report = ControlPlane(store, CONTROLLER).try_recv()
    assert report == Loaded(cell=2, rank=2, version=18)
    # Back to rollout after a burst, with a version evicted meanwhile: the same rule.
    for state in (CellState.DRAINING, CellState.JOINING, CellState.TRAIN):
        worker.sm.to(state)
    worker.handle(ToRollout(version=4))
    assert engine.loaded[-1] == (18, 18.0) and worker.version == 18


def test_the_published_version_outlives_newer_unpublished_ones():
    store = dist.HashStore()
    board = SnapshotBoard(store, keep=2)
    board.post(0, _params(0), published=True)
    for v in range(1, 6):  # a long burst: nothing published after 0
        board.post(v, _params(v))
    assert board.has(0) and board.has(4) and board.has(5) and not board.has(3)
    assert board.fetch_published(0)[0] == 0
    v, p = board.fetch_latest()
    assert v == 5 and float(p["w"][0, 0]) == 5.0


@settings(max_examples=60, deadline=None)
@given(keep=st.integers(1, 4), published=st.lists(st.booleans(), min_size=1, max_size=25))
def test_retention_invariants(keep, published):
    """After every put: the newest `keep` versions and the newest published one are readable with
    their own contents, nothing else is held, and any published version up to the newest published
    resolves to a version at least as new."""
    store = dist.HashStore()
    board = SnapshotBoard(store, keep=keep)
    board.post(0, _params(0), published=True)
    newest_published = 0
    for v, pub in enumerate(published, start=1):
        board.post(v, _params(v), published=pub)
        newest_published = v if pub else newest_published
        expected = set(range(max(0, v - keep + 1), v + 1)) | {newest_published}
        held = {u for u in range(v + 1) if board.has(u)}
        assert held == expected
        for u in held:
            assert float(board.fetch(u)["w"][0, 0]) == float(u)
        for asked in range(newest_published + 1):
            got, params = board.fetch_published(asked)
            assert got >= asked and float(params["w"][0, 0]) == float(got)
