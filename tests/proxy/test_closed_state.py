"""Per-execution state that outlives the execution (issue 33): over a long run a proxy issues a
key, records calls and closes thousands of executions; what it keeps for a closed one must not
grow with the run beyond what refusing it again needs."""

from __future__ import annotations

import gc
import tracemalloc

import numpy as np
import pytest

from gyre.proxy.keys import KeyRegistry
from gyre.proxy.sink import StoreSink
from gyre.trajectory.record import CallRecord, Role
from gyre.trajectory.store import SealedError, TitoStore


def _record(eid: str) -> CallRecord:
    ids = np.arange(40, dtype=np.int32)
    return CallRecord(eid, 0, Role.MAIN, ids, ids[:4].copy(), np.full(4, -0.5, np.float32), policy_version=0)


def _bytes_kept(make_one, n: int) -> float:
    """Traced bytes still held after `n` executions went through `make_one(i)`, per execution."""
    make_one(-1)  # first-use costs (caches, imports) before the count
    gc.collect()
    tracemalloc.start()
    try:
        for i in range(n):
            make_one(i)
        gc.collect()
        return tracemalloc.get_traced_memory()[0] / n
    finally:
        tracemalloc.stop()


def test_generated_keys_are_not_remembered_after_revoke():
    reg = KeyRegistry()

    def one(i):
        reg.issue(f"ex-{i}")
        reg.revoke_execution(f"ex-{i}")

    per = _bytes_kept(one, 2000)
    assert per < 16, per  # a revoked key string + its set slot is ~100 bytes
    assert reg.lookup(reg.issue("ex-x")) is not None


def test_a_given_key_is_still_refused_after_revoke():
    reg = KeyRegistry()
    reg.issue("ex-1", key="harness-key")
    reg.revoke_execution("ex-1")
    assert reg.lookup("harness-key") is None
    with pytest.raises(ValueError, match="already in use"):
        reg.issue("ex-2", key="harness-key")
    k = reg.issue("ex-3", key="other-key")
    reg.revoke(k)
    with pytest.raises(ValueError, match="already in use"):
        reg.issue("ex-4", key="other-key")


def test_sealed_store_executions_are_not_remembered_in_memory(tmp_path):
    sink = StoreSink(TitoStore(tmp_path))

    def one(i):
        eid = f"ex{i + 1}"
        sink.on_record(_record(eid))
        sink.close_execution(eid)

    per = _bytes_kept(one, 500)
    assert per < 16, per  # the execution id in a set: ~70-100 bytes
    with pytest.raises(SealedError):  # the file's seal still refuses a late record
        sink.on_record(_record("ex7"))
    sink.close_execution("never-called")  # no file: remembered, and refused
    with pytest.raises(SealedError):
        sink.on_record(_record("never-called"))
    assert not (tmp_path / "never-called.tito").exists()


def test_a_revoked_generated_key_cannot_be_given_back():
    reg = KeyRegistry()
    k = reg.issue("ex-1")
    reg.revoke_execution("ex-1")
    with pytest.raises(ValueError, match="key"):  # not remembered, but its prefix is reserved
        reg.issue("ex-2", key=k)
    assert reg.lookup(k) is None


def test_store_sink_knows_its_closed_executions_from_the_files(tmp_path):
    """`is_closed` answers from the sealed files (and the few closed before any record), so the
    proxy core can refuse a closed id without a set of every closed execution."""
    sink = StoreSink(TitoStore(tmp_path))
    sink.on_record(_record("done"))
    sink.on_record(_record("open"))
    sink.close_execution("done")
    sink.close_execution("silent")  # closed before it recorded anything
    assert sink.is_closed("done") and sink.is_closed("silent")
    assert not sink.is_closed("open") and not sink.is_closed("never-seen")
    later = StoreSink(TitoStore(tmp_path))  # another process over the same store: the file's seal
    assert later.is_closed("done") and not later.is_closed("open")
    from gyre.proxy.sink import FanoutSink, MemorySink

    assert FanoutSink(MemorySink(), sink).is_closed("done") and not FanoutSink(MemorySink()).is_closed("done")


def test_the_proxy_refuses_a_closed_id_without_keeping_it_when_its_sink_knows(tmp_path):
    """With a store sink the proxy core keeps no set entry per closed execution (the sealed file
    answers), and still refuses the id; a memory sink remembers the ids itself."""
    from gyre.proxy import Proxy, ProxyConfig
    from gyre.proxy.sink import MemorySink

    stored = Proxy(ProxyConfig(), sink=StoreSink(TitoStore(tmp_path)))
    remembered = Proxy(ProxyConfig(), sink=MemorySink())
    for proxy in (stored, remembered):
        for i in range(50):
            proxy.issue_key(f"ex-{i}")
            if i % 2:
                proxy.sink.on_record(_record(f"ex-{i}"))  # some recorded a call, some none
            proxy.close_execution(f"ex-{i}")
        for i in range(50):
            with pytest.raises(ValueError, match="closed"):
                proxy.issue_key(f"ex-{i}")
        assert proxy.issue_key("ex-new")
    assert len(stored.closed_executions) == len(remembered.closed_executions) == 0
    assert len(remembered.sink.closed) == 50  # a memory sink remembers them itself
