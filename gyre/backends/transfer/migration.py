"""KV-cache migration of a running request between engines (docs/backends.md, "KV migration on reroute").

When a cell drains, the router may move an in-flight call instead of recomputing its prefix: its
KV (every layer), the tokens, log-probs and versions so far, and its sampling state (the RNG's
exact position), so the continuation is token for token what the source would have produced
(given the same batch composition; see `CpuEngine.export_request`). Two-phase handshake, driven by
the router with small control messages (never the KV itself):

    router → source  migrate_out(rid)        source stops decoding rid between steps, packs its
                                             state into one flat buffer, *holds* it on its KV
                                             transport under a key; replies (events, handle)
    router → target  migrate_in(rid', handle) target pulls the bytes (gloo p2p, Mooncake, or
                                             in-process), checks them, parks the request; ack
    router → source  migrate_release(key)    only now the source drops the held buffer
    router → target  generate(rid', prompt + generated, sampling)   adopts the parked state

Any failure leaves the router with the events it already has: it releases what the source holds
(best effort) and falls back to recompute. Nothing is aborted.

Ticket lifecycle on the source (`TicketState`): HELD → RELEASED (after the target's ack, or after
a failed migration). RELEASED is final; releasing twice is harmless, pulling a released ticket
raises KeyError. The flat buffer is self-describing, no pickle (it crosses processes):

    [8 bytes little-endian header length][header JSON, padded to 64][tensor bytes per `specs`]
"""

from __future__ import annotations

import dataclasses
import enum
import json
import logging
import secrets
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from gyre.backends.protocols import SamplingParams, TokenEvent
from gyre.backends.transfer.snapshots import FlatLayout, PeerUnreachable, TensorSpec, checksum

logger = logging.getLogger(__name__)

_HDR = struct.Struct("<Q")
_ALIGN = 64


class MigrationRefused(RuntimeError):
    """An engine declined to export or import a request (the router falls back to recompute)."""


# ------------------------------------------------------------------------------------------ state
@dataclass
class RequestState:
    """Everything a running request needs to continue on another engine.

    kv_k / kv_v: per layer [nkv, kv_length, hd] (the tokens prompt + events[:-1]; the last
    generated token is not fed yet, exactly as between two decode steps). rng_state: the sampling
    generator's `get_state()` (uint8), on `rng_device`. sampling: the request's SamplingParams as
    the source got them (min_tokens progress = len(events)). kv_version: the weight version the
    KV was computed under (tokens carry their own in events)."""

    prompt: list[int]
    events: list[TokenEvent]
    sampling: SamplingParams
    kv_k: list[torch.Tensor]
    kv_v: list[torch.Tensor]
    kv_length: int
    kv_version: int
    rng_state: torch.Tensor
    rng_device: str = "cpu"
    model: dict[str, Any] = field(default_factory=dict)  # num_layers, num_kv_heads, head_dim, dtype

    def sequence(self) -> list[int]:
        return self.prompt + [e.token_id for e in self.events]


def _event_row(ev: TokenEvent) -> list:
    return [ev.token_id, ev.logprob, ev.version, ev.finish_reason, ev.top]


def pack_state(state: RequestState) -> torch.Tensor:
    """One flat uint8 buffer (host memory; KV on an accelerator is copied out) holding `state`."""
    tensors = {f"k{i}": t for i, t in enumerate(state.kv_k)} | {f"v{i}": t for i, t in enumerate(state.kv_v)}
    tensors["rng"] = state.rng_state
    layout = FlatLayout.of(tensors)
    meta = {"prompt": state.prompt, "events": [_event_row(e) for e in state.events],
            "sampling": dataclasses.asdict(state.sampling), "kv_length": state.kv_length,
            "kv_version": state.kv_version, "rng_device": state.rng_device, "model": state.model,
            "specs": [[s.name, list(s.shape), s.dtype, s.offset, s.nbytes] for s in layout.specs]}
    header = json.dumps(meta, separators=(",", ":")).encode()
    start = (_HDR.size + len(header) + _ALIGN - 1) // _ALIGN * _ALIGN
    buf = torch.zeros(start + layout.nbytes, dtype=torch.uint8)
    buf[: _HDR.size] = torch.frombuffer(bytearray(_HDR.pack(len(header))), dtype=torch.uint8)
    buf[_HDR.size : _HDR.size + len(header)] = torch.frombuffer(bytearray(header), dtype=torch.uint8)
    layout.pack(tensors, out=buf[start:])
    return buf


def unpack_state(buf: torch.Tensor) -> RequestState:
    """The inverse of `pack_state` (tensors are copies on the host; the importer moves them)."""
    if buf.dtype != torch.uint8 or buf.numel() < _HDR.size:
        raise ValueError("unpack_state: not a migration buffer")
    (n,) = _HDR.unpack(bytes(buf[: _HDR.size].tolist()))
    if _HDR.size + n > buf.numel():
        raise ValueError(f"unpack_state: header of {n} bytes runs past the {buf.numel()}-byte buffer")
    meta = json.loads(bytes(buf[_HDR.size : _HDR.size + n].numpy()).decode())
    start = (_HDR.size + n + _ALIGN - 1) // _ALIGN * _ALIGN
    specs = tuple(TensorSpec(name, tuple(shape), dtype, off, nb) for name, shape, dtype, off, nb in meta["specs"])
    end = max((s.offset + s.nbytes for s in specs), default=0)
    if start + end > buf.numel():
        raise ValueError("unpack_state: tensors run past the end of the buffer")
    t = FlatLayout(specs, end).unpack(buf[start:], copy=True)
    layers = sum(1 for s in specs if s.name.startswith("k"))
    events = [TokenEvent(int(r[0]), float(r[1]), int(r[2]), r[3],
                         [(int(a), float(b)) for a, b in r[4]] if r[4] is not None else None) for r in meta["events"]]
    return RequestState(prompt=[int(x) for x in meta["prompt"]], events=events,
                        sampling=SamplingParams(**meta["sampling"]),
                        kv_k=[t[f"k{i}"] for i in range(layers)], kv_v=[t[f"v{i}"] for i in range(layers)],
                        kv_length=int(meta["kv_length"]), kv_version=int(meta["kv_version"]), rng_state=t["rng"],
                        rng_device=meta["rng_device"], model=meta["model"])


# ------------------------------------------------------------------------------------------ transports
class KvTransport(Protocol):
    """Moves a held flat buffer from the source engine's process to the target's.

    Source side: `hold(key, buf)` keeps `buf` readable under `key` and returns a small JSON-able
    handle (what the router carries); `drop(key)` forgets it. Target side: `pull(handle)` returns
    the bytes (raises on transport errors, KeyError when the source no longer holds `key`)."""

    name: str

    def hold(self, key: str, buf: torch.Tensor) -> dict[str, Any]: ...

    def drop(self, key: str) -> None: ...

    def pull(self, handle: dict[str, Any]) -> torch.Tensor: ...

    def close(self) -> None: ...


class _Held:
    """The buffers a source holds, by key (thread-safe: a server thread reads them)."""

    def __init__(self) -> None:
        self._bufs: dict[str, tuple[torch.Tensor, int]] = {}
        self._lock = threading.Lock()

    def put(self, key: str, buf: torch.Tensor) -> int:
        crc = checksum(buf)
        with self._lock:
            self._bufs[key] = (buf, crc)
        return crc

    def get(self, key: str) -> tuple[torch.Tensor, int] | None:
        with self._lock:
            return self._bufs.get(key)

    def pop(self, key: str) -> None:
        with self._lock:
            self._bufs.pop(key, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._bufs)


_local: dict[str, "LocalKvTransport"] = {}  # in-process transports by owner name


class LocalKvTransport:
    """Engines in one process (tests, the in-process benchmark): a pull copies the held buffer.
    Still two-phase: a dropped key cannot be pulled."""

    name = "local"

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self.held = _Held()
        _local[owner] = self

    def hold(self, key: str, buf: torch.Tensor) -> dict[str, Any]:
        crc = self.held.put(key, buf)
        return {"transport": self.name, "source": self.owner, "key": key, "nbytes": buf.numel(), "crc": crc}

    def drop(self, key: str) -> None:
        self.held.pop(key)

    def pull(self, handle: dict[str, Any]) -> torch.Tensor:
        src = _local.get(handle["source"])
        entry = src.held.get(handle["key"]) if src is not None else None
        if entry is None:
            raise KeyError(f"migration {handle['key']}: not held by {handle['source']} (released or gone)")
        return entry[0].clone()

    def close(self) -> None:
        _local.pop(self.owner, None)


_OK, _MISSING = 0, 1


class GlooKvTransport:
    """Gloo point-to-point between engine ranks, modelled on `weights.TorchWeights`: a request
    (reader rank, key) goes on the source's store queue `<ns>/req/<rank>`; the source's server
    thread answers with [status, nbytes, crc] and the buffer, sent to that reader only, over a
    gloo group used by nothing else (every rank creates it up front). Pulls from one process are
    serialized (one receive per source at a time keeps the messages in order)."""

    name = "gloo"

    def __init__(self, store: Any, group: Any, *, namespace: str = "kvm", poll_s: float = 0.002,
                 max_poll_s: float = 0.05) -> None:
        import torch.distributed as dist

        self.store, self.group, self.ns, self.poll_s, self.max_poll_s = store, group, namespace, poll_s, max_poll_s
        self.rank = dist.get_rank()
        self.held = _Held()
        self._pull_lock = threading.Lock()
        self._stop = threading.Event()
        self._server = threading.Thread(target=self._serve, name="gyre-kv-server", daemon=True)
        self._server.start()

    def hold(self, key: str, buf: torch.Tensor) -> dict[str, Any]:
        crc = self.held.put(key, buf)
        return {"transport": self.name, "rank": self.rank, "key": key, "nbytes": buf.numel(), "crc": crc}

    def drop(self, key: str) -> None:
        self.held.pop(key)

    def pull(self, handle: dict[str, Any]) -> torch.Tensor:
        import torch.distributed as dist

        src = int(handle["rank"])
        with self._pull_lock:
            self.store.queue_push(f"{self.ns}/req/{src}", f"{self.rank} {handle['key']}".encode())
            header = torch.empty(3, dtype=torch.int64)
            dist.recv(header, src=src, group=self.group)
            status, n, crc = header.tolist()
            if status == _MISSING:
                raise KeyError(f"migration {handle['key']}: not held by rank {src} (released or gone)")
            buf = torch.empty(n, dtype=torch.uint8)
            dist.recv(buf, src=src, group=self.group)
        if checksum(buf) != crc:
            raise RuntimeError(f"migration {handle['key']} from rank {src}: checksum mismatch")
        return buf

    def _serve(self) -> None:
        import torch.distributed as dist

        from gyre.backoff import Backoff

        key = f"{self.ns}/req/{self.rank}"
        # Every engine rank runs this server: backed off while no request comes (a fixed 2 ms poll
        # was 500 store requests/s a rank; benchmarks/store_poll_bench.py), fast again after one.
        backoff = Backoff(self.poll_s, max(self.poll_s, self.max_poll_s))
        while not self._stop.is_set():
            try:
                if self.store.queue_len(key) == 0:
                    self._stop.wait(backoff.next())
                    continue
                backoff.reset()
                reader, mkey = self.store.queue_pop(key).decode().split(" ", 1)
            except Exception as e:  # the store went away: the job is ending
                if not self._stop.is_set():
                    logger.warning("kv server on rank %d stopped: %r", self.rank, e)
                return
            entry = self.held.get(mkey)
            try:
                if entry is None:
                    dist.send(torch.tensor([_MISSING, 0, 0]), dst=int(reader), group=self.group)
                    continue
                buf, crc = entry
                dist.send(torch.tensor([_OK, buf.numel(), crc]), dst=int(reader), group=self.group)
                dist.send(buf, dst=int(reader), group=self.group)
            except Exception as e:  # that reader went away; others are still served
                logger.warning("kv server: answering rank %s failed: %r", reader, e)

    def close(self) -> None:
        self._stop.set()
        self._server.join(timeout=5)


class MooncakeKvTransport:
    """Mooncake Transfer Engine: the source registers each held buffer; the target reads it
    one-sidedly (`transfer_sync_read`, TCP here, RDMA on clusters) into a buffer of its own."""

    name = "mooncake"

    def __init__(self, *, host: str = "auto", protocol: str = "tcp", device: str = "", probe: bool = False) -> None:
        """`probe`: collective over the world, every rank's engine is read by another rank now (one
        node further on: `transfer.check_reachable` with no owner), so a wrong address on any node
        fails the start instead of turning migrations out of that node into recomputes."""
        from gyre.backends.transfer.snapshots import MooncakeTransport, check_reachable

        self._mc = MooncakeTransport(host=host, protocol=protocol, device=device, verify=True)
        self._mc._ensure_engine()  # now, not inside the first migration's latency
        if probe:
            check_reachable(self._mc, owner=None)
        self.held = _Held()
        self._registered: dict[str, torch.Tensor] = {}

    def hold(self, key: str, buf: torch.Tensor) -> dict[str, Any]:
        reg = self._mc.register(buf.numel())
        reg.copy_(buf)
        self._registered[key] = reg
        crc = self.held.put(key, reg)
        return {"transport": self.name, "session": self._mc.session, "addr": reg.data_ptr(), "key": key,
                "nbytes": reg.numel(), "crc": crc}

    def drop(self, key: str) -> None:
        self.held.pop(key)
        reg = self._registered.pop(key, None)
        if reg is not None:
            self._mc.unregister(reg)

    def pull(self, handle: dict[str, Any]) -> torch.Tensor:
        n = int(handle["nbytes"])
        land = self._mc.register(n)
        try:
            try:
                self._mc.read_into(handle["session"], land, int(handle["addr"]))
            except PeerUnreachable as e:
                raise PeerUnreachable(f"migration {handle['key']}: {e}") from None
            if checksum(land) != int(handle["crc"]):
                raise RuntimeError(f"migration {handle['key']}: checksum mismatch (the source released it mid-read?)")
            return land.clone()
        finally:
            self._mc.unregister(land)

    def close(self) -> None:
        for key in list(self._registered):
            self.drop(key)
        self._mc.close()


# ------------------------------------------------------------------------------------------ source tickets
class TicketState(enum.Enum):
    HELD = "held"
    RELEASED = "released"


@dataclass(eq=False)
class Ticket:
    key: str
    nbytes: int
    state: TicketState = TicketState.HELD
    held_at: float = field(default_factory=time.monotonic)


class Tickets:
    """A source engine's held migrations (see the module docstring for the lifecycle)."""

    def __init__(self, transport: KvTransport) -> None:
        self.transport = transport
        self.tickets: dict[str, Ticket] = {}

    def hold(self, request_id: str, buf: torch.Tensor, *, ttl_s: float = 600.0) -> dict[str, Any]:
        now = time.monotonic()
        for old in [k for k, t in self.tickets.items() if now - t.held_at > ttl_s]:
            # never released: the router gave up on it (timed out) or went away
            logger.warning("migration %s held for over %.0fs without a release; dropping it", old, ttl_s)
            self.release(old)
        key = f"{request_id}.{secrets.token_hex(8)}"
        handle = self.transport.hold(key, buf)
        self.tickets[key] = Ticket(key, buf.numel())
        return handle

    def release(self, key: str) -> bool:
        """Drop a held buffer (after the target's ack, or a failed migration). False: unknown key."""
        ticket = self.tickets.pop(key, None)
        if ticket is None:
            return False
        ticket.state = TicketState.RELEASED
        self.transport.drop(key)
        return True


def build_kv_transport(kind: str, store: Any = None, group: Any = None, *, host: str = "auto",
                       protocol: str = "tcp", device: str = "") -> KvTransport:
    """'gloo' (store + a gloo group every rank created up front) | 'mooncake' (advertising
    `host`, as the Mooncake weight transport: --transfer.host / mooncake-protocol / -device) |
    'local' (one process)."""
    if kind == "gloo":
        return GlooKvTransport(store, group)
    if kind == "mooncake":  # every rank builds it at the same point of start-up: probe the addresses
        try:
            return MooncakeKvTransport(host=host, protocol=protocol, device=device, probe=True)
        except PeerUnreachable as e:  # an address (--transfer.host, GYRE_TRANSFER_HOST): a refused config
            from gyre.errors import ConfigError

            raise ConfigError(f"--proxy.migration-transport mooncake: {e}") from None
    if kind == "local":
        return LocalKvTransport(f"local-{secrets.token_hex(4)}")
    raise ValueError(f"KV transport must be gloo, mooncake or local, got {kind!r}")
