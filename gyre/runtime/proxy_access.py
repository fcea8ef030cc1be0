"""The runtime's adapter between the harness runner and Gyre's own proxy (docs/design.md §1, §5).

`GyreProxyAccess` is the runner's `ProxyAccess` (`gyre.executions.runner`): keys come from
`Proxy.issue_key` and are revoked (the execution's store file closed) by `Proxy.close_execution`
when the harness ends. What closing reports goes to its owners: the execution's model calls and
the call records the sink failed to write into its `ExecutionRecord` in the run's ledger (the
health check and the TITO completeness check read them there), and every integer stat summed
into `totals` (calls, aborted_calls, spliced_turns, unmatched_turns, ...: the summary's proxy
totals, and the step rows' unmatched turns). Without a ledger (the runner's own tests, tools that
run harnesses outside a training run) nothing is kept per execution: `calls_made` is None
(unknown), as with the runner's `LocalKeys`.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from gyre.runtime.ledger import RunLedger


class GyreProxyAccess:
    """`ProxyAccess` over `proxy` (a `gyre.proxy.Proxy`) served at `url`, writing to `ledger`."""

    def __init__(self, proxy: Any, url: str, ledger: RunLedger | None = None) -> None:
        self.proxy = proxy
        self.url = url.rstrip("/")
        self.ledger = ledger
        self.totals: dict[str, int] = defaultdict(int)
        self._unmatched_seen = 0  # unmatched turns already reported in a step row

    def open_execution(self, execution_id: str, group_id: str) -> str:
        return self.proxy.issue_key(execution_id)

    def close_execution(self, execution_id: str) -> None:
        stats = self.proxy.close_execution(execution_id) or {}
        if "calls" in stats and self.ledger is not None:
            self.ledger.closed(execution_id, stats["calls"], stats.get("sink_errors", 0))
        for k, v in stats.items():
            if isinstance(v, int):
                self.totals[k] += v

    def calls_made(self, execution_id: str) -> int | None:
        """The closed execution's model calls (None: it was not closed here)."""
        return self.ledger.execution(execution_id).calls if self.ledger is not None else None

    def take_unmatched(self) -> int:
        """Unmatched turns of the executions closed since the last call."""
        total = self.totals["unmatched_turns"]
        new, self._unmatched_seen = total - self._unmatched_seen, total
        return new
