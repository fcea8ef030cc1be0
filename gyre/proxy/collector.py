"""The garbage collector while a proxy serves: automatic collection off, a full one on a clock.

    release = collect_on_a_clock(every_s=600.0, every_objects=500_000)   # at serve time
    release()                                                             # at the server's cleanup

Why: the proxy makes no cyclic garbage while it serves (its objects are freed by their reference
counts), yet each young collection walks every object of the calls in flight while every call
waits. The measurements: benchmarks/README.md, "Scale" (`benchmarks/proxy_gc_bench.py`).

So while any proxy serves in the process, automatic collection is off (`gc.disable`), and a
thread runs one full collection every `every_s` seconds, or sooner once the containers alive have
grown by `every_objects` since the last (gc.get_count()[0], which counts up at each allocation
and down at each free): cyclic garbage is bounded in time and in size, and the pause comes when
chosen, not whenever an allocation crosses a line. It walks only what is not frozen (the proxy
freezes what was alive at serve time, `ProxyConfig.gc_freeze`). The same bargain as torchtitan's
`gc_freq` (torchtitan/tools/utils.py `GarbageCollection`: `gc.disable()`, a collection every N
steps) and Megatron-LM's `--manual-gc`. It is process-wide, so when the proxy shares a rank with
the trainer the trainer's cycles wait for the clock too.

When the last proxy stops, the collector is put back as it was; so it is in a forked child.
"""

from __future__ import annotations

import gc
import logging
import os
import threading
import time

logger = logging.getLogger(__name__)


class _Clock:
    """The process's one clock (`_clock`): the serving proxies' settings and the thread."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.users: list[tuple[float, int]] = []  # (every_s, every_objects) of each serving proxy
        self.was_enabled = True
        self.stop: threading.Event | None = None
        self.collections = 0  # run by this clock

    def acquire(self, every_s: float, every_objects: int):
        user = (float(every_s), int(every_objects))
        with self.lock:
            if not self.users:
                self.was_enabled = gc.isenabled()
                gc.disable()
                self.stop = threading.Event()
                threading.Thread(target=self._run, args=(self.stop,), name="gyre-gc", daemon=True).start()
            self.users.append(user)
        released = []

        def release() -> None:
            with self.lock:
                if released:
                    return
                released.append(True)
                if user not in self.users:  # forked since: the child's clock was reset
                    return
                self.users.remove(user)
                if not self.users:
                    self.stop.set()
                    self.stop = None
                    if self.was_enabled:
                        gc.enable()

        return release

    def settings(self) -> tuple[float, int] | None:
        with self.lock:
            if not self.users:
                return None
            return min(u[0] for u in self.users), min(u[1] for u in self.users)

    def _run(self, stop: threading.Event) -> None:
        last = time.monotonic()
        while True:
            s = self.settings()
            if s is None or stop.wait(min(0.25, s[0])):
                return
            every_s, every_objects = s
            if time.monotonic() - last < every_s and gc.get_count()[0] < every_objects:
                continue
            t = time.perf_counter()
            freed = gc.collect()  # holds the GIL throughout: the pause every call sees
            pause = time.perf_counter() - t
            last = time.monotonic()
            self.collections += 1
            logger.debug("full collection: %d objects freed in %.1f ms", freed, pause * 1e3)


_clock = _Clock()


def _after_fork_in_child() -> None:
    """A forked child (a DataLoader worker, a `multiprocessing` fork) serves no proxy and has no
    clock thread (threads do not survive a fork): its collector goes back as it was, or it would
    never collect."""
    global _clock
    old, _clock = _clock, _Clock()
    was, serving = old.was_enabled, bool(old.users)
    old.lock, old.users = threading.Lock(), []  # a release() in the child finds nothing to do
    if serving and was:
        gc.enable()


os.register_at_fork(after_in_child=_after_fork_in_child)


def collect_on_a_clock(every_s: float, every_objects: int):
    """Turn automatic collection off for as long as the returned `release()` is not called
    (nested: the last release turns it back on); collect every `every_s` seconds or once
    `every_objects` more containers are alive. Either 0 or less: leave the collector alone."""
    if every_s <= 0 or every_objects <= 0:
        return lambda: None
    return _clock.acquire(every_s, every_objects)
