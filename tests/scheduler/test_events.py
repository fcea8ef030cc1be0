"""The scheduler's event log and the garbage collector (issue 33): the log keeps every event of
the run; if each were a GC-tracked object, every full collection would walk them all, and the
controller's pauses would grow with the run (benchmarks/scale_bench.py's K = 256: ~0.4 s
pauses at 0.9M events, landing in whichever scheduler call allocated)."""

from __future__ import annotations

import gc

from gyre.scheduler.events import Event, EventLog


def test_logged_events_are_not_walked_by_the_collector():
    log = EventLog()
    n = 20_000
    for i in range(n):
        log.add(0.5 * i, "exec_start" if i % 2 else "claim", group=i, execution=i % 7, cell=None)
    gc.collect()  # collections the rows survive: they stop tracking the ones that hold no container
    gc.collect()  # (a row is untracked by the collection after the one that untracked its inner tuple)
    # Counted on the log's own rows and everything they hold, not on the process's object count:
    # another test's thread in the same worker allocates meanwhile (CI saw 985 foreign objects).
    held = [log._rows] + list(log._rows) + [part for row in log._rows for part in row]
    tracked = sum(1 for obj in held if gc.is_tracked(obj))
    assert tracked == 1, tracked  # the list itself; an object per event would be >= n
    # the log still reads as it was written
    assert len(log) == n and log.events[3] == Event(1.5, "exec_start", {"group": 3, "execution": 3, "cell": None})
    assert [e["group"] for e in log.of("claim")][:3] == [0, 2, 4] and len(log.of("claim")) == n // 2
    assert log.events[-1].t == 0.5 * (n - 1) and [e.t for e in log.events[:2]] == [0.0, 0.5]
    assert sum(1 for _ in log) == n
