"""Parameter snapshots: flat layout, torch.distributed broadcast, Mooncake inside a private netns."""

from __future__ import annotations


import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from gyre.backends.transfer.snapshots import FlatLayout, TorchDistTransport, checksum, make_transport
from tests.distributed import netns_problem, run_ranks, run_ranks_in_netns

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64, torch.uint8]


def snapshot(seed: int, scale: int = 1) -> dict[str, torch.Tensor]:
    """Named tensors of mixed dtypes and odd sizes (so alignment padding is exercised)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i, dt in enumerate(DTYPES):
        shape = (7 * scale + i, 3 + i)
        if dt.is_floating_point:
            out[f"layer.{i}.w"] = torch.randn(shape, generator=g).to(dt)
        else:
            out[f"layer.{i}.w"] = torch.randint(0, 200, shape, generator=g).to(dt)
    out["scalar"] = torch.tensor(3.25)
    return out


def same_bits(a: dict, b: dict) -> bool:
    return list(a) == list(b) and all(a[k].dtype == b[k].dtype and torch.equal(a[k].view(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8)) for k in a)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(DTYPES), st.lists(st.integers(1, 5), min_size=0, max_size=3)), min_size=1, max_size=6), st.integers(0, 2**31))
def test_layout_pack_unpack_is_bit_exact(entries, seed):
    g = torch.Generator().manual_seed(seed)
    params = {f"t{i}": torch.randint(0, 255, tuple(shape), generator=g, dtype=torch.uint8).view(torch.uint8).to(torch.int64).to(dt)
              if not dt.is_floating_point else torch.randn(tuple(shape), generator=g).to(dt)
              for i, (dt, shape) in enumerate(entries)}
    layout = FlatLayout.of(params)
    buf = layout.pack(params)
    assert layout.nbytes % 64 == 0 and all(s.offset % 64 == 0 for s in layout.specs)
    spans = sorted((s.offset, s.offset + s.nbytes) for s in layout.specs)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))  # no overlap
    assert same_bits(params, layout.unpack(buf))


def test_checksum_is_crc32_of_the_bytes():
    import zlib

    buf = torch.arange(256, dtype=torch.int64).to(torch.uint8)
    assert checksum(buf) == zlib.crc32(bytes(range(256)))
    flipped = buf.clone()
    flipped[17] ^= 1
    assert checksum(flipped) != checksum(buf)


def test_layout_rejects_mismatched_params():
    p = snapshot(0)
    layout = FlatLayout.of(p)
    q = dict(p)
    q["scalar"] = torch.tensor(1.0, dtype=torch.float64)
    with pytest.raises(ValueError, match="scalar"):
        layout.pack(q)
    with pytest.raises(ValueError, match="kind"):
        make_transport("carrier-pigeon")


def _torch_share():
    rank = dist.get_rank()
    group = dist.new_group([0, 1])
    t = TorchDistTransport(group, src=0)
    got = t.share(snapshot(1) if rank == 0 else None)
    # a second snapshot of a different size over the same transport
    got2 = t.share(snapshot(2, scale=3) if rank == 0 else None)
    with pytest.raises(ValueError, match="source"):
        t.share(None if rank == 0 else snapshot(1))
    return same_bits(got, snapshot(1)), same_bits(got2, snapshot(2, scale=3))


@pytest.mark.multirank
def test_torch_transport_is_bit_exact_on_every_rank():
    assert run_ranks(_torch_share, 2) == [(True, True)] * 2


def _mooncake_share():
    """Runs inside the private network namespace (see the test below)."""
    from gyre.backends.transfer.snapshots import MooncakeTransport

    rank = dist.get_rank()
    t = MooncakeTransport(dist.group.WORLD, src=0)
    big = {"w": torch.randn(1 << 20, generator=torch.Generator().manual_seed(5))}  # 4 MiB
    ok = [same_bits(t.share(snapshot(1) if rank == 0 else None), snapshot(1)),
          same_bits(t.share(big if rank == 0 else None), big)]
    # one-sided: the source serves, readers pull whenever they like, then a barrier
    desc = t.serve(snapshot(3)) if rank == 0 else None
    box = [desc]
    dist.broadcast_object_list(box, src=0)
    if rank != 0:
        ok.append(same_bits(t.read(box[0]), snapshot(3)))
        bad = type(box[0])(box[0].session, box[0].addr, box[0].layout, (box[0].crc or 0) ^ 1)
        with pytest.raises(RuntimeError, match="checksum"):
            t.read(bad)
    dist.barrier()
    t.close()
    return all(ok)


@pytest.mark.multirank
def test_mooncake_transport_is_bit_exact_inside_a_private_netns():
    """Mooncake listens on all interfaces, so the ranks run in a network namespace that has
    only loopback (`unshare --net`, `ip link set lo up`)."""
    problem = netns_problem()
    if problem:
        pytest.skip(problem)
    assert run_ranks_in_netns("tests.backends.transfer.test_snapshots:_mooncake_share", 2) == [True, True]
