"""Harness stdout/stderr with a size cap per execution (`RunnerConfig.log_cap_bytes`).

A harness's output reaches its log through a pipe the runner drains (`drain`), never through a
file the harness holds: so the runner decides how much is kept, and the harness never blocks on
a full pipe (past the cap its output is read and dropped; it keeps running). A log keeps its
first `cap − tail` bytes, then, only if the harness wrote more than `cap`, one marker line naming
the cap and the bytes dropped, and the last `tail` bytes (where a crash's traceback is):

    size(log) ≤ cap + len(marker)        tail = min(cap // 4, TAIL_MAX)

Example: cap 1000 → head 750, tail 250; 5000 bytes written → 750 + marker + the last 250.
(A chatty harness once wrote 1 GB of stdout into one execution and could fill the disk.)
"""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)

TAIL_MAX = 256 * 1024  # bytes of a capped log's end kept in memory until the harness ends
CAP_FLAG = "--executions.runner.log-cap-bytes"


class CappedLog:
    """One log file fed with what the harness writes (`feed`), finished by `close`. A write
    error (a full disk) stops the writing, never the draining: it is kept in `error`."""

    def __init__(self, path: Path, cap: int, label: str = "") -> None:
        if cap < 1:
            raise ValueError(f"executions.runner.log_cap_bytes must be >= 1, got {cap}")
        self.path, self.cap, self.label = Path(path), cap, label or Path(path).name
        self.tail_max = min(cap // 4, TAIL_MAX)
        self.head_max = cap - self.tail_max
        self.total = 0  # bytes the harness wrote
        self.head = 0  # bytes of them written to the file so far
        self.tail = bytearray()  # what came after the head, trimmed to its last tail_max bytes
        self.error: str | None = None
        self.closed = False
        self._f = open(self.path, "wb")

    @property
    def dropped(self) -> int:
        """Bytes written by the harness that the log does not keep."""
        return max(0, self.total - self.head - self.tail_max)

    def feed(self, data: bytes) -> None:
        if self.total <= self.cap < self.total + len(data):
            logger.warning("%s reached its cap of %d bytes (%s); keeping its first %d and last %d bytes",
                           self.label, self.cap, CAP_FLAG, self.head_max, self.tail_max)
        self.total += len(data)
        room = self.head_max - self.head
        if room > 0:
            self._write(data[:room])
            self.head += min(room, len(data))
            data = data[room:]
        if data:
            self.tail += data
            if len(self.tail) > 2 * self.tail_max:  # trimmed in batches, not on every chunk
                del self.tail[:len(self.tail) - self.tail_max]

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            if self.dropped:
                self._write(f"\n[gyre: {self.path.name} capped at {self.cap} bytes ({CAP_FLAG}): "
                            f"{self.dropped} bytes dropped here; the last {self.tail_max} bytes follow]\n".encode())
                self._write(bytes(self.tail[-self.tail_max:]) if self.tail_max else b"")
            else:
                self._write(bytes(self.tail))
        finally:
            self.tail = bytearray()
            try:
                self._f.close()
            except OSError as e:
                self._failed(e)

    def _write(self, data: bytes) -> None:
        if self.error is not None or not data:
            return
        try:
            self._f.write(data)
            self._f.flush()  # the log is readable while the harness runs
        except OSError as e:
            self._failed(e)

    def _failed(self, e: OSError) -> None:
        if self.error is None:
            self.error = f"could not write {self.label}: {e}"
            logger.warning("%s; the harness's further output there is dropped", self.error)


class _Drain(asyncio.Protocol):
    def __init__(self, log: CappedLog, done: asyncio.Future) -> None:
        self.log, self.done = log, done

    def data_received(self, data: bytes) -> None:
        self.log.feed(data)

    def eof_received(self) -> bool:
        return False  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.log.close()
        if not self.done.done():
            self.done.set_result(None)


class Drain:
    """A pipe's read end drained into a `CappedLog` by the running loop. `finish` waits for the
    end of the pipe (every writer gone) up to a timeout, then closes it anyway."""

    def __init__(self, log: CappedLog, transport: asyncio.BaseTransport, done: asyncio.Future) -> None:
        self.log, self._transport, self._done = log, transport, done

    async def finish(self, timeout: float) -> None:
        try:
            await asyncio.wait_for(asyncio.shield(self._done), timeout)
        except asyncio.TimeoutError:
            logger.warning("%s: a process outside the harness's tree still holds its output pipe after %.0fs; "
                           "closing it", self.log.label, timeout)
        finally:
            self.close()

    def close(self) -> None:
        self._transport.close()
        self.log.close()


async def drain(read_fd: int, log: CappedLog) -> Drain:
    """Drain `read_fd` (a pipe's read end; owned from here on) into `log` on the running loop."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    pipe = os.fdopen(read_fd, "rb", buffering=0)
    try:
        transport, _ = await loop.connect_read_pipe(lambda: _Drain(log, done), pipe)
    except BaseException:
        pipe.close()
        log.close()
        raise
    return Drain(log, transport, done)
