"""Append-only on-disk TITO store: one binary file per execution (docs/design.md §4, docs/trajectory.md).

File layout (little-endian):

    header   b"GYRETITO" | u32 format version | u32 reserved                      16 bytes
    frame*   u32 FRAME_MAGIC | u32 payload length P | u32 crc32(payload) | payload   12 + P bytes
    payload  struct _REC (call id, role, policy version, start, end, ref, shared, |I| − shared,
             |O|, |M|, meta length) | meta JSON (execution id, finish reason, payload_ref)
             | input_ids[shared:] int32 | output_ids int32[O] | output_logprobs float32[O]
             | output_versions int32[O] | message_starts int32[M]

Prefix sharing: a call's input usually repeats an earlier call's input + output, so the writer
stores only `ref` (an earlier record of this file among the last `delta_window`) and `shared`
(the prefix length, ≥ 32 tokens) instead of the prefix. References point backwards only, so a
torn tail never breaks an earlier record. Each frame goes to disk in one `write` on an O_APPEND
descriptor; on load, a frame cut short, a last frame with a bad checksum or a zero-filled tail is
a *torn tail*: dropped, reported (`StoreReadResult.torn_tail_bytes`) and truncated by the next
`TitoWriter`. Any other damage raises `StoreCorruptError` naming the file and offset.

Sealing: `TitoWriter.seal()` closes the file and makes it read-only (mode 0444); a sealed file is
complete (its execution was closed) and `TitoWriter` refuses to open it again (`SealedError`),
so no record is ever appended after the close. `TitoWriter.append` is thread-safe; one writer
per execution file per process (two processes appending to one file is not supported).
"""

from __future__ import annotations

import json
import logging
import os
import stat
import struct
import threading
import zlib
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gyre.ids import check_id
from gyre.trajectory.record import CallRecord, Role

logger = logging.getLogger(__name__)

__all__ = [
    "FORMAT_VERSION",
    "StoreCorruptError",
    "SealedError",
    "StoreReadResult",
    "CallHead",
    "TitoStore",
    "TitoWriter",
    "encode_record",
    "load_execution",
    "read_execution",
    "read_heads",
]

FILE_MAGIC = b"GYRETITO"
FORMAT_VERSION = 1
_FILE_HEADER = struct.Struct("<8sII")
FRAME_MAGIC = 0x30544954  # b"TIT0"
_FRAME = struct.Struct("<III")
# call_id, role, policy_version, start_time, end_time, ref, shared, n_in_tail, n_out, n_msg, meta_len
_REC = struct.Struct("<qBqddiIIIII")
_MIN_SHARED = 32  # shorter common prefixes are stored verbatim
_MAX_SEGMENTS = 64  # a recent sequence in more pieces than this is joined (TitoWriter's window)


class StoreCorruptError(RuntimeError):
    """A store file is damaged somewhere other than its last frame (not a torn tail)."""


class SealedError(ValueError):
    """The execution's file was sealed (closed for good): nothing may be appended."""


def is_sealed(path: str | os.PathLike) -> bool:
    """Was this store file sealed (`TitoWriter.seal`: no write permission left)?"""
    try:
        return stat.S_IMODE(os.stat(path).st_mode) & 0o222 == 0
    except FileNotFoundError:
        return False


@dataclass
class StoreReadResult:
    """What `read_execution` found: the records, and how many tail bytes were torn and dropped."""

    records: list[CallRecord]
    valid_bytes: int  # length of the valid prefix of the file (header + whole frames)
    torn_tail_bytes: int  # bytes after the valid prefix that were dropped (0 = clean file)
    num_frames: int = 0  # whole records in the valid prefix

    @property
    def torn(self) -> bool:
        return self.torn_tail_bytes > 0


def encode_record(record: CallRecord, ref: int = -1, shared: int = 0) -> bytes:
    """One framed record (frame header + payload), ready to append. With `ref` >= 0 the first
    `shared` input tokens are not stored: they equal the first `shared` tokens of the full
    sequence (input + output) of record number `ref` of the same file (the caller checked)."""
    if ref < 0:
        shared = 0
    meta = json.dumps(
        {
            "execution_id": record.execution_id,
            "finish_reason": record.finish_reason,
            "payload_ref": record.payload_ref,
        },
        separators=(",", ":"),
    ).encode("utf-8")
    head = _REC.pack(
        int(record.call_id),
        int(record.role),
        int(record.policy_version),
        float(record.start_time),
        float(record.end_time),
        int(ref),
        int(shared),
        len(record.input_ids) - shared,
        len(record.output_ids),
        len(record.message_starts),
        len(meta),
    )
    payload = b"".join(
        (
            head,
            meta,
            record.input_ids[shared:].astype("<i4", copy=False).tobytes(),
            record.output_ids.astype("<i4", copy=False).tobytes(),
            record.output_logprobs.astype("<f4", copy=False).tobytes(),
            record.output_versions.astype("<i4", copy=False).tobytes(),
            record.message_starts.astype("<i4", copy=False).tobytes(),
        )
    )
    return _FRAME.pack(FRAME_MAGIC, len(payload), zlib.crc32(payload)) + payload


def _decode_payload(buf: memoryview, path: str, offset: int, earlier: list[CallRecord]) -> CallRecord:
    call_id, role, version, t0, t1, ref, shared, n_tail, n_out, n_msg, meta_len = _REC.unpack_from(buf, 0)
    p = _REC.size
    expected = p + meta_len + 4 * (n_tail + 3 * n_out + n_msg)
    if expected != len(buf):
        raise StoreCorruptError(f"{path}: frame at offset {offset} declares {expected} bytes of fields in a {len(buf)}-byte payload")
    meta = json.loads(bytes(buf[p : p + meta_len]).decode("utf-8"))
    p += meta_len

    def take(n: int, dtype: str) -> np.ndarray:
        nonlocal p
        arr = np.frombuffer(buf, dtype=dtype, count=n, offset=p)
        p += 4 * n
        return arr

    tail = take(n_tail, "<i4")
    if ref >= 0:
        if ref >= len(earlier):
            raise StoreCorruptError(f"{path}: frame at offset {offset} refers to record {ref}, only {len(earlier)} precede it")
        src = earlier[ref]
        n_src_in = len(src.input_ids)
        if shared > n_src_in + len(src.output_ids):
            raise StoreCorruptError(f"{path}: frame at offset {offset} shares {shared} tokens of a shorter record {ref}")
        input_ids = np.empty(shared + n_tail, np.int32)
        k = min(shared, n_src_in)
        input_ids[:k] = src.input_ids[:k]
        input_ids[k:shared] = src.output_ids[: shared - k]
        input_ids[shared:] = tail
    else:
        input_ids = tail.copy()
    return CallRecord(
        execution_id=meta["execution_id"],
        call_id=call_id,
        role=Role(role),
        input_ids=input_ids,
        output_ids=take(n_out, "<i4").copy(),
        output_logprobs=take(n_out, "<f4").copy(),
        policy_version=version,
        start_time=t0,
        end_time=t1,
        finish_reason=meta["finish_reason"],
        output_versions=take(n_out, "<i4").copy(),
        message_starts=take(n_msg, "<i4").copy(),
        payload_ref=meta["payload_ref"],
    )


def _scan(data: bytes, path: str, decode: bool, decoder=_decode_payload) -> StoreReadResult:
    """Walk the frames of a whole file held in `data`; see the module docstring for the rules.
    `decoder(payload, path, offset, earlier)` makes one entry of `records` (`decode`: any)."""
    size = len(data)
    if size < _FILE_HEADER.size:
        # A file whose header itself is torn holds no records.
        if FILE_MAGIC.startswith(data[: len(FILE_MAGIC)]):
            return StoreReadResult([], 0, size, 0)
        raise StoreCorruptError(f"{path}: not a TITO store (bad header)")
    magic, version, _ = _FILE_HEADER.unpack_from(data, 0)
    if magic != FILE_MAGIC:
        raise StoreCorruptError(f"{path}: not a TITO store (magic {magic!r})")
    if version != FORMAT_VERSION:
        raise StoreCorruptError(f"{path}: format version {version}, this build reads {FORMAT_VERSION}")
    view = memoryview(data)
    records: list[CallRecord] = []
    frames = 0
    off = _FILE_HEADER.size
    while off < size:
        torn_reason = None
        if size - off < _FRAME.size:
            torn_reason = "incomplete frame header"
        else:
            fmagic, plen, crc = _FRAME.unpack_from(data, off)
            end = off + _FRAME.size + plen
            if fmagic != FRAME_MAGIC:
                if data.count(0, off) == size - off:
                    torn_reason = "zero-filled tail"
                else:
                    raise StoreCorruptError(f"{path}: bad frame magic at offset {off} with data after it")
            elif end > size:
                torn_reason = f"frame needs {end - off} bytes, {size - off} present"
            elif zlib.crc32(view[off + _FRAME.size : end]) != crc:
                if end == size:
                    torn_reason = "checksum mismatch in the last frame"
                else:
                    raise StoreCorruptError(f"{path}: checksum mismatch in the frame at offset {off} with {size - end} bytes after it")
        if torn_reason is not None:
            logger.warning("%s: torn tail at offset %d (%s): dropped %d bytes", path, off, torn_reason, size - off)
            return StoreReadResult(records, off, size - off, frames)
        if decode:
            records.append(decoder(view[off + _FRAME.size : end], path, off, records))
        frames += 1
        off = end
    return StoreReadResult(records, off, 0, frames)


def read_execution(path: str | os.PathLike) -> StoreReadResult:
    """Load every whole record of one execution's store file and report a torn tail, if any."""
    path = os.fspath(path)
    with open(path, "rb") as f:
        data = f.read()
    return _scan(data, path, decode=True)


def load_execution(path: str | os.PathLike) -> list[CallRecord]:
    """Records of one execution in file (append) order; a torn tail is dropped with a warning."""
    return read_execution(path).records


class _Seq:
    """One full sequence (input + output) of a recent record, as int32 segments: the prefix it
    shares with an earlier recent sequence is that one's segments (views, no copy), then its own
    tail. Past `_MAX_SEGMENTS` segments it is joined into one array (one copy per that many calls)."""

    __slots__ = ("parts", "n")

    def __init__(self, parts: list[np.ndarray]) -> None:
        self.parts, self.n = parts, sum(len(p) for p in parts)

    @classmethod
    def extend(cls, base: "_Seq | None", shared: int, record: CallRecord) -> "_Seq":
        tail = np.concatenate([np.asarray(record.input_ids[shared:], dtype=np.int32), np.asarray(record.output_ids, dtype=np.int32)])
        parts = (base.prefix(shared) if base is not None else []) + [tail]
        if len(parts) > _MAX_SEGMENTS:
            parts = [np.concatenate(parts)]
        return cls(parts)

    def prefix(self, k: int) -> list[np.ndarray]:
        out = []
        for p in self.parts:
            if k <= 0:
                break
            out.append(p if len(p) <= k else p[:k])
            k -= len(p)
        return out

    def common_prefix(self, ids: np.ndarray) -> int:
        """Length of the common prefix of this sequence and `ids`."""
        off = 0
        for p in self.parts:
            m = min(len(p), len(ids) - off)
            if m <= 0:
                break
            diff = np.flatnonzero(p[:m] != ids[off : off + m])
            if diff.size:
                return off + int(diff[0])
            off += m
        return off


@dataclass
class CallHead:
    """One record without its arrays decoded: what a proxy resuming an execution reads
    (`read_heads`). `seq` holds input + output ids, sharing prefixes with earlier heads (views,
    no copy), so a long execution's heads cost about its file's size, not Σ input lengths."""

    call_id: int
    role: Role
    finish_reason: str
    payload_ref: dict
    n_input: int
    n_output: int
    seq: _Seq

    def ids(self, start: int, end: int | None = None) -> np.ndarray:
        """input_ids + output_ids, [start:end)."""
        end = self.seq.n if end is None else min(end, self.seq.n)
        out, off = [], 0
        for part in self.seq.parts:  # only the parts that overlap [start, end) are copied
            lo, hi = max(start - off, 0), min(end - off, len(part))
            if lo < hi:
                out.append(part[lo:hi])
            off += len(part)
        return np.concatenate(out) if out else np.zeros(0, np.int32)

    @classmethod
    def of(cls, record: CallRecord) -> "CallHead":
        """The head of a record in memory (`gyre.proxy.sink.MemorySink`)."""
        seq = _Seq([np.concatenate([record.input_ids, record.output_ids]).astype(np.int32, copy=False)])
        return cls(record.call_id, record.role, record.finish_reason, dict(record.payload_ref), len(record.input_ids), len(record.output_ids), seq)


def _decode_head(buf: memoryview, path: str, offset: int, earlier: list[CallHead]) -> CallHead:
    call_id, role, _, _, _, ref, shared, n_tail, n_out, n_msg, meta_len = _REC.unpack_from(buf, 0)
    p = _REC.size
    if p + meta_len + 4 * (n_tail + 3 * n_out + n_msg) != len(buf):
        raise StoreCorruptError(f"{path}: frame at offset {offset}: its fields do not fill its {len(buf)}-byte payload")
    meta = json.loads(bytes(buf[p : p + meta_len]).decode("utf-8"))
    p += meta_len
    own = np.frombuffer(buf, dtype="<i4", count=n_tail + n_out, offset=p).astype(np.int32)  # tail, then output
    base: list[np.ndarray] = []
    if ref >= 0:
        if ref >= len(earlier) or shared > earlier[ref].seq.n:
            raise StoreCorruptError(f"{path}: frame at offset {offset} shares {shared} tokens of record {ref}, which it cannot")
        base = earlier[ref].seq.prefix(shared)
    else:
        shared = 0
    parts = base + [own]
    seq = _Seq(parts if len(parts) <= _MAX_SEGMENTS else [np.concatenate(parts)])
    return CallHead(call_id, Role(role), meta["finish_reason"], meta["payload_ref"], shared + n_tail, n_out, seq)


def read_heads(path: str | os.PathLike) -> tuple[list[CallHead], int]:
    """(the heads of one execution's records in file order, torn tail bytes dropped): its call
    ids, roles, payload refs and ids, without materializing every call's input."""
    path = os.fspath(path)
    with open(path, "rb") as f:
        data = f.read()
    res = _scan(data, path, decode=True, decoder=_decode_head)
    return res.records, res.torn_tail_bytes


class TitoWriter:
    """Appends the records of one execution to its store file. Thread-safe.

    Opening an existing file validates it and truncates a torn tail, so appends always follow
    the last whole record. `fsync=True` makes each append durable before it returns (slower);
    without it a machine crash may lose the most recent records, never corrupt older ones.
    Records of another execution are refused (the proxy maps one API key to one execution).
    `delta_window` full sequences of the latest records are kept in memory to find a shared
    prefix (0 disables prefix sharing). A sequence that shares its prefix with an earlier one
    holds that prefix as views of the earlier one's arrays (`_Seq`), so the window's memory is
    ~4 bytes × the tokens its sequences do not share (one context length for a multi-turn
    execution that only grows), not delta_window × 4 bytes × context length.
    """

    def __init__(self, path: str | os.PathLike, execution_id: str, *, fsync: bool = False, delta_window: int = 4) -> None:
        check_id(execution_id, "execution_id")
        if delta_window < 0:
            raise ValueError(f"delta_window must be >= 0, got {delta_window}")
        self.path = os.fspath(path)
        self.execution_id = execution_id
        self.fsync = fsync
        self.delta_window = delta_window
        self._recent: deque[tuple[int, _Seq]] = deque(maxlen=max(delta_window, 1))
        self._lock = threading.Lock()
        self.num_records = 0  # records in the file
        if is_sealed(self.path):
            raise SealedError(f"{self.path}: sealed (its execution was closed); nothing can be appended")
        if os.path.exists(self.path) and os.path.getsize(self.path) > 0:
            with open(self.path, "rb") as f:
                res = _scan(f.read(), self.path, decode=False)
            if res.torn:
                logger.warning("%s: truncating torn tail of %d bytes before appending", self.path, res.torn_tail_bytes)
                os.truncate(self.path, res.valid_bytes)
            self.num_records = res.num_frames
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        if os.fstat(self._fd).st_size == 0:
            self._write(_FILE_HEADER.pack(FILE_MAGIC, FORMAT_VERSION, 0))

    def _write(self, buf: bytes) -> None:
        view = memoryview(buf)
        while view:
            n = os.write(self._fd, view)
            view = view[n:]
        if self.fsync:
            os.fsync(self._fd)

    def _best_prefix(self, input_ids: np.ndarray) -> tuple[int, int, "_Seq | None"]:
        best_ref, best, best_seq = -1, 0, None
        for idx, seq in self._recent:
            if min(seq.n, len(input_ids)) <= best:
                continue
            k = seq.common_prefix(input_ids)
            if k > best:
                best_ref, best, best_seq = idx, k, seq
        return (best_ref, best, best_seq) if best >= _MIN_SHARED else (-1, 0, None)

    def append(self, record: CallRecord) -> None:
        if record.execution_id != self.execution_id:
            raise ValueError(
                f"record.execution_id {record.execution_id!r} does not match this writer's execution {self.execution_id!r}"
            )
        with self._lock:
            if self._fd < 0:
                raise ValueError(f"{self.path}: writer is closed")
            ref, shared, base = self._best_prefix(record.input_ids) if self.delta_window else (-1, 0, None)
            self._write(encode_record(record, ref, shared))
            if self.delta_window:
                self._recent.append((self.num_records, _Seq.extend(base, shared, record)))
            self.num_records += 1

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
            self._recent.clear()

    def seal(self) -> None:
        """Close for good: the file becomes read-only and no writer opens it again."""
        with self._lock:
            if self._fd >= 0:
                os.fchmod(self._fd, 0o444)
                os.close(self._fd)
                self._fd = -1
            elif os.path.exists(self.path):
                os.chmod(self.path, 0o444)
            self._recent.clear()

    def __enter__(self) -> "TitoWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class TitoStore:
    """A directory of per-execution store files, `<root>/<execution_id>.tito`."""

    SUFFIX = ".tito"

    def __init__(self, root: str | os.PathLike, *, fsync: bool = False, delta_window: int = 4) -> None:
        self.root = Path(root)
        self.fsync = fsync
        self.delta_window = delta_window
        self.root.mkdir(parents=True, exist_ok=True)

    def path_for(self, execution_id: str) -> Path:
        check_id(execution_id, "execution_id")
        return self.root / f"{execution_id}{self.SUFFIX}"

    def writer(self, execution_id: str) -> TitoWriter:
        return TitoWriter(self.path_for(execution_id), execution_id, fsync=self.fsync, delta_window=self.delta_window)

    def load(self, execution_id: str) -> list[CallRecord]:
        return load_execution(self.path_for(execution_id))

    def read(self, execution_id: str) -> StoreReadResult:
        return read_execution(self.path_for(execution_id))

    def heads(self, execution_id: str) -> list[CallHead]:
        """`read_heads` of the execution's file; [] when it has none."""
        path = self.path_for(execution_id)
        return read_heads(path)[0] if os.path.exists(path) else []

    def execution_ids(self) -> list[str]:
        return sorted(p.name[: -len(self.SUFFIX)] for p in self.root.glob(f"*{self.SUFFIX}"))
