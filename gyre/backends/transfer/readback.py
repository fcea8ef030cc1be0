"""A weight read-back after an update: does the engine serve what the actor sent?

SGLang's `load_weights` skips or only warns on a parameter name it does not know (sglang 0.5.23
models/qwen3.py:760, llama.py:779, qwen2.py:719 log "Parameter {name} not found in params_dict";
qwen3_moe.py:1224, 1244, 1266 skip silently) and never checks that every parameter arrived. A
mapping slip on Gyre's side (a renamed parameter) would therefore serve stale weights with no
error: off-policy training nobody sees. So after the first update, and after every update while
`--transfer.verify` is on, the worker reads a sample of parameters back from the engine and
compares them with the tensors it sent (`check`); a mismatch stops the run naming the parameter.

What is compared: the first `rows` rows of each sampled tensor (a 1-D tensor: its first `rows`
elements), as float32, which is what SGLang's `get_weights_by_name(name, truncate_size=rows)`
returns (models/llama.py:819-890: `.cpu().to(float32).numpy().tolist()[:truncate_size]`). With TP
that call returns TP rank 0's part: the first rows of a column-parallel or vocab-parallel
parameter (q/k/v, gate/up, embed, lm_head: rank 0 holds rows 0.., narrowed to its own q/k/v or
gate/up slice, llama.py:848-875), a row-parallel one all-gathered on dim 1 (o_proj, down_proj,
:879-882), so the first rows equal the full tensor's first rows whenever `rows` ≤ a shard's rows.
The sent tensor is cast to the engine's dtype first; both sides' sums (a checksum) are in the error.

The sample: at the first update every parameter (a systematic slip - one kind renamed in every
layer - shows at once); later, one parameter per layer plus one of the non-layer ones, rotating
with the version so every parameter is read within a few updates.
"""

from __future__ import annotations

import logging
import re
from typing import Any, Callable

import torch

logger = logging.getLogger(__name__)

ROWS = 4
UNREADABLE = "unreadable"  # a read answer: the engine cannot read this parameter back (not a mismatch)
_LAYER = re.compile(r"\.layers\.(\d+)\.")


class WeightReadbackMismatch(RuntimeError):
    """The engine serves something other than what was sent (names the parameter)."""


def sample(names: list[str], version: int, *, full: bool) -> list[str]:
    """Which parameters to read back: all of them when `full`, else one per layer and one of the
    rest, chosen by `version` (so successive updates cover every parameter)."""
    if full:
        return list(names)
    groups: dict[str, list[str]] = {}
    for name in names:
        m = _LAYER.search(name)
        groups.setdefault(m.group(1) if m else "rest", []).append(name)
    return [sorted(g)[version % len(g)] for _, g in sorted(groups.items())]


def head(t: torch.Tensor, rows: int) -> torch.Tensor:
    """The first `rows` rows (1-D: elements) as float32 on CPU, flattened."""
    return t.detach()[:rows].to("cpu", torch.float32).reshape(-1)


def mismatch(name: str, sent: torch.Tensor, got: Any, dtype: torch.dtype, rows: int) -> str | None:
    """Why `got` (the engine's answer) is not `sent`'s first rows in `dtype`; None when it is."""
    if got is None:
        return f"{name}: the engine has no such parameter"
    want = head(sent.detach()[:rows].to(dtype), rows)
    have = torch.as_tensor(got, dtype=torch.float32).reshape(-1)
    if have.numel() != want.numel():
        return f"{name}: read {have.numel()} values back, sent {want.numel()}"
    # Equal up to one rounding step of the engine's dtype (an engine may round once more on load).
    tol = torch.finfo(dtype).eps * want.abs() + 1e-6 if dtype.is_floating_point else torch.zeros_like(want)
    bad = (have - want).abs() > tol
    bad &= ~(have.isnan() & want.isnan())
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        return (f"{name}: value {i} is {have[i].item():.6g} in the engine, {want[i].item():.6g} sent "
                f"(checksum of the first {rows} rows: engine {have.double().sum().item():.6g}, "
                f"sent {want.double().sum().item():.6g})")
    return None


def check(read: Callable[[list[str], int], dict[str, Any]], params: dict[str, torch.Tensor], version: int, *,
          dtype: torch.dtype | None, full: bool, rows: int = ROWS, engine: str = "engine") -> int:
    """Read a sample of `params` back through `read(names, rows)` and compare; raise
    WeightReadbackMismatch naming every parameter that differs. Answers of UNREADABLE are skipped
    (counted in the log). Returns how many parameters were compared."""
    names = sample(sorted(params), version, full=full)
    got = read(names, rows)
    unreadable = [n for n in names if got.get(n, None) is UNREADABLE or isinstance(got.get(n), str)]
    bad = []
    for name in names:
        if name in unreadable:
            continue
        sent = params[name]
        why = mismatch(name, sent, got.get(name), dtype or sent.dtype, rows)
        if why:
            bad.append(why)
    if bad:
        raise WeightReadbackMismatch(f"{engine} version {version}: {len(bad)} of {len(names) - len(unreadable)} "
                                     f"parameters read back differ from the weights sent (a name the engine "
                                     f"skipped on load?): " + "; ".join(bad[:5]))
    compared = len(names) - len(unreadable)
    logger.info("%s version %d: %d parameters read back equal the weights sent%s", engine, version, compared,
                f" ({len(unreadable)} cannot be read back)" if unreadable else "")
    return compared
