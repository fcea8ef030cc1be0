"""`CellWorker.cell_barrier` waits for the ranks of its cell by polling the collective, so a wait
is logged while it lasts and a rank that never arrives (frozen) is a TimeoutError naming the cell
after `cell_wait_s`, not gloo's own 30-minute timeout. Here the collective is a stand-in that
never completes (or completes after a few polls); the real two-cell order is
tests/runtime/test_handover_multirank.py."""

import logging
import time
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from gyre.runtime.worker import CellWorker


class _Work:
    def __init__(self, polls: int | None) -> None:
        self.polls, self.waited = polls, False

    def is_completed(self) -> bool:
        if self.polls is None:
            return False
        self.polls -= 1
        return self.polls < 0

    def wait(self) -> bool:
        self.waited = True
        return True


def _worker(cell_wait_s: float) -> CellWorker:
    w = CellWorker.__new__(CellWorker)  # the barrier reads only these
    w.topo = SimpleNamespace(cell=1, cell_size=2, rank=3, num_cells=2)
    w.groups = SimpleNamespace(cells=["g0", "g1"], pool=[])
    w.plane = SimpleNamespace(progress_every=0.05)
    w.cell_wait_s = cell_wait_s
    return w


def test_a_rank_that_never_arrives_is_a_timeout_naming_the_cell(monkeypatch, caplog):
    seen = []
    monkeypatch.setattr(dist, "all_reduce", lambda t, group, async_op: seen.append((group, async_op)) or _Work(None))
    t0 = time.monotonic()
    with caplog.at_level(logging.INFO, logger="gyre.runtime.worker"), pytest.raises(TimeoutError, match="cell 1's ranks"):
        _worker(0.3).cell_barrier("the engine's release")
    took = time.monotonic() - t0
    assert seen == [("g1", True)]  # the cell's own group, not blocking
    assert 0.3 <= took < 5
    assert any("waiting" in r.getMessage() and "the engine's release" in r.getMessage() for r in caplog.records)


def test_a_barrier_that_completes_returns_after_waiting_on_its_work(monkeypatch):
    work = _Work(3)
    monkeypatch.setattr(dist, "all_reduce", lambda t, group, async_op: work)
    _worker(10.0).cell_barrier()
    assert work.polls < 0 and work.waited  # polled until done, then waited (raises a peer's failure)


def test_a_cell_of_one_rank_waits_for_nothing(monkeypatch):
    monkeypatch.setattr(dist, "all_reduce", lambda *a, **k: pytest.fail("no collective for a one-rank cell"))
    w = _worker(10.0)
    w.topo.cell_size = 1
    w.cell_barrier()
