"""Parameter snapshots (docs/design.md §3): the core's current parameters, moved to satellites/engines.

One interface, two transports. Every member of `group` calls `share` at once; the source
(`src`, a global rank) passes its parameters, the others pass nothing and get a copy back:

    transport = TorchDistTransport(group=prefix_group, src=core_rank)      # or MooncakeTransport
    params = transport.share(actor.export_parameters() if rank == core_rank else None)

* `TorchDistTransport`: the flat byte buffer is broadcast over the group (gloo on CPU, NCCL on
  GPU). The default on CPU.
* `MooncakeTransport`: the source registers its flat buffer with a Mooncake Transfer Engine and
  announces (session, address, layout, CRC) over the group; receivers read the bytes one-sidedly
  (TCP here, RDMA on clusters), then a barrier releases the source's buffer. `serve` / `read`
  expose the one-sided half alone, for a reader that joins whenever it likes.

Both move exact bytes: the receiver checks a CRC32 of the flat buffer against the source's
(`verify=True`) and raises on a mismatch. These are the collective halves; the run's
`WeightTransport`s (`gyre.backends.transfer.weights`, `gyre.backends.transfer.weights.SnapshotBoard`) add the one-sided half
on top, with the retention rule (`Retention`) and byte counts (`TransferStats`) defined here.
"""

from __future__ import annotations

import logging
import os
import threading
import zlib
from dataclasses import dataclass, field
from typing import Any, Mapping, Protocol

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

_ALIGN = 64  # bytes; keeps every tensor's view aligned for vector loads


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str  # e.g. "float32"
    offset: int  # bytes into the flat buffer
    nbytes: int


@dataclass(frozen=True)
class FlatLayout:
    """Where each named tensor lives in one flat uint8 buffer (parameter order preserved)."""

    specs: tuple[TensorSpec, ...]
    nbytes: int

    @classmethod
    def of(cls, params: dict[str, torch.Tensor]) -> "FlatLayout":
        specs, offset = [], 0
        for name, t in params.items():
            n = t.numel() * t.element_size()
            specs.append(TensorSpec(name, tuple(t.shape), str(t.dtype).removeprefix("torch."), offset, n))
            offset += (n + _ALIGN - 1) // _ALIGN * _ALIGN
        return cls(tuple(specs), offset)

    def pack(self, params: dict[str, torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
        """Copy `params` into a flat uint8 buffer [nbytes] (`out` if given)."""
        if [s.name for s in self.specs] != list(params):
            raise ValueError("FlatLayout.pack: parameter names/order differ from the layout")
        buf = torch.zeros(self.nbytes, dtype=torch.uint8) if out is None else out
        if buf.numel() != self.nbytes or buf.dtype != torch.uint8:
            raise ValueError(f"FlatLayout.pack: out must be uint8 [{self.nbytes}]")
        for s in self.specs:
            t = params[s.name].detach()
            if tuple(t.shape) != s.shape or str(t.dtype).removeprefix("torch.") != s.dtype:
                raise ValueError(f"FlatLayout.pack: {s.name} is {tuple(t.shape)} {t.dtype}, layout says {s.shape} {s.dtype}")
            buf[s.offset : s.offset + s.nbytes].copy_(t.contiguous().reshape(-1).view(torch.uint8))
        return buf

    def unpack(self, buf: torch.Tensor, *, copy: bool = True) -> dict[str, torch.Tensor]:
        """Named tensors from a flat buffer (copies unless `copy=False`, then views of `buf`)."""
        out = {}
        for s in self.specs:
            view = buf[s.offset : s.offset + s.nbytes].view(getattr(torch, s.dtype)).view(s.shape)
            out[s.name] = view.clone() if copy else view
        return out


def checksum(buf: torch.Tensor) -> int:
    """CRC32 of a flat uint8 buffer's bytes."""
    return zlib.crc32(memoryview(buf.contiguous().numpy()))


PATHS = ("store", "torch", "mooncake")  # where bytes can travel


@dataclass
class TransferStats:
    """What one rank's weight transport moved, by path (`PATHS`). `payload` counts parameter bytes
    this rank sent or received; `control` counts the small rest (pointers, layouts, descriptors,
    requests). A run writes one per rank (run_dir/transport/rank_<r>.json)."""

    transport: str
    payload: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PATHS, 0))
    control: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PATHS, 0))
    posts: int = 0  # snapshots this rank (the core) put up
    fetches: int = 0  # snapshots this rank read one-sidedly from another rank
    served: int = 0  # one-sided reads this rank answered (torch transport: the core's server)
    broadcasts: int = 0  # collective broadcasts this rank took part in
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def moved(self, path: str, nbytes: int, *, control: bool = False) -> None:
        with self._lock:  # the torch transport's server thread counts too
            (self.control if control else self.payload)[path] += int(nbytes)

    def count(self, what: str) -> None:
        """One more of `what`: 'posts', 'fetches', 'served' or 'broadcasts'."""
        with self._lock:
            setattr(self, what, getattr(self, what) + 1)

    def as_dict(self) -> dict[str, Any]:
        return {"transport": self.transport, "bytes_by_path": dict(self.payload),
                "control_bytes_by_path": dict(self.control), "posts": self.posts, "fetches": self.fetches,
                "served": self.served, "broadcasts": self.broadcasts}


class Retention:
    """Which snapshot versions a poster keeps: the newest `keep`, plus the newest *published* one
    (a burst's last step), which stays until a newer version is published. A slow rank whose
    `Load(v)` names a version evicted since loads the newest published one instead (its later
    `Load` commands name that one anyway), so no rank fails for being slow.

        r = Retention(keep=2); r.admit(0, published=True) → []; r.admit(1) → []; r.admit(2) → []
        r.admit(3) → [1]   (0 stays: it is the newest published)
    """

    def __init__(self, keep: int) -> None:
        if keep < 1:
            raise ValueError(f"Retention: keep must be >= 1, got {keep}")
        self.keep = keep
        self.held: set[int] = set()
        self.published: int | None = None

    def admit(self, version: int, *, published: bool = False) -> list[int]:
        """Hold `version`; return the versions to drop now (oldest first)."""
        self.held.add(version)
        if published:
            self.published = version
        evicted = [old for old in sorted(self.held) if old <= version - self.keep and old != self.published]
        self.held.difference_update(evicted)
        return evicted

    def resolve_published(self, version: int) -> int | None:
        """The version a reader asking for published `version` gets: itself while held, else the
        newest published one if at least as new, else None."""
        if version in self.held:
            return version
        if self.published is not None and self.published >= version:
            return self.published
        return None


class ParameterTransport(Protocol):
    name: str

    def share(self, params: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """Collective over the group: the source passes params, every member gets them back."""
        ...


def _announce(obj: Any, src: int, group: Any) -> Any:
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


class TorchDistTransport:
    """Broadcast the flat parameter buffer from `src` over `group` (torch.distributed). The
    buffer rides the device the group's backend takes (`gyre.backends.devices.collective_device`):
    CUDA over NCCL on a "cpu:gloo,cuda:nccl" group of GPU ranks, CPU over gloo otherwise; the
    checksum and the returned tensors are on CPU either way."""

    name = "torch"

    def __init__(self, group: Any = None, src: int = 0, *, verify: bool = True):
        self.group, self.src, self.verify = group, src, verify

    def share(self, params: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        is_src = dist.get_rank() == self.src
        if is_src == (params is None):
            raise ValueError(f"share: rank {dist.get_rank()} {'is' if is_src else 'is not'} the source (src={self.src}); pass params exactly there")
        from gyre.backends.devices import collective_device

        device = collective_device(self.group)
        if is_src:
            layout = FlatLayout.of(params)
            buf = layout.pack(params)
            _announce((layout, checksum(buf) if self.verify else None), self.src, self.group)
            dist.broadcast(buf.to(device), src=self.src, group=self.group)
            return params
        layout, crc = _announce(None, self.src, self.group)
        buf = torch.empty(layout.nbytes, dtype=torch.uint8, device=device)
        dist.broadcast(buf, src=self.src, group=self.group)
        buf = buf.cpu()
        if crc is not None and checksum(buf) != crc:
            raise RuntimeError("TorchDistTransport: snapshot checksum mismatch")
        return layout.unpack(buf, copy=False)


def broadcast_counted(group: Any, src: int, params: dict[str, torch.Tensor] | None, *, verify: bool,
                      stats: TransferStats) -> dict[str, torch.Tensor]:
    """`TorchDistTransport(group, src).share(params)`, counted in `stats` (the collective half of
    the store and torch weight transports)."""
    out = TorchDistTransport(group, src, verify=verify).share(params)
    stats.count("broadcasts")
    stats.moved("torch", sum(t.numel() * t.element_size() for t in out.values()))
    return out


AUTO_HOST = "auto"
HOST_ENV = "GYRE_TRANSFER_HOST"  # per node: what launch.sh (or any launcher) sets on each node


def resolve_host(host: str = AUTO_HOST, env: Mapping[str, str] | None = None) -> str:
    """The address this rank's Mooncake engine advertises (`--transfer.host`).

    An explicit address is taken as is. `auto` (the default): $GYRE_TRANSFER_HOST when set (one
    value per node, so set it in each node's environment, not on the shared command line); else
    loopback on a single-node job (torchrun's LOCAL_WORLD_SIZE == WORLD_SIZE); else the address of
    this node's interface that routes to MASTER_ADDR (node 0), which every node can reach since it
    already reached the rendezvous through it. Why not one value for all ranks: every node has
    its own address, and a reader dials the address the source advertised (a loopback one sends
    node 1's reads to node 1 itself).

        resolve_host("10.0.0.5", {}) → "10.0.0.5"
        resolve_host("auto", {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4"}) → "127.0.0.1"
        resolve_host("auto", {"GYRE_TRANSFER_HOST": "10.0.0.7"}) → "10.0.0.7"
    """
    env = os.environ if env is None else env
    if host != AUTO_HOST:
        return host
    if env.get(HOST_ENV):
        return env[HOST_ENV]
    world = int(env.get("WORLD_SIZE", "1"))
    if int(env.get("LOCAL_WORLD_SIZE", world)) == world:
        return "127.0.0.1"
    peer = env.get("MASTER_ADDR")
    if not peer:
        raise ValueError(f"--transfer.host auto: a multi-node job without MASTER_ADDR; set {HOST_ENV} on each node "
                         "or --transfer.host to this node's address")
    from gyre.serving import is_loopback, route_address

    routed = route_address(peer)
    if is_loopback(routed):  # e.g. Debian's /etc/hosts maps the node's own name to 127.0.1.1
        # Not raised here (on this node's ranks only, the others would wait for them in the start-up
        # probe): the probe (`check_reachable`) fails on every rank together when another node reads.
        logger.warning("--transfer.host auto: MASTER_ADDR %r routes over loopback (%s) on this node, which other "
                       "nodes cannot reach; set %s on each node to its routable address (or MASTER_ADDR to node 0's "
                       "address rather than a name /etc/hosts maps to 127.x)", peer, routed, HOST_ENV)
    return routed


class PeerUnreachable(RuntimeError):
    """A Mooncake read from another rank's engine failed: names both ends, so a wrong advertised
    address (a loopback one across nodes, a firewalled interface) is visible at once."""


@dataclass(frozen=True)
class SnapshotDescriptor:
    """What a reader needs to pull a served snapshot: Mooncake session, address, layout, CRC."""

    session: str  # "host:rpc_port" of the source's transfer engine
    addr: int
    layout: FlatLayout
    crc: int | None


class MooncakeTransport:
    """Mooncake Transfer Engine: readers pull the source's registered flat buffer one-sidedly.

    The engine listens on all interfaces whatever `host` says (DEPS-NOTES): on a shared
    machine run it inside a private network namespace; on clusters use the RDMA protocol.
    `host` is what readers dial (`resolve_host`: `auto` finds this node's routable address).
    """

    name = "mooncake"

    def __init__(self, group: Any = None, src: int = 0, *, host: str = AUTO_HOST, protocol: str = "tcp",
                 device: str = "", verify: bool = True):
        self.group, self.src, self.verify = group, src, verify
        self.host, self.protocol, self.device = resolve_host(host), protocol, device
        self._engine = None
        self._buf: torch.Tensor | None = None  # registered buffer (source: served; reader: landing)

    # --------------------------------------------------------------- engine and memory
    def _ensure_engine(self):
        if self._engine is None:
            try:
                from mooncake.engine import TransferEngine
            except ImportError as exc:  # lazily imported: only ranks that use Mooncake need it
                raise RuntimeError("MooncakeTransport needs `pip install mooncake-transfer-engine-non-cuda` "
                                   "(CPU, plus Debian libibverbs1) or `mooncake-transfer-engine` (CUDA)") from exc
            engine = TransferEngine()
            rc = engine.initialize(self.host, "P2PHANDSHAKE", self.protocol, self.device)
            if rc != 0:
                raise RuntimeError(f"Mooncake TransferEngine.initialize({self.host!r}, P2PHANDSHAKE, {self.protocol!r}) failed: {rc}")
            self._engine = engine
            logger.info("rank %s: mooncake engine up, advertising %s:%d (%s)", os.environ.get("RANK", "?"), self.host,
                        engine.get_rpc_port(), self.protocol)
        return self._engine

    def _buffer(self, nbytes: int) -> torch.Tensor:
        engine = self._ensure_engine()
        if self._buf is None or self._buf.numel() != nbytes:
            if self._buf is not None:
                engine.unregister_memory(self._buf.data_ptr())
            self._buf = torch.zeros(nbytes, dtype=torch.uint8)
            rc = engine.register_memory(self._buf.data_ptr(), nbytes)
            if rc != 0:
                raise RuntimeError(f"Mooncake register_memory of {nbytes} bytes failed: {rc}")
        return self._buf

    @property
    def session(self) -> str:
        """"host:rpc_port" of this rank's engine (what a reader's transfer_sync_read names)."""
        return f"{self.host}:{self._ensure_engine().get_rpc_port()}"

    def register(self, nbytes: int) -> torch.Tensor:
        """A new uint8 buffer [nbytes] registered with this rank's engine (a retained snapshot)."""
        engine = self._ensure_engine()
        buf = torch.zeros(nbytes, dtype=torch.uint8)
        rc = engine.register_memory(buf.data_ptr(), nbytes)
        if rc != 0:
            raise RuntimeError(f"Mooncake register_memory of {nbytes} bytes failed: {rc}")
        return buf

    def unregister(self, buf: torch.Tensor) -> None:
        if self._engine is not None:
            self._engine.unregister_memory(buf.data_ptr())

    def close(self) -> None:
        if self._engine is not None and self._buf is not None:
            self._engine.unregister_memory(self._buf.data_ptr())
        self._buf = None
        self._engine = None

    # --------------------------------------------------------------- one-sided halves
    def serve(self, params: dict[str, torch.Tensor]) -> SnapshotDescriptor:
        """Source: copy `params` into the registered buffer; return what readers need."""
        layout = FlatLayout.of(params)
        buf = layout.pack(params, out=self._buffer(layout.nbytes))
        return SnapshotDescriptor(f"{self.host}:{self._engine.get_rpc_port()}", buf.data_ptr(), layout,
                                  checksum(buf) if self.verify else None)

    def read(self, desc: SnapshotDescriptor) -> dict[str, torch.Tensor]:
        """Reader: pull the served bytes into this rank's registered buffer and unpack a copy."""
        buf = self._buffer(desc.layout.nbytes)
        self.read_into(desc.session, buf, desc.addr)
        if desc.crc is not None and checksum(buf) != desc.crc:
            raise RuntimeError(f"MooncakeTransport: snapshot checksum mismatch reading from {desc.session}")
        return desc.layout.unpack(buf, copy=True)

    def read_into(self, session: str, buf: torch.Tensor, addr: int) -> None:
        """`transfer_sync_read` of `buf.numel()` bytes at `addr` on `session` into registered `buf`;
        `PeerUnreachable` naming both ends when it fails."""
        rc = self._ensure_engine().transfer_sync_read(session, buf.data_ptr(), addr, buf.numel())
        if rc != 0:
            raise PeerUnreachable(unreachable_message(self.host, session, rc))

    # --------------------------------------------------------------- collective wrapper
    def share(self, params: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        return self.share_over(self.group, self.src, params)

    def share_over(self, group: Any, src: int, params: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
        """`share` over any group and source: the engine (and its registered buffers) is per rank,
        not per group."""
        is_src = dist.get_rank() == src
        if is_src == (params is None):
            raise ValueError(f"share: rank {dist.get_rank()} {'is' if is_src else 'is not'} the source (src={src}); pass params exactly there")
        desc = _announce(self.serve(params) if is_src else None, src, group)
        out, error = params, None
        if not is_src:
            try:
                out = self.read(desc)
            except RuntimeError as e:  # every member must still reach the gather below
                error = f"rank {dist.get_rank()}: {e}"
        # The source keeps its buffer until every reader is done; the gather (not a barrier) also
        # tells every member which reads failed, so the source raises now instead of waiting in a
        # barrier for the group's timeout while the failed reader has left.
        errors = [None] * dist.get_world_size(group)
        dist.all_gather_object(errors, error, group=group)
        failed = [e for e in errors if e is not None]
        if failed:
            raise PeerUnreachable(f"Mooncake broadcast from rank {src} ({desc.session}) failed on "
                                  f"{len(failed)} reader(s): " + "; ".join(failed))
        return out


def probe_target(rank: int, world: int, local_world: int) -> int:
    """Whose engine `rank` reads in the any-to-any probe: the rank one node further on
    (`local_world` ranks a node), or the next rank when the world is one node."""
    return (rank + (local_world if world > local_world else 1)) % world


def check_reachable(mc: MooncakeTransport, owner: int | None, group: Any = None) -> None:
    """Collective over `group` (every member, the same point of start-up): each member reads a
    64-byte probe from another member's engine, then all learn every failure together and raise
    `PeerUnreachable` naming each failed reader's advertised host and the engine it read. So a
    wrong address (one --transfer.host 127.0.0.1 for two nodes) stops every rank within a second at
    start, instead of one rank failing its first read while the others wait on it for the
    group's timeout.

    `owner` given (the weight transport: every rank reads the core's engine only): everyone reads
    `owner`'s engine. `owner` None (KV migration: any rank may read any other's): every member
    reads the member one node further on (LOCAL_WORLD_SIZE ranks; the next rank on one node), so
    every engine's advertised address is read, and from another node when there is one (a wrong
    address on one node alone would pass a probe that read only rank 0's engine)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    probe = mc.register(64) if owner is None or rank == owner else None
    if owner is None:
        boards: list[Any] = [None] * world
        dist.all_gather_object(boards, (mc.session, probe.data_ptr()), group=group)
        target = probe_target(rank, world, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        session, addr = boards[target]
        read = target != rank
    else:
        target = owner
        session, addr = _announce((mc.session, probe.data_ptr()) if probe is not None else None, owner, group)
        read = rank != owner
    error = None
    if read:
        land = mc.register(64)
        try:
            mc.read_into(session, land, addr)
        except PeerUnreachable as e:
            error = (f"rank {rank} (advertising {mc.host})"
                     + (f" reading rank {target}'s engine at {session}" if owner is None else "") + f": {e}")
        finally:
            mc.unregister(land)
    errors = [None] * world
    dist.all_gather_object(errors, error, group=group)
    if probe is not None:
        mc.unregister(probe)
    failed = [e for e in errors if e is not None]
    if failed:
        whose = f"rank {owner}'s Mooncake engine at {session}" if owner is not None else "another rank's Mooncake engine"
        raise PeerUnreachable(f"{len(failed)} rank(s) cannot reach {whose}: " + "; ".join(failed))
    logger.info("rank %d: Mooncake engine at %s read by its peer%s", rank, mc.session,
                f" (rank {owner}'s)" if owner is not None else "")


def unreachable_message(own_host: str, session: str, rc: int) -> str:
    """Why a read from `session` failed, naming this rank's advertised host and the peer's."""
    peer = session.rsplit(":", 1)[0]
    from gyre.serving import is_loopback

    hint = ""
    if is_loopback(peer):  # the cross-node failure seen in practice: one --transfer.host 127.0.0.1 for all
        hint = (" — a loopback address reaches only the reader's own node; if the source is on another node, "
                f"use --transfer.host auto (the default) or set {HOST_ENV} on each node")
    return (f"Mooncake transfer_sync_read from {session} failed (rc {rc}); this rank advertises {own_host}, "
            f"the source {peer}{hint}")


def make_transport(kind: str, group: Any = None, src: int = 0, **kwargs) -> ParameterTransport:
    """'torch' | 'mooncake' → a transport (kwargs: see the classes; `verify` for both)."""
    if kind == "torch":
        return TorchDistTransport(group, src, verify=kwargs.get("verify", True))
    if kind == "mooncake":
        return MooncakeTransport(group, src, **kwargs)
    raise ValueError(f"transport: unknown kind {kind!r}; choose 'torch' or 'mooncake'")
