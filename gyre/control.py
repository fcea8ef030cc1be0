"""Control plane over the store torchrun provides (docs/design.md §1, §3): no ad-hoc sockets.

Three small things travel here:

* **Mailboxes.** `send(dst, msg)` / `recv()`: one FIFO queue per rank and one for the
  controller (the store's queue_push / queue_pop), carrying commands from the controller and
  reports back to it (`gyre.runtime.messages`). Any picklable message travels; this module does
  not look inside.
* **Blobs.** A granted micro-step bundle is put under a key and taken (read and deleted) by the
  cell it was granted to; the grant message on the same store connection comes after the put,
  so the taker always finds it.
* **The snapshot board** (`--transfer.transport store`): the core's parameters by version,
  readable one-sidedly. The other transports (`gyre.backends.weights`) keep only version
  pointers and descriptors here.

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
    """The `store` weight transport: the core's parameter snapshots by version in torchrun's store.

    A satellite joining a step in progress pulls the core's *current* snapshot, and engines load
    the published version, without the core's training thread taking part (docs/design.md §3).
    Here the flat buffer itself lives in the store, so every byte of every snapshot passes through
    the one TCPStore server: fine for small CPU models, not for real ones (`--transfer.transport`
    torch or mooncake keep the bytes out of the store). Integrity: the CRC32 of the flat buffer.
    Retention: `gyre.backends.transfer.Retention`. Only the core posts, so the poster's own
    `Retention` is the board's contents. The collective half (`broadcast`) is the flat buffer's
    torch.distributed broadcast over the prefix group.
    """

    name = "store"

    def __init__(self, store: Any, keep: int = 2, *, verify: bool = True) -> None:
        from gyre.backends.transfer import Retention, TransferStats

        self.store = store
        self.verify = verify
        self._kept = Retention(keep)
        self.stats = TransferStats("store")

    # ------------------------------------------------------------------ one-sided half
    def post(self, version: int, params: dict[str, torch.Tensor], *, published: bool = False) -> None:
        """Core only: put `version` up (published: a burst's last step) and drop what retention drops."""
        from gyre.backends.transfer import FlatLayout, checksum

        layout = FlatLayout.of(params)
        buf = layout.pack(params)
        meta = pickle.dumps((layout, checksum(buf) if self.verify else None))
        self.store.set(f"snap/{version}/data", buf.numpy().tobytes())
        self.store.set(f"snap/{version}/meta", meta)
        self.store.set("snap/latest", str(version))
        if published:
            self.store.set("snap/published", str(version))
        # A store `set` is fire-and-forget on this connection; a round trip on the same connection
        # returns only after the server applied it, so a reader told "version v is there" (by a
        # collective or a message on another connection) really finds it.
        self.store.check(["snap/latest"])
        self.stats.count("posts")
        self.stats.moved("store", layout.nbytes)
        self.stats.moved("store", len(meta), control=True)
        for old in self._kept.admit(version, published=published):
            for part in ("data", "meta"):
                self.store.delete_key(f"snap/{old}/{part}")

    def latest(self) -> int | None:
        return int(self.store.get("snap/latest")) if self.store.check(["snap/latest"]) else None

    def published(self) -> int | None:
        return int(self.store.get("snap/published")) if self.store.check(["snap/published"]) else None

    def has(self, version: int) -> bool:
        return bool(self.store.check([f"snap/{version}/meta"]))

    def fetch(self, version: int) -> dict[str, torch.Tensor]:
        """Snapshot `version` (views of one fresh buffer); KeyError when it is not on the board."""
        from gyre.backends.transfer import checksum

        if not self.has(version):
            raise KeyError(f"snapshot version {version} is not on the board (latest: {self.latest()}, "
                           f"published: {self.published()})")
        meta = self.store.get(f"snap/{version}/meta")
        layout, crc = pickle.loads(meta)
        buf = torch.frombuffer(bytearray(self.store.get(f"snap/{version}/data")), dtype=torch.uint8)
        if crc is not None and checksum(buf) != crc:
            raise RuntimeError(f"snapshot version {version}: checksum mismatch")
        self.stats.count("fetches")
        self.stats.moved("store", layout.nbytes)
        self.stats.moved("store", len(meta), control=True)
        return layout.unpack(buf, copy=False)

    def fetch_latest(self) -> tuple[int, dict[str, torch.Tensor]]:
        """The core's current snapshot: (version, params). If the core put two newer versions
        between reading the pointer and the data (a very slow reader), read the pointer again."""
        for _ in range(5):
            version = self.latest()
            try:
                return version, self.fetch(version)
            except KeyError:
                continue
        raise KeyError(f"the board's latest snapshot kept moving past this rank (latest: {self.latest()})")

    def fetch_published(self, version: int) -> tuple[int, dict[str, torch.Tensor]]:
        """Published `version` for a rollout engine, or the newest published one when `version` was
        evicted because a newer one was published meanwhile. Returns (version loaded, params)."""
        if self.has(version):
            return version, self.fetch(version)
        newest = self.published()
        if newest is None or newest < version:
            raise KeyError(f"snapshot version {version} is not on the board and none newer was published "
                           f"(latest: {self.latest()}, published: {newest})")
        logger.info("snapshot version %d was evicted (this rank fell behind); loading the newest published "
                    "version %d instead", version, newest)
        return newest, self.fetch(newest)

    # ------------------------------------------------------------------ collective half
    def broadcast(self, group: Any, src: int, params: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
        """Every member of `group` calls this; `src` (a global rank) passes its parameters."""
        from gyre.backends.transfer import broadcast_counted

        return broadcast_counted(group, src, params, verify=self.verify, stats=self.stats)

    def close(self) -> None:
        """Nothing to release: the snapshots live in the store, which outlives the workers."""
