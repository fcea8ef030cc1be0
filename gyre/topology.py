"""Topology: cells, the core, satellites, the standalone rollout pool, and the prefix groups.

docs/design.md §1. W ranks = K cells of S ranks each, followed by an optional standalone rollout pool of
R ranks (the last R ranks). Cell 0 is the core (authoritative weights and optimizer state);
cells 1..K−1 are satellites. Cells enter training in order, so the training set is always a
prefix of cells 0..k−1, and gradients are reduced over the prebuilt *prefix group*
{j·S + p : j < k} of the rank's intra-cell position p.

Example, W = 8, S = 2, R = 2:

    rank      0  1 | 2  3 | 4  5 | 6  7
    cell      0  0 | 1  1 | 2  2 | pool
    position  0  1 | 0  1 | 0  1 |
    prefix k=2, p=0: {0, 2}     k=3, p=0: {0, 2, 4}     k=3, p=1: {1, 3, 5}

`Topology.from_config` is pure (no torch.distributed). `Topology.create_groups()` creates every
group of the layout up front, on every rank, in one fixed order. The transports' own gloo groups
over every rank (weights over `--transfer.transport torch`, KV over `--proxy.migration-transport
gloo`) are created by `Groups.gloo_world` when the factory builds those transports, at the same
point on every rank, and kept in the same `Groups`: every process group of a run is made here.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Literal

logger = logging.getLogger(__name__)


@dataclass(kw_only=True)
class ParallelConfig:
    """How ranks form cells (docs/design.md §1)."""

    cell_size: int = 1
    """Ranks per cell, S. One cell = one complete model replica; must equal tp·pp·cp·ep."""
    tp: int = 1
    """Tensor-parallel size inside a cell."""
    pp: int = 1
    """Pipeline-parallel size inside a cell."""
    cp: int = 1
    """Context-parallel size inside a cell."""
    ep: int = 1
    """Expert-parallel size inside a cell."""
    standalone_ranks: int = 0
    """R: the last R ranks form a standalone rollout pool that never trains (multiple of cell_size)."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """torch.distributed backend. auto: with CUDA, each rank binds cuda:LOCAL_RANK and uses
    'cpu:gloo,cuda:nccl' (CPU tensors over gloo, CUDA tensors over NCCL), else gloo; nccl: the same
    multi-backend string, refused without CUDA; gloo: gloo for everything (a control run)."""


class TopologyError(ValueError):
    """A parallel layout that cannot be built; the message names the config field."""


@dataclass(frozen=True)
class Topology:
    world_size: int
    rank: int
    cell_size: int  # S
    num_cells: int  # K
    pool_size: int  # R (standalone rollout ranks, the last R ranks)
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1

    # ---------------------------------------------------------------- construction
    @classmethod
    def from_config(cls, cfg: ParallelConfig, world_size: int, rank: int) -> "Topology":
        """Validate `cfg` (`--parallel.*`) against the world and build the layout.

        Errors name the offending field: `parallel.cell_size`, `parallel.tp`, ...,
        `parallel.standalone_ranks`.
        """
        S, R = cfg.cell_size, cfg.standalone_ranks
        for name in ("tp", "pp", "cp", "ep", "cell_size"):
            if getattr(cfg, name) < 1:
                raise TopologyError(f"parallel.{name} must be >= 1, got {getattr(cfg, name)}")
        if R < 0:
            raise TopologyError(f"parallel.standalone_ranks must be >= 0, got {R}")
        if world_size < 1:
            raise TopologyError(f"world size must be >= 1, got {world_size}")
        if not 0 <= rank < world_size:
            raise TopologyError(f"rank {rank} outside world of {world_size}")
        layout = cfg.tp * cfg.pp * cfg.cp * cfg.ep
        if layout != S:
            raise TopologyError(
                f"parallel.tp × parallel.pp × parallel.cp × parallel.ep = "
                f"{cfg.tp}×{cfg.pp}×{cfg.cp}×{cfg.ep} = {layout} must equal parallel.cell_size = {S} "
                f"(one cell holds exactly one complete model replica)"
            )
        if R >= world_size:
            raise TopologyError(
                f"parallel.standalone_ranks = {R} must be < world size {world_size} "
                f"(at least one cell is needed to train)"
            )
        if (world_size - R) % S != 0:
            raise TopologyError(
                f"world size {world_size} minus parallel.standalone_ranks {R} = {world_size - R} "
                f"is not divisible by parallel.cell_size = {S}"
            )
        if R % S != 0:
            raise TopologyError(
                f"parallel.standalone_ranks = {R} must be a multiple of parallel.cell_size = {S} "
                f"(the pool serves whole engine replicas)"
            )
        return cls(world_size, rank, S, (world_size - R) // S, R, cfg.tp, cfg.pp, cfg.cp, cfg.ep)

    # ---------------------------------------------------------------- pure queries
    @property
    def num_pool_engines(self) -> int:
        return self.pool_size // self.cell_size

    def cell_of(self, rank: int) -> int | None:
        """Cell index of `rank`, or None for a standalone-pool rank."""
        c = rank // self.cell_size
        return c if c < self.num_cells else None

    def position_of(self, rank: int) -> int:
        """Intra-cell (or intra-pool-engine) position p of `rank`."""
        return rank % self.cell_size

    def cell_ranks(self, cell: int) -> list[int]:
        if not 0 <= cell < self.num_cells:
            raise IndexError(f"cell {cell} out of range 0..{self.num_cells - 1}")
        return list(range(cell * self.cell_size, (cell + 1) * self.cell_size))

    def pool_engine_ranks(self, engine: int) -> list[int]:
        base = self.num_cells * self.cell_size + engine * self.cell_size
        return list(range(base, base + self.cell_size))

    def prefix_ranks(self, k: int, position: int) -> list[int]:
        """Ranks of the prefix group for cells 0..k−1 at intra-cell `position`."""
        if not 1 <= k <= self.num_cells:
            raise IndexError(f"prefix k={k} out of range 1..{self.num_cells}")
        return [j * self.cell_size + position for j in range(k)]

    @property
    def cell(self) -> int | None:
        return self.cell_of(self.rank)

    @property
    def position(self) -> int:
        return self.position_of(self.rank)

    @property
    def is_core(self) -> bool:
        return self.cell == 0

    @property
    def is_pool(self) -> bool:
        return self.cell is None

    @property
    def is_controller(self) -> bool:
        """The core's first rank hosts the proxy and the controller (docs/design.md §1)."""
        return self.rank == 0

    def describe(self) -> str:
        lines = [
            f"world={self.world_size} cells K={self.num_cells} × S={self.cell_size} "
            f"(tp={self.tp} pp={self.pp} cp={self.cp} ep={self.ep}), standalone pool R={self.pool_size}",
        ]
        for c in range(self.num_cells):
            role = "core" if c == 0 else "satellite"
            lines.append(f"  cell {c} ({role}): ranks {self.cell_ranks(c)}")
        for e in range(self.num_pool_engines):
            lines.append(f"  pool engine {e}: ranks {self.pool_engine_ranks(e)}")
        if self.num_cells > 1:
            lines.append(f"  prefix groups: k=2..{self.num_cells} × {self.cell_size} positions "
                         f"({(self.num_cells - 1) * self.cell_size} groups)")
        return "\n".join(lines)

    # ---------------------------------------------------------------- process groups
    def create_groups(self) -> "Groups":
        """Create every process group, on every rank, in one fixed order. Collective: all ranks
        of the default group must call it exactly once at start-up."""
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError("Topology.create_groups() needs torch.distributed to be initialized")
        if dist.get_world_size() != self.world_size or dist.get_rank() != self.rank:
            raise RuntimeError(
                f"topology was built for rank {self.rank}/{self.world_size}, "
                f"process group is rank {dist.get_rank()}/{dist.get_world_size()}"
            )
        # Every group takes the default group's backend string: with CUDA "cpu:gloo,cuda:nccl"
        # (gyre.run.device_and_backend), so CPU tensors go over gloo and CUDA tensors over NCCL.
        backend = dist.get_backend()
        # 1. CPU control group: gloo over every rank, whatever the default backend.
        control = dist.group.WORLD if backend in ("gloo", "cpu:gloo") else dist.new_group(list(range(self.world_size)), backend="gloo")
        # 2. One group per cell and per pool engine (the cell's own model-parallel world).
        cells = [dist.new_group(self.cell_ranks(c), backend=backend) for c in range(self.num_cells)]
        pool = [dist.new_group(self.pool_engine_ranks(e), backend=backend) for e in range(self.num_pool_engines)]
        # 3. Prefix groups, k = 2..K, every position p.
        prefix: dict[tuple[int, int], Any] = {}
        for k in range(2, self.num_cells + 1):
            for p in range(self.cell_size):
                prefix[(k, p)] = dist.new_group(self.prefix_ranks(k, p), backend=backend)
        return Groups(self, control, cells, pool, prefix)


@dataclass
class Groups:
    """Every process group of a run, created once by `Topology.create_groups()`."""

    topology: Topology
    control: Any  # gloo, all ranks: control messages and CPU-side agreement
    cells: list[Any]  # cells[c]: the ranks of cell c
    pool: list[Any]  # pool[e]: the ranks of standalone pool engine e
    prefix_by_k: dict[tuple[int, int], Any] = field(default_factory=dict)
    transports: dict[str, Any] = field(default_factory=dict)  # name → gloo group over every rank (gloo_world)

    def gloo_world(self, name: str, timeout_s: float) -> Any:
        """A gloo group over every rank for one transport (`name`: 'weights', 'kv'), with its own
        `timeout_s`, kept under `transports[name]`. Collective: every rank calls it at the same
        point of start-up (gyre.backends.factory builds the transports there); once per name."""
        from datetime import timedelta

        import torch.distributed as dist

        if name in self.transports:
            raise RuntimeError(f"Groups.gloo_world({name!r}): that group exists already (created once per run)")
        group = dist.new_group(list(range(self.topology.world_size)), backend="gloo", timeout=timedelta(seconds=timeout_s))
        self.transports[name] = group
        return group

    def prefix(self, k: int, position: int | None = None) -> Any | None:
        """The group of cells 0..k−1 at `position` (default: this rank's). None for k = 1: the
        core alone needs no reduction."""
        t = self.topology
        if not 1 <= k <= t.num_cells:
            raise IndexError(f"prefix k={k} out of range 1..{t.num_cells}")
        if k == 1:
            return None
        return self.prefix_by_k[(k, t.position if position is None else position)]
