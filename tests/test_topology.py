"""Topology: pure layout and validation (no torch.distributed)."""


import pytest
from hypothesis import given, settings, strategies as st

from gyre.config import ParallelConfig
from gyre.topology import Groups, Topology, TopologyError


def test_layout_worked_example():
    # W=8, S=2, R=2 → cells {0,1},{2,3},{4,5}; pool {6,7}
    t = Topology.from_config(ParallelConfig(cell_size=2, tp=2, standalone_ranks=2), 8, 4)
    assert t.num_cells == 3 and t.num_pool_engines == 1
    assert [t.cell_of(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, None, None]
    assert t.cell == 2 and t.position == 0 and not t.is_core and not t.is_pool
    assert t.prefix_ranks(2, 0) == [0, 2]
    assert t.prefix_ranks(3, 1) == [1, 3, 5]
    assert t.pool_engine_ranks(0) == [6, 7]
    assert Topology.from_config(ParallelConfig(cell_size=2, tp=2, standalone_ranks=2), 8, 0).is_core
    assert Topology.from_config(ParallelConfig(cell_size=2, tp=2, standalone_ranks=2), 8, 7).is_pool


@pytest.mark.parametrize(
    "cfg, world, field",
    [
        (ParallelConfig(cell_size=2), 4, "parallel.tp"),  # 1·1·1·1 ≠ 2
        (ParallelConfig(cell_size=4, tp=2, pp=2, cp=2), 8, "parallel.cell_size"),  # 8 ≠ 4
        (ParallelConfig(cell_size=2, tp=2), 5, "parallel.cell_size"),  # 5 not divisible by 2
        (ParallelConfig(standalone_ranks=4), 4, "parallel.standalone_ranks"),  # R ≥ W
        (ParallelConfig(standalone_ranks=5), 4, "parallel.standalone_ranks"),
        (ParallelConfig(cell_size=2, tp=2, standalone_ranks=1), 5, "parallel.standalone_ranks"),
        (ParallelConfig(cell_size=0), 4, "parallel.cell_size"),
        (ParallelConfig(standalone_ranks=-1), 4, "parallel.standalone_ranks"),
    ],
)
def test_validation_errors_name_the_field(cfg, world, field):
    with pytest.raises(TopologyError) as e:
        Topology.from_config(cfg, world, 0)
    assert field in str(e.value)


@settings(max_examples=200, deadline=None)
@given(
    S=st.sampled_from([1, 2, 4, 8]),
    K=st.integers(1, 8),
    pool_engines=st.integers(0, 3),
    data=st.data(),
)
def test_prefix_groups_partition_and_nest(S, K, pool_engines, data):
    W = (K + pool_engines) * S
    rank = data.draw(st.integers(0, W - 1))
    t = Topology.from_config(ParallelConfig(cell_size=S, tp=S, standalone_ranks=pool_engines * S), W, rank)
    assert t.num_cells == K
    for k in range(1, K + 1):
        groups = [t.prefix_ranks(k, p) for p in range(S)]
        # The positions' groups partition exactly the ranks of cells 0..k−1.
        flat = sorted(r for g in groups for r in g)
        assert flat == list(range(k * S))
        for p, g in enumerate(groups):
            assert len(g) == k and all(t.position_of(r) == p for r in g)
            assert [t.cell_of(r) for r in g] == list(range(k))
            if k > 1:  # nested: the k−1 prefix is a subset
                assert set(t.prefix_ranks(k - 1, p)) < set(g)
    # Every rank is in exactly one cell or the pool.
    assert sum(t.cell_of(r) is None for r in range(W)) == pool_engines * S


def test_a_transports_group_is_made_once_per_name():
    """Groups.gloo_world is every rank's one collective per transport group: a second call for a
    name would put the ranks' group-creation order out of step, so it is refused before any
    collective (no torch.distributed needed to see it)."""
    t = Topology.from_config(ParallelConfig(), 1, 0)
    groups = Groups(t, control=None, cells=[None], pool=[], transports={"kv": "the kv group"})
    with pytest.raises(RuntimeError, match="gloo_world\\('kv'\\): that group exists already"):
        groups.gloo_world("kv", 600.0)
    assert groups.transports == {"kv": "the kv group"}
