"""The weight transports (docs/design.md §3): the store board, and two that keep parameter bytes out
of torchrun's store.

A `WeightTransport` (`gyre.backends.protocols`) has two halves. The one-sided half: the core
`post`s each new snapshot, and any rank `fetch`es a version whenever it likes, without the
core's training thread taking part (a satellite joining a step in progress; an engine loading a
published version). The collective half: `broadcast` over a prefix group (a non-final step's new
parameters to the satellites of the step). Retention (`transfer.Retention`): the newest `keep`
versions plus the newest published one. Every read is checked against the poster's CRC32.

* `SnapshotBoard` (`--transfer.transport store`): the bytes live in torchrun's store.
* `TorchWeights` (`torch`): the core keeps its retained snapshots in memory; a server thread on
  the core answers read requests with point-to-point sends over a gloo group of its own, created
  up front on every rank. A request is three integers (reader, mode, version) pushed on a store
  queue; only requests and version pointers touch the store. Why requests go through the store
  and not a gloo receive-from-any-source: gloo cannot cancel a posted receive (no `Work.abort`,
  no send to self in torch 2.13), so a server blocked in one could not be stopped on the way
  out; polling a store queue lets `close()` stop it at once, on success and failure paths alike.
* `MooncakeWeights` (`mooncake`): the core registers each retained snapshot buffer with its
  Mooncake Transfer Engine and writes a descriptor (session, address, layout, CRC) to the store;
  readers `transfer_sync_read` the bytes (TCP here, RDMA on clusters).
"""

from __future__ import annotations

import logging
import pickle
import threading
from typing import Any

import torch
import torch.distributed as dist

from gyre.backends.transfer.snapshots import (FlatLayout, MooncakeTransport, Retention, SnapshotDescriptor, TransferStats,
                                    broadcast_counted, checksum)

logger = logging.getLogger(__name__)

# Request modes and answer statuses of the torch transport's server.
_EXACT, _LATEST, _PUBLISHED = 0, 1, 2
_OK, _MISSING, _CLOSED = 0, 1, 2
_NO_CRC = -1


class _Pointers:
    """The version pointers every transport keeps in the store: `<ns>/latest` and `<ns>/published`
    (what the core posted last, and last published), tiny and read by any rank."""

    store: Any
    ns: str

    def _pointer(self, name: str) -> int | None:
        key = f"{self.ns}/{name}"
        return int(self.store.get(key)) if self.store.check([key]) else None

    def latest(self) -> int | None:
        return self._pointer("latest")

    def published(self) -> int | None:
        return self._pointer("published")


class TorchWeights(_Pointers):
    """`--transfer.transport torch`: one-sided reads served by the core over gloo point-to-point.

    Every rank builds one, at the same point of start-up, with the same `group` (a gloo group of
    every rank, used by nothing else). Only `owner` (the core's rank) posts; its server thread
    answers each request with a header [status, version, layout bytes, data bytes, CRC] and then
    the pickled layout and the flat buffer, to the requesting rank only.
    """

    name = "torch"

    def __init__(self, store: Any, group: Any, *, owner: int, keep: int = 2, verify: bool = True,
                 namespace: str = "wt", poll_s: float = 0.002) -> None:
        from gyre.backends.devices import collective_device

        # The snapshots are host memory served from a thread: point-to-point over gloo with CPU
        # tensors (the factory creates the group with backend="gloo"). Its `broadcast` over a
        # prefix group moves CUDA tensors where that group has NCCL (`transfer.TorchDistTransport`).
        if collective_device(group).type != "cpu":
            raise ValueError("TorchWeights: its point-to-point group must be a gloo group (CPU tensors); "
                             "create it with dist.new_group(..., backend='gloo')")
        self.store, self.group, self.owner, self.verify = store, group, owner, verify
        self.ns, self.poll_s = namespace, poll_s
        self.rank = dist.get_rank()
        self.stats = TransferStats(self.name)
        self._kept = Retention(keep)
        self._snaps: dict[int, tuple[bytes, torch.Tensor, int]] = {}  # version → (layout, flat buffer, CRC)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._server: threading.Thread | None = None
        if self.rank == owner:
            self._server = threading.Thread(target=self._serve, name="gyre-weights-server", daemon=True)
            self._server.start()

    # ------------------------------------------------------------------ one-sided half
    def post(self, version: int, params: dict[str, torch.Tensor], *, published: bool = False) -> None:
        if self.rank != self.owner:
            raise RuntimeError(f"rank {self.rank}: only the core (rank {self.owner}) posts snapshots")
        layout = FlatLayout.of(params)
        buf = layout.pack(params)
        entry = (pickle.dumps(layout), buf, checksum(buf) if self.verify else _NO_CRC)
        with self._lock:  # the server thread reads _snaps; a buffer it is sending stays alive (its reference)
            self._snaps[version] = entry
            for old in self._kept.admit(version, published=published):
                del self._snaps[old]
        pointers = {f"{self.ns}/latest": str(version)} | ({f"{self.ns}/published": str(version)} if published else {})
        for key, value in pointers.items():
            self.store.set(key, value)
            self.stats.moved("store", len(value), control=True)
        self.store.check([f"{self.ns}/latest"])  # a round trip: the pointers are applied (see SnapshotBoard.post)
        self.stats.count("posts")

    def fetch(self, version: int) -> dict[str, torch.Tensor]:
        return self._read(_EXACT, version)[1]

    def fetch_latest(self) -> tuple[int, dict[str, torch.Tensor]]:
        return self._read(_LATEST, -1)

    def fetch_published(self, version: int) -> tuple[int, dict[str, torch.Tensor]]:
        got, params = self._read(_PUBLISHED, version)
        if got != version:
            logger.info("snapshot version %d was evicted (this rank fell behind); loading the newest published "
                        "version %d instead", version, got)
        return got, params

    def _resolve(self, mode: int, version: int) -> int | None:
        """Which held version answers a request (call with the lock held)."""
        if mode == _EXACT:
            return version if version in self._kept.held else None
        if mode == _LATEST:
            return max(self._kept.held) if self._kept.held else None
        return self._kept.resolve_published(version)

    def _read(self, mode: int, version: int) -> tuple[int, dict[str, torch.Tensor]]:
        if self.rank == self.owner:  # the core reads its own memory
            with self._lock:
                got = self._resolve(mode, version)
                entry = self._snaps.get(got) if got is not None else None
            if entry is None:
                raise KeyError(self._missing(version))
            return got, pickle.loads(entry[0]).unpack(entry[1], copy=True)
        if self.store.check([f"{self.ns}/closed"]):
            raise RuntimeError(f"rank {self.rank}: the core's weight server has closed")
        request = f"{self.rank} {mode} {version}".encode()
        self.store.queue_push(f"{self.ns}/req/{self.owner}", request)
        self.stats.moved("store", len(request), control=True)
        header = torch.empty(5, dtype=torch.int64)
        dist.recv(header, src=self.owner, group=self.group)  # blocking: the core's server answers
        status, got, n_layout, n_data, crc = header.tolist()
        if status == _CLOSED:
            raise RuntimeError(f"rank {self.rank}: the core's weight server closed before answering")
        if status == _MISSING:
            raise KeyError(self._missing(version))
        raw_layout = torch.empty(n_layout, dtype=torch.uint8)
        dist.recv(raw_layout, src=self.owner, group=self.group)
        buf = torch.empty(n_data, dtype=torch.uint8)
        dist.recv(buf, src=self.owner, group=self.group)
        self.stats.moved("torch", n_data)
        self.stats.moved("torch", header.numel() * 8 + n_layout, control=True)
        if crc != _NO_CRC and checksum(buf) != crc:
            raise RuntimeError(f"snapshot version {got} from rank {self.owner}: checksum mismatch")
        self.stats.count("fetches")
        return got, pickle.loads(raw_layout.numpy().tobytes()).unpack(buf, copy=False)

    def _missing(self, version: int) -> str:
        return (f"snapshot version {version} is not held by the core (latest: {self.latest()}, "
                f"published: {self.published()})")

    # ------------------------------------------------------------------ the core's server thread
    def _serve(self) -> None:
        key = f"{self.ns}/req/{self.owner}"
        try:
            while not self._stop.is_set():
                if self.store.queue_len(key) == 0:
                    self._stop.wait(self.poll_s)
                    continue
                self._answer(self.store.queue_pop(key), closing=False)
            while self.store.queue_len(key) > 0:  # closing: no reader waits for an answer that never comes
                self._answer(self.store.queue_pop(key), closing=True)
        except Exception as e:  # the store went away (the job is ending) or a bug: say so, never hang
            if not self._stop.is_set():
                logger.exception("weight server on rank %d stopped: %r", self.rank, e)

    def _answer(self, raw: bytes, *, closing: bool) -> None:
        rank, mode, version = (int(x) for x in raw.decode().split())
        with self._lock:
            got = None if closing else self._resolve(mode, version)
            entry = self._snaps.get(got) if got is not None else None
        try:
            if entry is None:
                status = _CLOSED if closing else _MISSING
                dist.send(torch.tensor([status, version, 0, 0, _NO_CRC]), dst=rank, group=self.group)
                return
            raw_layout, buf, crc = entry
            dist.send(torch.tensor([_OK, got, len(raw_layout), buf.numel(), crc]), dst=rank, group=self.group)
            dist.send(torch.frombuffer(bytearray(raw_layout), dtype=torch.uint8), dst=rank, group=self.group)
            dist.send(buf, dst=rank, group=self.group)
        except Exception as e:  # the reader went away; the others are still served
            logger.warning("weight server: answering rank %d failed: %r", rank, e)
            return
        self.stats.count("served")
        self.stats.moved("torch", buf.numel())
        self.stats.moved("torch", 40 + len(raw_layout), control=True)

    # ------------------------------------------------------------------ collective half, shutdown
    def broadcast(self, group: Any, src: int, params: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
        return broadcast_counted(group, src, params, verify=self.verify, stats=self.stats)

    def close(self, timeout: float = 30.0) -> None:
        """Stop the core's server (answering queued requests with 'closed'); idempotent."""
        if self._server is None:
            return
        self.store.set(f"{self.ns}/closed", "1")
        self._stop.set()
        self._server.join(timeout)
        if self._server.is_alive():
            logger.warning("weight server on rank %d did not stop within %.0fs (a send to a reader is stuck); "
                           "leaving it behind (daemon thread)", self.rank, timeout)
        self._server = None
        with self._lock:
            self._snaps.clear()


class MooncakeWeights(_Pointers):
    """`--transfer.transport mooncake`: readers pull registered buffers with Mooncake Transfer Engine.

    The core registers each retained snapshot's flat buffer with its engine and writes a
    `SnapshotDescriptor` (session, address, layout, CRC) to the store under `<ns>/<version>/desc`;
    a reader reads the descriptor and `transfer_sync_read`s the bytes into its own registered
    buffer. On eviction the descriptor goes first, then the buffer is unregistered; a reader that
    raced an eviction sees a failed read or a CRC mismatch with the descriptor gone: KeyError, as
    for any version no longer held. Collective half: `MooncakeTransport.share_over`.
    """

    name = "mooncake"

    def __init__(self, store: Any, *, owner: int, keep: int = 2, verify: bool = True, host: str = "auto",
                 protocol: str = "tcp", device: str = "", namespace: str = "wt", probe: bool = True) -> None:
        self.store, self.owner, self.verify, self.ns = store, owner, verify, namespace
        self.rank = dist.get_rank()
        self.stats = TransferStats(self.name)
        self._mc = MooncakeTransport(host=host, protocol=protocol, device=device, verify=verify)
        if probe:  # every rank builds its transport at the same point: a wrong address stops them all now
            _probe_or_refuse(self._mc, owner)
        self._kept = Retention(keep)
        self._bufs: dict[int, tuple[FlatLayout, torch.Tensor]] = {}  # the core's registered snapshots

    def post(self, version: int, params: dict[str, torch.Tensor], *, published: bool = False) -> None:
        if self.rank != self.owner:
            raise RuntimeError(f"rank {self.rank}: only the core (rank {self.owner}) posts snapshots")
        layout = FlatLayout.of(params)
        buf = layout.pack(params, out=self._mc.register(layout.nbytes))
        desc = pickle.dumps(SnapshotDescriptor(self._mc.session, buf.data_ptr(), layout,
                                               checksum(buf) if self.verify else None))
        self._bufs[version] = (layout, buf)
        self.store.set(f"{self.ns}/{version}/desc", desc)
        self.store.set(f"{self.ns}/latest", str(version))
        if published:
            self.store.set(f"{self.ns}/published", str(version))
        self.store.check([f"{self.ns}/latest"])
        self.stats.moved("store", len(desc), control=True)
        self.stats.count("posts")
        for old in self._kept.admit(version, published=published):
            self.store.delete_key(f"{self.ns}/{old}/desc")  # readers stop finding it first
            self._mc.unregister(self._bufs.pop(old)[1])

    def _held(self, version: int) -> bool:
        return bool(self.store.check([f"{self.ns}/{version}/desc"]))

    def fetch(self, version: int) -> dict[str, torch.Tensor]:
        if self.rank == self.owner:
            if version not in self._bufs:
                raise KeyError(self._missing(version))
            layout, buf = self._bufs[version]
            return layout.unpack(buf, copy=True)
        key = f"{self.ns}/{version}/desc"
        if not self._held(version):
            raise KeyError(self._missing(version))
        blob = self.store.get(key)
        desc: SnapshotDescriptor = pickle.loads(blob)
        self.stats.moved("store", len(blob), control=True)
        try:
            params = self._mc.read(desc)  # CRC-checked
        except RuntimeError:
            if not self._held(version):
                raise KeyError(f"snapshot version {version} was evicted while this rank read it") from None
            raise
        self.stats.moved("mooncake", desc.layout.nbytes)
        self.stats.count("fetches")
        return params

    def fetch_latest(self) -> tuple[int, dict[str, torch.Tensor]]:
        for _ in range(5):  # the core may post past the pointer while a slow reader reads
            version = self.latest()
            try:
                return version, self.fetch(version)
            except KeyError:
                continue
        raise KeyError(f"the latest snapshot kept moving past this rank (latest: {self.latest()})")

    def fetch_published(self, version: int) -> tuple[int, dict[str, torch.Tensor]]:
        if self._held(version):
            return version, self.fetch(version)
        newest = self.published()
        if newest is None or newest < version:
            raise KeyError(self._missing(version))
        logger.info("snapshot version %d was evicted (this rank fell behind); loading the newest published "
                    "version %d instead", version, newest)
        return newest, self.fetch(newest)

    def _missing(self, version: int) -> str:
        return (f"snapshot version {version} is not held by the core (latest: {self.latest()}, "
                f"published: {self.published()})")

    def broadcast(self, group: Any, src: int, params: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
        out = self._mc.share_over(group, src, params)
        self.stats.count("broadcasts")
        self.stats.moved("mooncake", sum(t.numel() * t.element_size() for t in out.values()))
        return out

    def close(self) -> None:
        for _, buf in self._bufs.values():
            self._mc.unregister(buf)
        self._bufs.clear()
        self._mc.close()


def _probe_or_refuse(mc: MooncakeTransport, owner: int) -> None:
    """`transfer.check_reachable` over the world; an unreachable engine is a refused config (every
    rank has it, rank 0 says it: gyre.run), since its cause is an address (--transfer.host,
    GYRE_TRANSFER_HOST)."""
    from gyre.backends.transfer.snapshots import PeerUnreachable, check_reachable
    from gyre.errors import ConfigError

    try:
        check_reachable(mc, owner)
    except PeerUnreachable as e:
        raise ConfigError(f"--transfer.transport mooncake: {e}") from None


class SnapshotBoard(_Pointers):
    """The `store` weight transport: the core's parameter snapshots by version in torchrun's store.

    A satellite joining a step in progress pulls the core's *current* snapshot, and engines load
    the published version, without the core's training thread taking part (docs/design.md §3).
    Here the flat buffer itself lives in the store, so every byte of every snapshot passes through
    the one TCPStore server: fine for small CPU models, not for real ones (`--transfer.transport`
    torch or mooncake keep the bytes out of the store). Integrity: the CRC32 of the flat buffer.
    Retention: `gyre.backends.transfer.snapshots.Retention`. Only the core posts, so the poster's own
    `Retention` is the board's contents. The collective half (`broadcast`) is the flat buffer's
    torch.distributed broadcast over the prefix group.
    """

    name = "store"

    def __init__(self, store: Any, keep: int = 2, *, verify: bool = True) -> None:
        self.store, self.ns = store, "snap"
        self.verify = verify
        self._kept = Retention(keep)
        self.stats = TransferStats("store")

    # ------------------------------------------------------------------ one-sided half
    def post(self, version: int, params: dict[str, torch.Tensor], *, published: bool = False) -> None:
        """Core only: put `version` up (published: a burst's last step) and drop what retention drops."""
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

    def has(self, version: int) -> bool:
        return bool(self.store.check([f"snap/{version}/meta"]))

    def fetch(self, version: int) -> dict[str, torch.Tensor]:
        """Snapshot `version` (views of one fresh buffer); KeyError when it is not on the board."""
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

        return broadcast_counted(group, src, params, verify=self.verify, stats=self.stats)

    def close(self) -> None:
        """Nothing to release: the snapshots live in the store, which outlives the workers."""
