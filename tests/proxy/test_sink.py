"""The sinks' contract (gyre/proxy/sink.py): every sink takes records, closes an execution and
says whether it was closed, so the proxy calls them without probing."""

from gyre.proxy.sink import FanoutSink, MemorySink, RecordSink, StoreSink
from gyre.trajectory.store import TitoStore


def test_every_sink_keeps_the_contract_and_a_fanout_closes_all(tmp_path):
    mem, store = MemorySink(), StoreSink(TitoStore(tmp_path))
    fan = FanoutSink(mem, store)
    assert all(isinstance(s, RecordSink) for s in (mem, store, fan))
    assert not fan.is_closed("e")
    fan.close_execution("e")
    assert mem.is_closed("e") and store.is_closed("e") and fan.is_closed("e") and not fan.is_closed("f")
    assert FanoutSink(MemorySink(), mem).is_closed("e")  # closed in any of them is closed
