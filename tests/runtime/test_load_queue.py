"""A rank that fell behind (frozen, swapped out) finds several `Load`s in its mailbox: it loads
only the newest, none when a `Stop` follows them, answers each, and handles what follows."""

from types import SimpleNamespace

import pytest

from gyre.runtime.messages import Load, Loaded, Stop, Stopped, ToTrain
from gyre.runtime.worker import CellWorker


class ListControl:
    """A ControlPlane over a list: the rank's mailbox, and what it sent."""

    def __init__(self, queued):
        self.queue, self.sent = list(queued), []

    def try_recv(self):
        return self.queue.pop(0) if self.queue else None

    def send(self, dst, msg):
        self.sent.append(msg)


class Board:
    """Published versions `kept` are readable; any other raises, as an evicted snapshot does."""

    def __init__(self, kept):
        self.kept, self.fetched = set(kept), []

    def fetch_published(self, version):
        if version not in self.kept:
            raise KeyError(f"version {version} left the board")
        self.fetched.append(version)
        return version, {"v": version}


class Engine:
    def __init__(self):
        self.updates, self.stopped = [], False

    def update(self, params, version):
        self.updates.append(version)

    def stop(self):
        self.stopped = True


def _worker(queued, kept):
    topo = SimpleNamespace(rank=1, cell=1, position=0, is_core=False)
    cp, board, engine = ListControl(queued), Board(kept), Engine()
    w = CellWorker(topo, None, cp, board, engine, make_actor=lambda core: None)
    return w, cp, board, engine


def test_queued_loads_are_coalesced_to_the_newest():
    w, cp, board, engine = _worker([Load(version=2), Load(version=3), Load(version=4)], kept={4})
    assert w.handle(Load(version=1)) is True
    assert board.fetched == [4] and engine.updates == [4] and w.version == 4
    assert [m.version for m in cp.sent if isinstance(m, Loaded)] == [4, 4, 4, 4]  # one answer per Load
    assert cp.queue == []


def test_loads_before_a_stop_are_skipped_and_the_stop_is_handled():
    w, cp, board, engine = _worker([Load(version=2), Stop(failed=False)], kept=set())  # the core is gone
    assert w.handle(Load(version=1)) is False  # the Stop ended the worker
    assert board.fetched == [] and engine.updates == [] and engine.stopped
    assert sum(isinstance(m, Loaded) for m in cp.sent) == 2 and isinstance(cp.sent[-1], Stopped)


def test_a_command_after_the_loads_is_handled_once_in_order():
    handled = []
    w, cp, board, engine = _worker([Load(version=2), ToTrain(), Load(version=3)], kept={2, 3})
    w.HANDLERS = {**CellWorker.HANDLERS, ToTrain: lambda self, msg: handled.append(msg)}
    w.handle(Load(version=1))
    assert engine.updates == [2] and handled == [ToTrain()]
    assert cp.queue == [Load(version=3)]  # the next command stays queued for the job's loop


def test_one_load_alone_loads_it():
    w, cp, board, engine = _worker([], kept={1})
    w.handle(Load(version=1))
    assert engine.updates == [1] and [m.version for m in cp.sent] == [1]


def test_a_later_failed_stop_overrides_the_first():
    """A rank found silent after the run ended well is sent Stop(failed): thawed, it leaves as stopped by a failure."""
    w, cp, board, engine = _worker([Load(version=2), Stop(failed=False), Stop(failed=True)], kept=set())
    assert w.handle(Load(version=1)) is False
    assert w.stopped_by_failure and cp.queue == []
