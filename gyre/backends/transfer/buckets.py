"""Bucketed weight updates: one logical update (one version) moved in pieces of bounded size.

Staging a whole update on the engine's device (a full copy per TP rank for SGLang, a second
`DecoderWeights` for the built-in engine) costs a model's size on top of the engine's weights and
KV cache (docs/gpu-sglang.md, "Will it fit?"). Every path that moves weights to an engine moves them in buckets of at most `--transfer.bucket-mb` (`plan`), each freed before the
next is staged, so the extra memory per GPU during an update is one bucket, flat in model size. A
single tensor larger than the bucket travels alone, so the bound is max(bucket, largest tensor) ≤
bucket + one tensor.

One version however many buckets: the engine's served version changes only with the last bucket
(SGLang: `weight_version` and `flush_cache` on the final `update_weights_from_tensor` call; the
built-in engine: the version is set after its final copy, and no decode step runs between buckets).

`HeldBytes` counts the bytes an update holds at once (the staged copies), and its peak: what the
built-in engine and the conformance fake report, and tests bound.
"""

from __future__ import annotations

import threading
from typing import Iterable, Sequence

import torch

MIB = 1 << 20


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def bucket_bytes(mb: float) -> int:
    """`--transfer.bucket-mb` in bytes (refused unless positive: a zero bucket holds nothing)."""
    if not mb > 0:
        raise ValueError(f"--transfer.bucket-mb must be > 0, got {mb}")
    return max(1, int(mb * MIB))


def plan(sizes: Sequence[tuple[str, int]] | Iterable[tuple[str, int]], limit: int) -> list[list[str]]:
    """Names grouped into consecutive buckets of at most `limit` bytes each, order kept; a tensor
    of more than `limit` bytes is a bucket of its own. Every name lands in exactly one bucket."""
    if limit <= 0:
        raise ValueError(f"bucket size must be > 0 bytes, got {limit}")
    out: list[list[str]] = []
    cur: list[str] = []
    held = 0
    for name, size in sizes:
        if cur and held + size > limit:
            out.append(cur)
            cur, held = [], 0
        cur.append(name)
        held += size
    if cur:
        out.append(cur)
    return out


def plan_tensors(named: Sequence[tuple[str, torch.Tensor]], limit: int) -> list[list[tuple[str, torch.Tensor]]]:
    """`plan` over (name, tensor) pairs, returning the pairs themselves."""
    by_name = dict(named)
    return [[(n, by_name[n]) for n in bucket] for bucket in plan([(n, nbytes(t)) for n, t in named], limit)]


class HeldBytes:
    """Bytes an update holds at once and the peak since `reset` (thread-safe: an engine may stage
    in a worker thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.now = 0
        self.peak = 0

    def reset(self) -> None:
        with self._lock:
            self.now = self.peak = 0

    def add(self, n: int) -> None:
        with self._lock:
            self.now += n
            self.peak = max(self.peak, self.now)

    def sub(self, n: int) -> None:
        with self._lock:
            self.now -= n
