"""How a waiting rank polls the store (issue 35, item 4): a backed-off sleep, so an idle rank
costs the one TCPStore server a bounded number of requests a second (today's fixed 2 ms poll:
~500), while a message still reaches it within the bound. In-process, one real TCPStore on port 0,
its calls counted."""

from __future__ import annotations

import logging
import threading
import time
from datetime import timedelta

import pytest
from torch.distributed import TCPStore

from gyre.backoff import Backoff
from gyre.runtime.control import ControlPlane


class Counted:
    """A store that counts the requests a ControlPlane makes."""

    def __init__(self, inner) -> None:
        self.inner, self.calls = inner, 0
        self._lock = threading.Lock()

    def __getattr__(self, name):
        fn = getattr(self.inner, name)

        def call(*a, **k):
            with self._lock:
                self.calls += 1
            return fn(*a, **k)

        return call


@pytest.fixture
def server():
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    yield store


def _client(server) -> TCPStore:
    return TCPStore("127.0.0.1", server.port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=30))


def test_backoff_doubles_up_to_its_bound_and_resets():
    b = Backoff(0.002, 0.05)
    seq = [b.next() for _ in range(10)]
    assert seq[:6] == [0.002, 0.004, 0.008, 0.016, 0.032, 0.05] and set(seq[5:]) == {0.05}
    b.reset()
    assert b.next() == 0.002
    assert [Backoff(0.01, 0.01).next() for _ in range(3)] == [0.01] * 3  # max == min: a fixed period
    with pytest.raises(ValueError):
        Backoff(0.1, 0.05)


def test_an_idle_rank_polls_at_a_bounded_rate(server):
    store = Counted(_client(server))
    cp = ControlPlane(store, 1, poll=0.002, max_poll=0.05)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        cp.recv(timeout=1.0)
    elapsed = time.monotonic() - t0
    assert 1.0 <= elapsed < 1.0 + 0.05 + 0.2  # the timeout still fires on time (not a sleep past it)
    # ramp (2..32 ms: 5 polls) + 1 s / 50 ms + the last: ~27; a fixed 2 ms poll makes ~500
    assert store.calls <= 30, store.calls


def test_a_message_reaches_an_idle_rank_within_the_bound(server):
    cp = ControlPlane(_client(server), 1, poll=0.002, max_poll=0.05)
    sender = ControlPlane(_client(server), 0)
    got: dict = {}

    def wait():
        got["msg"] = cp.recv(timeout=10)
        got["t"] = time.monotonic()

    th = threading.Thread(target=wait)
    th.start()
    time.sleep(0.6)  # long idle: the waiter's sleep is at its bound now
    latencies = []
    sent = time.monotonic()
    sender.send(1, "go")
    th.join(timeout=5)
    latencies.append(got["t"] - sent)
    assert got["msg"] == "go"
    assert latencies[0] < 0.05 + 0.05, latencies  # the bound plus a generous round trip on a loaded machine


def test_a_new_wait_starts_fast_after_a_message(server):
    """Commands come in bursts (Load then ToRollout ...): the next wait polls at `poll` again."""
    store = Counted(_client(server))
    cp = ControlPlane(store, 1, poll=0.002, max_poll=0.05)
    sender = ControlPlane(_client(server), 0)
    timer = threading.Timer(0.5, sender.send, (1, "first"))
    timer.start()
    assert cp.recv(timeout=5) == "first"
    timer = threading.Timer(0.01, sender.send, (1, "second"))
    t0 = time.monotonic()
    timer.start()
    assert cp.recv(timeout=5) == "second"
    assert time.monotonic() - t0 < 0.045  # polls at 2, 4, 8, 16 ms: seen well before the 50 ms bound


def test_a_long_wait_still_logs_its_progress(server, caplog):
    cp = ControlPlane(_client(server), "ctl", poll=0.002, max_poll=0.05, progress_every=0.2)
    with caplog.at_level(logging.INFO, logger="gyre.runtime.control"), pytest.raises(TimeoutError, match="no a reply"):
        cp.recv(timeout=1.6, what="a reply")
    notes = sum("still waiting for a reply" in r.getMessage() for r in caplog.records)
    # notes at 0.2 s, then gaps of 0.4, 0.8, ... (0.2, 0.6, 1.4 within 1.6 s); a fixed cadence gave 8
    assert 2 <= notes <= 3, notes
