"""Which device a tensor lives on: the built-in engine's (`--backend.device`), and the one a
collective over a given process group needs (docs/design.md §3).

gyre.run initialises torch.distributed with "cpu:gloo,cuda:nccl" on CUDA machines (gloo on CPU):
every group then takes CPU tensors over gloo and CUDA tensors over NCCL. Parameters broadcast
over a prefix group and gradients reduced over it should ride NCCL there (GPU memory to GPU
memory, no host copy); a group created with an explicit gloo backend (the torch transport's
own point-to-point group) takes CPU tensors only, and a plain "nccl" group CUDA tensors only.
`collective_device(group)` says which; the pure rule is `device_for_backend`.

    >>> device_for_backend("cpu:gloo,cuda:nccl", torch.device("cuda", 3))
    device(type='cuda', index=3)
    >>> device_for_backend("gloo", torch.device("cuda", 3))
    device(type='cpu')
"""

from __future__ import annotations

import os
from typing import Any

import torch


def device_for_backend(backend: str, cuda_device: torch.device | None) -> torch.device:
    """The device of tensors for a collective on a group whose backend is `backend` (as
    `dist.get_backend(group)` spells it: "gloo", "nccl", "cpu:gloo,cuda:nccl", ...).
    `cuda_device`: this rank's bound GPU, None without CUDA. NCCL where the group has it and this
    rank has a GPU, else CPU (gloo)."""
    b = backend.lower()
    has_nccl = b == "nccl" or "cuda:nccl" in b
    has_cpu = b in ("gloo", "mpi") or "cpu:" in b
    if has_nccl and cuda_device is not None:
        return cuda_device
    if has_cpu:
        return torch.device("cpu")
    if has_nccl:
        raise RuntimeError(f"process group backend {backend!r} takes CUDA tensors only, and this rank has no GPU")
    raise ValueError(f"process group backend {backend!r}: unknown (expected gloo, nccl or 'cpu:gloo,cuda:nccl')")


def collective_device(group: Any) -> torch.device:
    """`device_for_backend` for a live process group (None: the default group)."""
    import torch.distributed as dist

    cuda = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    return device_for_backend(str(dist.get_backend(group)), cuda)


def engine_device(requested: str, cuda_available: bool, local_rank: int) -> torch.device:
    """The built-in engine's device for `--backend.device` (pure: no CUDA call).

        requested   no CUDA         CUDA
        auto        cpu             cuda:LOCAL_RANK (the GPU gyre.run bound)
        cpu         cpu             cpu
        cuda        ConfigError     cuda:LOCAL_RANK
        meta        meta            meta            (tests: shapes only, no memory)
    """
    from gyre.errors import ConfigError

    if requested == "meta":
        return torch.device("meta")
    if requested not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"--backend.device {requested!r}: choose one of auto, cpu, cuda")
    if requested == "cpu" or (requested == "auto" and not cuda_available):
        return torch.device("cpu")
    if not cuda_available:
        raise ConfigError("--backend.device cuda: CUDA is not available on this machine; use --backend.device auto (cpu here)")
    return torch.device("cuda", local_rank)


def this_engine_device(requested: str) -> torch.device:
    """`engine_device` for this process (LOCAL_RANK from torchrun's environment)."""
    return engine_device(requested, torch.cuda.is_available(), int(os.environ.get("LOCAL_RANK", "0")))
