"""The collector while a proxy serves (gyre/proxy/collector.py): no automatic collection, cyclic
garbage freed on the clock or on growth, and the process's collector back as it was after."""

from __future__ import annotations

import gc
import time
import weakref

import pytest

from gyre.proxy import Proxy, ProxyConfig, serve_proxy
from gyre.proxy import collector


class Node:
    pass


def _garbage_cycle() -> weakref.ref:
    """A reference cycle nothing else refers to: only a collection frees it."""
    a, b = Node(), Node()
    a.other, b.other = b, a
    return weakref.ref(a)


def _wait(done, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while not done() and time.monotonic() < end:
        time.sleep(0.02)
    return done()


def _wait_freed(ref: weakref.ref, timeout: float) -> bool:
    return _wait(lambda: ref() is None, timeout)


@pytest.fixture
def collector_on(monkeypatch):
    """The test runs with automatic collection on and a clock of its own, whatever the process
    did before (another test's proxy may still serve in this worker, on the process's clock)."""
    was = gc.isenabled()
    gc.enable()
    monkeypatch.setattr(collector, "_clock", collector._Clock())
    yield
    (gc.enable if was else gc.disable)()


def test_serving_turns_automatic_collection_off_and_stopping_turns_it_back(collector_on):
    handle = serve_proxy(Proxy(ProxyConfig(port=0, gc_every_s=3600, gc_every_objects=10**9)))
    try:
        assert not gc.isenabled()
        ref = _garbage_cycle()
        keep = [{} for _ in range(3 * gc.get_threshold()[0])]  # past any young threshold
        time.sleep(0.3)
        assert ref() is not None, "an automatic collection ran while the proxy served"
        del keep
    finally:
        handle.stop()
    assert gc.isenabled()
    gc.collect()
    assert ref() is None


def test_the_clock_frees_the_cycles_left_while_serving(collector_on):
    handle = serve_proxy(Proxy(ProxyConfig(port=0, gc_every_s=0.3, gc_every_objects=10**9)))
    try:
        ref = _garbage_cycle()
        assert _wait_freed(ref, timeout=10.0), "no clocked collection freed the cycle"
        assert _wait(lambda: collector._clock.collections > 0, timeout=10.0)
    finally:
        handle.stop()


def test_growth_brings_the_collection_forward(collector_on):
    handle = serve_proxy(Proxy(ProxyConfig(port=0, gc_every_s=3600, gc_every_objects=50_000)))
    try:
        gc.collect()  # the count starts from 0 (a collection resets it)
        ref = _garbage_cycle()
        time.sleep(0.6)
        assert ref() is not None, "collected before the containers alive grew by gc_every_objects"
        keep = [{} for _ in range(60_000)]
        assert _wait_freed(ref, timeout=10.0), "growth past gc_every_objects brought no collection"
        del keep
    finally:
        handle.stop()


def test_the_collector_is_back_only_when_the_last_proxy_stops(collector_on):
    cfg = ProxyConfig(port=0, gc_every_s=3600, gc_every_objects=10**9)
    first, second = serve_proxy(Proxy(cfg)), serve_proxy(Proxy(cfg))
    try:
        first.stop()
        assert not gc.isenabled(), "one proxy stopping turned collection back on under another"
    finally:
        second.stop()
    assert gc.isenabled()


def test_zero_leaves_the_collector_to_python(collector_on):
    handle = serve_proxy(Proxy(ProxyConfig(port=0, gc_every_s=0)))
    try:
        assert gc.isenabled()
    finally:
        handle.stop()


def test_a_port_taken_leaves_the_collector_as_it_was(collector_on):
    first = serve_proxy(Proxy(ProxyConfig(port=0, gc_every_s=0)))
    try:
        with pytest.raises(OSError):
            serve_proxy(Proxy(ProxyConfig(port=first.port, gc_every_s=3600)))
        assert gc.isenabled(), "a proxy that never served left automatic collection off"
    finally:
        first.stop()


def test_a_forked_child_collects_again(collector_on):
    """A child forked while a proxy serves (a DataLoader worker) has no clock thread: it gets
    Python's collector back, or it would never collect."""
    import os

    handle = serve_proxy(Proxy(ProxyConfig(port=0, gc_every_s=3600)))
    try:
        assert not gc.isenabled()
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: report and leave at once
            os.write(w, b"1" if gc.isenabled() else b"0")
            os._exit(0)
        os.close(w)
        got = os.read(r, 1)
        os.close(r)
        os.waitpid(pid, 0)
        assert got == b"1", "the forked child was left with automatic collection off and no clock"
        assert not gc.isenabled(), "the fork turned collection back on in the serving parent"
    finally:
        handle.stop()
