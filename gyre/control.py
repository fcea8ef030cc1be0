"""Control plane over the store torchrun provides (docs/design.md §1, §3): no ad-hoc sockets.

Three small things travel here:

* **Mailboxes.** `send(dst, msg)` / `recv()`: one FIFO queue per rank and one for the
  controller (the store's queue_push / queue_pop), carrying commands from the controller and
  reports back to it (`gyre.runtime.messages`). Any picklable message travels; this module does
  not look inside.
* **Blobs.** A granted micro-step bundle is put under a key and taken (read and deleted) by the
  cell it was granted to; the grant message on the same store connection comes after the put,
  so the taker always finds it.
* **The snapshot board.** The core's parameters by version, readable one-sidedly.

Polling with a short sleep keeps the store's own timeout machinery (and its socket warnings) out
of the way; a wait that lasts longer than `progress_every` seconds is logged, so a hang is never
silent.
"""

from __future__ import annotations

import io
import logging
import pickle
import time
from typing import Any

import torch

logger = logging.getLogger(__name__)

CONTROLLER = "ctl"  # the controller's mailbox (it lives on rank 0 beside that rank's own worker)


def default_store() -> Any:
    """The store of the default process group (torchrun's rendezvous store), namespaced."""
    import torch.distributed as dist

    return dist.PrefixStore("gyre/", dist.distributed_c10d._get_default_store())


class ControlPlane:
    def __init__(self, store: Any, rank: int | str, *, poll: float = 0.002, progress_every: float = 30.0) -> None:
        self.store = store
        self.rank = rank
        self.poll = poll
        self.progress_every = progress_every

    # ------------------------------------------------------------------ mailboxes
    def send(self, dst: int | str, msg: Any) -> None:
        """Queue `msg` for mailbox `dst` (a rank, or CONTROLLER)."""
        self.store.queue_push(f"mb/{dst}", pickle.dumps(msg))

    def try_recv(self) -> Any | None:
        key = f"mb/{self.rank}"
        if self.store.queue_len(key) == 0:
            return None
        return pickle.loads(self.store.queue_pop(key))

    def recv(self, timeout: float | None = None, what: str = "a command") -> Any:
        """Block until a message arrives (logging every `progress_every` s); TimeoutError after `timeout`."""
        return self._wait(self.try_recv, timeout, what)

    def _wait(self, probe, timeout: float | None, what: str):
        start = last = time.monotonic()
        while True:
            got = probe()
            if got is not None:
                return got
            now = time.monotonic()
            if timeout is not None and now - start > timeout:
                raise TimeoutError(f"rank {self.rank}: no {what} after {timeout:.0f}s")
            if now - last > self.progress_every:
                logger.info("rank %d still waiting for %s (%.0fs)", self.rank, what, now - start)
                last = now
            time.sleep(self.poll)

    # ------------------------------------------------------------------ blobs
    def put_blob(self, key: str, obj: Any) -> None:
        buf = io.BytesIO()
        torch.save(obj, buf)
        self.store.set(f"blob/{key}", buf.getvalue())

    def take_blob(self, key: str, timeout: float | None = 60.0) -> Any:
        """Read and delete a blob (waiting for it to appear)."""
        full = f"blob/{key}"
        self._wait(lambda: True if self.store.check([full]) else None, timeout, f"blob {key}")
        data = self.store.get(full)
        self.store.delete_key(full)
        return torch.load(io.BytesIO(data), weights_only=False)


class SnapshotBoard:
    """The core's parameter snapshots by version, readable one-sidedly by any rank.

    A satellite joining a step in progress pulls the core's *current* snapshot, and engines load
    the published version, without the core's training thread taking part (docs/design.md §3). On CPU
    the flat buffer lives in torchrun's store; a GPU cluster uses Mooncake's one-sided read
    (`gyre.backends.transfer.MooncakeTransport.serve/read`) behind the same calls. Integrity is
    checked with the CRC32 of the flat buffer.

    Retention: the newest `keep` versions, plus the newest *published* one (a burst's last step),
    which stays until a newer version is published. A slow rank whose mailbox still holds
    `Load(v)` for a version evicted since can always load the newest published version instead
    (`get_published`), which is what its later `Load` commands ask for anyway; no rank fails for
    being slow. Only the core puts, so the writer's own `_held` set is the board's contents.
    """

    def __init__(self, store: Any, keep: int = 2) -> None:
        self.store = store
        self.keep = keep
        self._held: set[int] = set()

    def put(self, version: int, params: dict[str, torch.Tensor], *, published: bool = False) -> None:
        from gyre.backends.transfer import FlatLayout, checksum

        layout = FlatLayout.of(params)
        buf = layout.pack(params)
        self.store.set(f"snap/{version}/data", buf.numpy().tobytes())
        self.store.set(f"snap/{version}/meta", pickle.dumps((layout, checksum(buf))))
        self.store.set("snap/latest", str(version))
        if published:
            self.store.set("snap/published", str(version))
        # A store `set` is fire-and-forget on this connection; a round trip on the same connection
        # returns only after the server applied it, so a reader told "version v is there" (by a
        # collective or a message on another connection) really finds it.
        self.store.check(["snap/latest"])
        self._held.add(version)
        pinned = self.published()
        for old in sorted(self._held):
            if old <= version - self.keep and old != pinned:
                for part in ("data", "meta"):
                    self.store.delete_key(f"snap/{old}/{part}")
                self._held.discard(old)

    def latest(self) -> int | None:
        return int(self.store.get("snap/latest")) if self.store.check(["snap/latest"]) else None

    def published(self) -> int | None:
        return int(self.store.get("snap/published")) if self.store.check(["snap/published"]) else None

    def has(self, version: int) -> bool:
        return bool(self.store.check([f"snap/{version}/meta"]))

    def get(self, version: int) -> dict[str, torch.Tensor]:
        from gyre.backends.transfer import checksum

        if not self.has(version):
            raise KeyError(f"snapshot version {version} is not on the board (latest: {self.latest()}, "
                           f"published: {self.published()})")
        layout, crc = pickle.loads(self.store.get(f"snap/{version}/meta"))
        buf = torch.frombuffer(bytearray(self.store.get(f"snap/{version}/data")), dtype=torch.uint8)
        if checksum(buf) != crc:
            raise RuntimeError(f"snapshot version {version}: checksum mismatch")
        return layout.unpack(buf, copy=False)

    def get_latest(self) -> tuple[int, dict[str, torch.Tensor]]:
        """The core's current snapshot: (version, params). If the core put two newer versions
        between reading the pointer and the data (a very slow reader), read the pointer again."""
        for _ in range(5):
            version = self.latest()
            try:
                return version, self.get(version)
            except KeyError:
                continue
        raise KeyError(f"the board's latest snapshot kept moving past this rank (latest: {self.latest()})")

    def get_published(self, version: int) -> tuple[int, dict[str, torch.Tensor]]:
        """Published `version` for a rollout engine, or the newest published one when `version` was
        evicted because a newer one was published meanwhile. Returns (version loaded, params)."""
        if self.has(version):
            return version, self.get(version)
        newest = self.published()
        if newest is None or newest < version:
            raise KeyError(f"snapshot version {version} is not on the board and none newer was published "
                           f"(latest: {self.latest()}, published: {newest})")
        logger.info("snapshot version %d was evicted (this rank fell behind); loading the newest published "
                    "version %d instead", version, newest)
        return newest, self.get(newest)
