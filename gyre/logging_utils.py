"""Logging setup for SPMD ranks: every record carries its rank; `ONCE` records only on rank 0.

Filter ranks with torchrun's own flags (`--local-ranks-filter 0`, `--tee`), not with
`if rank == 0` in the code. A few facts are global (the topology, the config) and are logged
once: pass `extra=ONCE`.
"""

from __future__ import annotations

import logging
import os

ONCE = {"gyre_once": True}


class _RankFilter(logging.Filter):
    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = self.rank
        return self.rank == 0 or not getattr(record, "gyre_once", False)


def setup_logging(level: str = "INFO", rank: int | None = None) -> None:
    """Configure the root logger for this rank. Called by the entry point, never at import."""
    rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("[%(asctime)s rank%(rank)d %(name)s %(levelname)s] %(message)s", "%H:%M:%S"))
    handler.addFilter(_RankFilter(rank))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
