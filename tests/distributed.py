"""Run a function on real gloo ranks, launched the way torchrun launches them.

`run_ranks(fn, world_size, *args)` starts `world_size` processes through torch's elastic
launcher (the machinery behind torchrun) with a c10d rendezvous on localhost:0 — no hard-coded
port — so every rank sees RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT exactly as
under torchrun. `fn` must be a module-level function (it is pickled into spawned processes);
it runs with `torch.distributed` already initialized on gloo, and its return values come back
as a list indexed by rank.
"""

from __future__ import annotations

import os
import uuid
from typing import Any, Callable

import torch.distributed as dist
from torch.distributed.launcher.api import LaunchConfig, elastic_launch


def _rank_main(fn: Callable[..., Any], args: tuple, init: bool) -> Any:
    if init:
        dist.init_process_group("gloo")
    try:
        return fn(*args)
    finally:
        if init and dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, init: bool = True, timeout: float = 120.0) -> list[Any]:
    """Run `fn(*args)` on `world_size` gloo ranks; return the per-rank results, rank order."""
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=world_size,
        run_id=uuid.uuid4().hex,
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        rdzv_configs={"timeout": int(timeout)},
        max_restarts=0,
        monitor_interval=0.05,
        start_method="spawn",
        logs_specs=None,
    )
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    results = elastic_launch(config, _rank_main)(fn, args, init)
    return [results[r] for r in range(world_size)]
