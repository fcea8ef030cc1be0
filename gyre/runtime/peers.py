"""Which ranks of an attempt died: each rank's process as recorded at its start, looked up again
at the attempt's end.

A rank killed outright (SIGKILL, the OOM killer) sends no report. torchrun sees its worker exit
and SIGTERMs the survivors, so the controller's own view is "interrupted by SIGTERM (received by
rank 0)": true, but not the cause. Every rank's (host, pid, start time) goes into run.json's
attempt entry when the job starts (`gyre.runtime.job.train`); at the attempt's end, a rank whose
process on this host is gone (or a zombie, or its pid reused by a newer process) died first, and
the attempt's error names it (`gyre.runtime.attempts.end_attempt`). A rank on another host cannot
be looked up from here: it is named as not stopped, never as dead.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any


def _start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22), or None
    when there is no such process or it is a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    if fields[0] in ("Z", "X"):  # exited, not yet reaped by torchrun
        return None
    return int(fields[19])


def identity(rank: int) -> dict[str, Any]:
    """This process as run.json records it for `rank`."""
    return {"rank": rank, "host": socket.gethostname(), "pid": os.getpid(), "start": _start_ticks(os.getpid())}


def dead(ranks: list[dict[str, Any]], host: str | None = None) -> list[int]:
    """The ranks of `ranks` (identities) on this host whose process has ended."""
    host = host or socket.gethostname()
    return [r["rank"] for r in ranks if r.get("host") == host and _start_ticks(r["pid"]) != r.get("start")]


def name_the_dead(error: str, died: list[int]) -> str:
    """The attempt's error with its cause first: the ranks that died, then what followed.

    >>> name_the_dead("interrupted by SIGTERM (received by rank 0); stopped gracefully after 2 steps", [1])
    'rank 1 died (its process ended without a report: killed, e.g. SIGKILL or the OOM killer, or crashed), and torchrun stopped the other ranks: interrupted by SIGTERM (received by rank 0); stopped gracefully after 2 steps'
    """
    who = f"rank {died[0]}" if len(died) == 1 else "ranks " + ", ".join(map(str, died))
    return (f"{who} died (its process ended without a report: killed, e.g. SIGKILL or the OOM killer, or crashed), "
            f"and torchrun stopped the other ranks: {error}")
