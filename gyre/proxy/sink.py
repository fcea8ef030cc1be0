"""Where the proxy's TITO records go: `on_record(record)`.

`MemorySink` keeps them in memory (tests, small runs); `StoreSink` appends them to the on-disk
store (`gyre.trajectory.store.TitoStore`, one file per execution); `FanoutSink` does several.
"""

from __future__ import annotations

import logging
from typing import Protocol, runtime_checkable

from gyre.trajectory.record import CallRecord

logger = logging.getLogger(__name__)


@runtime_checkable
class RecordSink(Protocol):
    def on_record(self, record: CallRecord) -> None: ...


class MemorySink:
    def __init__(self) -> None:
        self.records: list[CallRecord] = []

    def on_record(self, record: CallRecord) -> None:
        self.records.append(record)

    def for_execution(self, execution_id: str) -> list[CallRecord]:
        return [r for r in self.records if r.execution_id == execution_id]


class StoreSink:
    """Appends to a `TitoStore` directory; one writer per execution, closed by `close_execution`."""

    def __init__(self, store) -> None:
        self.store = store
        self._writers: dict = {}

    def on_record(self, record: CallRecord) -> None:
        w = self._writers.get(record.execution_id)
        if w is None:
            w = self._writers[record.execution_id] = self.store.writer(record.execution_id)
        w.append(record)

    def close_execution(self, execution_id: str) -> None:
        w = self._writers.pop(execution_id, None)
        if w is not None:
            w.close()

    def close(self) -> None:
        for eid in list(self._writers):
            self.close_execution(eid)


class FanoutSink:
    def __init__(self, *sinks: RecordSink) -> None:
        self.sinks = sinks

    def on_record(self, record: CallRecord) -> None:
        for s in self.sinks:
            s.on_record(record)
