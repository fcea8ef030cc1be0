"""Where the proxy's TITO records go (`RecordSink`): `on_record(record)`, sealed per execution by
`close_execution`; `is_closed` lets the proxy refuse a closed execution id; `heads(execution_id)`
(optional) gives the records an execution already has, so a restarted proxy resumes it
(gyre/proxy/resume.py).

`MemorySink` keeps them in memory (tests, small runs); `StoreSink` appends them to the on-disk
store (`gyre.trajectory.store.TitoStore`, one file per execution); `FanoutSink` does several.
"""

from __future__ import annotations

import logging
from typing import Protocol, runtime_checkable

from gyre.trajectory.record import CallRecord
from gyre.trajectory.store import CallHead, SealedError, is_sealed

logger = logging.getLogger(__name__)


@runtime_checkable
class RecordSink(Protocol):
    def on_record(self, record: CallRecord) -> None: ...

    def close_execution(self, execution_id: str) -> None:
        """No record of the execution is taken after this."""

    def is_closed(self, execution_id: str) -> bool: ...


class MemorySink:
    def __init__(self) -> None:
        self.records: list[CallRecord] = []
        self.closed: set[str] = set()  # closed executions (their ids are not issued again)
        self._executions: set[str] = set()  # with a record: `heads` of a new one costs nothing

    def on_record(self, record: CallRecord) -> None:
        self.records.append(record)
        self._executions.add(record.execution_id)

    def close_execution(self, execution_id: str) -> None:
        self.closed.add(execution_id)

    def is_closed(self, execution_id: str) -> bool:
        return execution_id in self.closed

    def for_execution(self, execution_id: str) -> list[CallRecord]:
        return [r for r in self.records if r.execution_id == execution_id]

    def heads(self, execution_id: str) -> list[CallHead]:
        return [CallHead.of(r) for r in self.for_execution(execution_id)] if execution_id in self._executions else []


def raise_fd_limit() -> tuple[int, int]:
    """Raise this process's soft limit on open descriptors to its hard limit; returns (soft, hard).
    A proxy holds one descriptor per open execution (its store file) plus one per open connection:
    ~2 per open execution (benchmarks/scale_bench.py), past a common default soft limit of 1,024
    at ~500 executions, where every new execution's first record would fail (EMFILE)."""
    try:
        import resource
    except ImportError:  # not POSIX
        return (-1, -1)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        want = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError) as e:
            logger.warning("store sink: could not raise the open-file limit from %d to %d (%s): a proxy holds ~2 "
                           "descriptors per open execution", soft, want, e)
    return soft, hard


class StoreSink:
    """Appends to a `TitoStore` directory; one writer per execution, sealed by `close_execution`
    (the file becomes read-only; a record for a sealed execution raises `SealedError` and opens
    nothing, so no descriptor is left behind). The seal is the file's: only executions closed
    before they wrote anything are remembered here, so a long run's closed executions cost no
    memory. Raises the process's soft open-file limit to its
    hard limit (`raise_fd_limit`): each open execution holds its file open."""

    def __init__(self, store) -> None:
        raise_fd_limit()
        self.store = store
        self._writers: dict = {}
        self._sealed: set[str] = set()  # closed with no writer here (no call recorded in this process)

    def on_record(self, record: CallRecord) -> None:
        w = self._writers.get(record.execution_id)
        if w is None:
            if record.execution_id in self._sealed:
                raise SealedError(f"execution {record.execution_id!r} was closed; its record is sealed")
            w = self._writers[record.execution_id] = self.store.writer(record.execution_id)
        w.append(record)

    def close_execution(self, execution_id: str) -> None:
        """Seal the execution's file (an execution that never wrote one gets none)."""
        w = self._writers.pop(execution_id, None)
        if w is not None:
            w.seal()  # its file refuses any later writer (SealedError): nothing to remember here
        else:
            self._sealed.add(execution_id)

    def is_closed(self, execution_id: str) -> bool:
        """Was the execution closed (through this sink, or its file sealed by an earlier one)?
        What lets the proxy refuse a closed id without remembering every closed execution."""
        return execution_id in self._sealed or is_sealed(self.store.path_for(execution_id))

    def heads(self, execution_id: str) -> list[CallHead]:
        """The records the execution's file already holds (`gyre.trajectory.store.read_heads`;
        a torn tail of a killed writer is left out, and truncated when the writer opens)."""
        return self.store.heads(execution_id)

    def close(self) -> None:
        """Close the open files (not sealed: their executions were not closed)."""
        for eid in list(self._writers):
            self._writers.pop(eid).close()


class FanoutSink:
    def __init__(self, *sinks: RecordSink) -> None:
        self.sinks = sinks

    def on_record(self, record: CallRecord) -> None:
        for s in self.sinks:
            s.on_record(record)

    def close_execution(self, execution_id: str) -> None:
        for s in self.sinks:
            s.close_execution(execution_id)

    def is_closed(self, execution_id: str) -> bool:
        return any(s.is_closed(execution_id) for s in self.sinks)

    def heads(self, execution_id: str) -> list[CallHead]:
        """The first of its sinks' that holds records of the execution."""
        for s in self.sinks:
            got = s.heads(execution_id) if hasattr(s, "heads") else []
            if got:
                return got
        return []
