"""Admission: what one execution may cost the proxy every execution shares (docs/design.md §4,
"Untrusted callers" and "No body shape stalls other executions").

    with proxy.admit(key, content_length):              429 past the slots or the rate, before the body is read
        body = ...read...
        proxy.admission.charge(execution_id, units)     the body's bytes / values, debited once known

One execution (all its keys) may have `max_calls_per_key` calls in flight and start
`calls_per_second_per_key` units a second (a token bucket holding 2x that, so bursts pass). A call
costs one unit, plus one per `body_bytes_per_call` bytes (from Content-Length, capped at the
bucket), plus one per `body_values_per_call` JSON values (`work_units`, known once the body is
read, debited uncapped: the bucket goes negative and the execution's next calls wait). A render on
the thread pool costs one unit per `render_ms_per_unit` of its wall time. Each execution's share
is its `Allowance`, which this module owns.
"""

from __future__ import annotations

import asyncio
import math
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator

from gyre.proxy.config import ProxyConfig
from gyre.proxy.errors import ApiError


COUNT_WINDOW = 1 << 18  # bytes per count: ~0.25 ms of one GIL hold (~1 GB/s per separator)


def value_count(raw: bytes) -> int:
    """An upper bound on the JSON values in `raw`: its `,` `{` `[` bytes (C speed, ~1 ms a MiB).
    Separators inside strings count too, so prose costs a little more than it parses; never less.
    Counted `COUNT_WINDOW` bytes at a time: run on a thread (`gyre.proxy.bodies`, bodies over one
    window), each count is a short GIL hold the event loop takes turns with."""
    n = 0
    for i in range(0, len(raw), COUNT_WINDOW):
        j = i + COUNT_WINDOW
        n += raw.count(b",", i, j) + raw.count(b"{", i, j) + raw.count(b"[", i, j)
    return n


@dataclass
class Allowance:
    """One execution's share of admission: its handler tasks in flight, its rate bucket, one render
    (or large body parse) at a time."""

    tasks: set[asyncio.Task] = field(default_factory=set)
    bucket: float | None = None  # units left (negative: owed); None: full (set on first use)
    bucket_t: float = 0.0
    render_lock: asyncio.Lock | None = None


class Admission:
    def __init__(self, config: ProxyConfig, allowance_of: Callable[[str], Allowance]) -> None:
        self.config = config
        self.allowance_of = allowance_of

    def _refill(self, a: Allowance, now: float) -> None:
        rate = self.config.calls_per_second_per_key
        burst = 2.0 * rate
        a.bucket = burst if a.bucket is None else min(burst, a.bucket + (now - a.bucket_t) * rate)
        a.bucket_t = now

    @contextmanager
    def admit(self, execution_id: str, body_bytes: int = 0) -> Iterator[Allowance]:
        """Hold one of the execution's call slots for the body of the `with` (the whole
        request, from before its body is read): 429 past `max_calls_per_key` in flight or past the
        rate budget. Registers the current task so `close_execution` can abort it."""
        c = self.config
        a = self.allowance_of(execution_id)
        if c.max_calls_per_key and len(a.tasks) >= c.max_calls_per_key:
            raise ApiError(429, "rate_limit", f"this execution has {len(a.tasks)} calls in flight; the limit is "
                           f"{c.max_calls_per_key} (proxy.max_calls_per_key)", retry_after=1.0)
        rate = c.calls_per_second_per_key
        if rate > 0:
            self._refill(a, time.monotonic())
            cost = min(1.0 + (body_bytes // c.body_bytes_per_call if c.body_bytes_per_call else 0), 2.0 * rate)
            if a.bucket < cost:
                raise ApiError(429, "rate_limit", f"more than {rate:g} calls per second from this execution, a call "
                               f"costing one more per {c.body_bytes_per_call} body bytes and per {c.body_values_per_call} "
                               "JSON values (proxy.calls_per_second_per_key, proxy.body_bytes_per_call, "
                               "proxy.body_values_per_call)", retry_after=math.ceil((cost - a.bucket) / rate * 10) / 10)
            a.bucket -= cost
        task = asyncio.current_task()
        a.tasks.add(task)
        try:
            yield a
        finally:
            a.tasks.discard(task)

    def render_lock(self, execution_id: str) -> asyncio.Lock:
        """The execution's one-at-a-time lock for work on the thread pool or the parse pool."""
        a = self.allowance_of(execution_id)
        if a.render_lock is None:
            a.render_lock = asyncio.Lock()
        return a.render_lock

    def work_units(self, nbytes: int, values: int, charged_bytes: bool) -> int:
        """Units a read body of `nbytes` with `values` JSON values (`value_count`) owes beyond what
        admission charged: its values, and its bytes when admission did not know them (chunked,
        no Content-Length)."""
        c = self.config
        units = values // c.body_values_per_call if c.body_values_per_call else 0
        if not charged_bytes and c.body_bytes_per_call:
            units += nbytes // c.body_bytes_per_call
        return units

    def charge_render(self, execution_id: str, seconds: float) -> None:
        """Debit a render that ran on the thread pool: one unit per `render_ms_per_unit` of its wall time."""
        ms = self.config.render_ms_per_unit
        if ms > 0:
            self.charge(execution_id, int(seconds * 1e3 / ms))

    def charge(self, execution_id: str, units: int) -> None:
        """Debit `units` from the execution's rate budget (uncapped: its next calls wait)."""
        a = self.allowance_of(execution_id)
        if units <= 0 or self.config.calls_per_second_per_key <= 0:
            return
        if a.bucket is None:
            self._refill(a, time.monotonic())
        a.bucket -= units
