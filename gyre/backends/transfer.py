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
(`verify=True`) and raises on a mismatch. Publishing weights to rollout engines uses the same
call followed by `engine.update_weights(params, version)`.
"""

from __future__ import annotations

import logging
import zlib
from dataclasses import dataclass
from typing import Any, Protocol

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
    """Broadcast the flat parameter buffer from `src` over `group` (torch.distributed)."""

    name = "torch"

    def __init__(self, group: Any = None, src: int = 0, *, verify: bool = True):
        self.group, self.src, self.verify = group, src, verify

    def share(self, params: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        is_src = dist.get_rank() == self.src
        if is_src == (params is None):
            raise ValueError(f"share: rank {dist.get_rank()} {'is' if is_src else 'is not'} the source (src={self.src}); pass params exactly there")
        if is_src:
            layout = FlatLayout.of(params)
            buf = layout.pack(params)
            _announce((layout, checksum(buf) if self.verify else None), self.src, self.group)
            dist.broadcast(buf, src=self.src, group=self.group)
            return params
        layout, crc = _announce(None, self.src, self.group)
        buf = torch.empty(layout.nbytes, dtype=torch.uint8)
        dist.broadcast(buf, src=self.src, group=self.group)
        if crc is not None and checksum(buf) != crc:
            raise RuntimeError("TorchDistTransport: snapshot checksum mismatch")
        return layout.unpack(buf, copy=False)


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
    """

    name = "mooncake"

    def __init__(self, group: Any = None, src: int = 0, *, host: str = "127.0.0.1", protocol: str = "tcp",
                 device: str = "", verify: bool = True):
        self.group, self.src, self.verify = group, src, verify
        self.host, self.protocol, self.device = host, protocol, device
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
            logger.info("mooncake engine up at %s:%d (%s)", self.host, engine.get_rpc_port(), self.protocol)
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
        rc = self._engine.transfer_sync_read(desc.session, buf.data_ptr(), desc.addr, desc.layout.nbytes)
        if rc != 0:
            raise RuntimeError(f"Mooncake transfer_sync_read from {desc.session} failed: {rc}")
        if desc.crc is not None and checksum(buf) != desc.crc:
            raise RuntimeError(f"MooncakeTransport: snapshot checksum mismatch reading from {desc.session}")
        return desc.layout.unpack(buf, copy=True)

    # --------------------------------------------------------------- collective wrapper
    def share(self, params: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        is_src = dist.get_rank() == self.src
        if is_src == (params is None):
            raise ValueError(f"share: rank {dist.get_rank()} {'is' if is_src else 'is not'} the source (src={self.src}); pass params exactly there")
        desc = _announce(self.serve(params) if is_src else None, self.src, self.group)
        out = params if is_src else self.read(desc)
        dist.barrier(group=self.group)  # the source keeps its buffer until every reader is done
        return out


def make_transport(kind: str, group: Any = None, src: int = 0, **kwargs) -> ParameterTransport:
    """'torch' | 'mooncake' → a transport (kwargs: see the classes; `verify` for both)."""
    if kind == "torch":
        return TorchDistTransport(group, src, verify=kwargs.get("verify", True))
    if kind == "mooncake":
        return MooncakeTransport(group, src, **kwargs)
    raise ValueError(f"transport: unknown kind {kind!r}; choose 'torch' or 'mooncake'")
