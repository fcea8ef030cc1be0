"""Prefix groups on real gloo ranks: every prefix all-reduce sums exactly cells 0..k−1, and ranks
outside a prefix are never blocked by it."""

import time

import pytest
import torch
import torch.distributed as dist

from gyre.config import ParallelConfig
from gyre.topology import Topology
from tests.distributed import run_ranks

pytestmark = pytest.mark.multirank


def _layouts(world):
    # (cell_size, standalone ranks)
    return [(1, 0), (2, 0), (1, 2), (2, 2)] if world == 8 else [(1, 0), (2, 0), (1, 1), (2, 2)]


def _check_prefix_sums(world):
    rank = dist.get_rank()
    results = []
    for S, R in _layouts(world):
        topo = Topology.from_config(ParallelConfig(cell_size=S, tp=S, standalone_ranks=R), world, rank)
        groups = topo.create_groups()  # every rank, same order
        for k in range(2, topo.num_cells + 1):
            if topo.is_pool or topo.cell >= k:
                continue
            # Contribution 10^cell + 1000·position: the sum identifies exactly which ranks took part.
            t = torch.tensor([float(10 ** topo.cell + 1000 * topo.position)], dtype=torch.float64)
            dist.all_reduce(t, group=groups.prefix(k))
            results.append((S, R, k, topo.position, t.item()))
        dist.barrier(group=groups.control)
    return results


# 8 ranks on 2 cores is about a minute and proves nothing the pure Topology tests
# (tests/test_topology.py) and the 4-rank world do not: slow tier.
@pytest.mark.parametrize("world", [4, pytest.param(8, marks=pytest.mark.slow)])
def test_prefix_allreduce_sums_exactly_cells_0_to_k_minus_1(world):
    out = run_ranks(_check_prefix_sums, world, world)
    seen = 0
    for rank, results in enumerate(out):
        for S, R, k, p, value in results:
            topo = Topology.from_config(ParallelConfig(cell_size=S, tp=S, standalone_ranks=R), world, rank)
            assert topo.cell < k and not topo.is_pool
            # Independent expectation: sum over the hand-listed members j·S + p, j < k.
            assert value == sum(10 ** j + 1000 * p for j in range(k))
            seen += 1
    # Every (layout, k, member rank) took part: Σ_layouts Σ_{k=2..K} k·S.
    expected = 0
    for S, R in _layouts(world):
        K = (world - R) // S
        expected += sum(k * S for k in range(2, K + 1))
    assert seen == expected


def _outsiders_not_blocked():
    rank = dist.get_rank()
    topo = Topology.from_config(ParallelConfig(), 4, rank)
    groups = topo.create_groups()
    dist.barrier()
    t0 = time.perf_counter()
    if topo.cell < 2:  # members of prefix k=2: the slow member delays the collective
        if topo.cell == 1:
            time.sleep(1.0)
        dist.all_reduce(torch.ones(1), group=groups.prefix(2))
    elapsed = time.perf_counter() - t0
    dist.barrier(group=groups.control)
    return topo.cell, elapsed


def test_ranks_outside_the_prefix_are_never_blocked():
    out = run_ranks(_outsiders_not_blocked, 4)
    by_cell = dict(out)
    assert by_cell[0] >= 0.9  # the core waited for its slow partner
    assert by_cell[2] < 0.5 and by_cell[3] < 0.5  # outsiders went on at once
