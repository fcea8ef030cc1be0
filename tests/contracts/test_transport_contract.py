"""WeightTransport contract (gyre.backends.protocols) on real gloo ranks, for every transport the
factory builds: exact bytes one-sidedly, fetch_latest, retention with the published fallback,
broadcast over a prefix group, CRC mismatch raises, close (a closed core refuses, nothing hangs).
Mooncake runs inside a private network namespace (it listens on every interface)."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from gyre.backends import factory
from tests.backends.test_transfer import same_bits, snapshot
from tests.distributed import netns_problem, run_ranks, run_ranks_in_netns

pytestmark = pytest.mark.multirank

TRANSPORTS = factory.runnable(factory.TRANSPORTS)


def _build(kind: str):
    from gyre.backends.config import TransferConfig
    from gyre.config import ParallelConfig
    from gyre.runtime.control import default_store
    from gyre.topology import Topology

    topo = Topology.from_config(ParallelConfig(), dist.get_world_size(), dist.get_rank())
    groups = topo.create_groups()
    return factory.build_transport(TransferConfig(transport=kind, keep=2), groups, default_store()), groups


def _corrupt(w, version: int) -> None:
    """Flip one bit of the core's copy of `version` behind the transport's back."""
    if w.name == "store":
        raw = bytearray(w.store.get(f"snap/{version}/data"))
        raw[5] ^= 1
        w.store.set(f"snap/{version}/data", bytes(raw))
    elif w.name == "torch":
        w._snaps[version][1][5] ^= 1
    else:
        w._bufs[version][1][5] ^= 1


def _snap(v: int) -> dict[str, torch.Tensor]:
    """Version v's parameters (two sizes, so a layout change between versions is exercised)."""
    return snapshot(v, scale=1 + v % 2)


def _held(w, versions) -> list[int]:
    out = []
    for v in versions:
        try:
            got = w.fetch(v)
        except KeyError:
            continue
        assert same_bits(got, _snap(v)), v  # whatever is held has its own bytes
        out.append(v)
    return out


def _contract(kind: str):
    rank = dist.get_rank()
    w, groups = _build(kind)
    r: dict = {}
    try:
        if rank == 0:
            w.post(0, _snap(0), published=True)
        dist.barrier()
        r["first"] = same_bits(w.fetch(0), _snap(0))
        v, p = w.fetch_latest()
        r["latest"] = (v, same_bits(p, _snap(0)), w.latest(), w.published())
        dist.barrier()
        if rank == 0:  # a burst of 5 steps, version 2 published on the way: keep = 2
            for v in range(1, 6):
                w.post(v, _snap(v), published=v == 2)
        dist.barrier()
        r["held"] = _held(w, range(6))
        r["pointers"] = (w.latest(), w.published())
        r["fetch_latest"] = w.fetch_latest()[0]
        r["published_fallback"] = [w.fetch_published(u)[0] for u in (0, 1, 2, 4, 5)]
        try:
            w.fetch_published(6)
            r["future"] = "no error"
        except KeyError:
            r["future"] = "KeyError"
        dist.barrier()
        # broadcast over the prefix group of cells 0..1 (rank 2 is outside and calls nothing)
        if rank < 2:
            got = w.broadcast(groups.prefix(2), 0, snapshot(9, scale=2) if rank == 0 else None)
            r["bcast2"] = same_bits(got, snapshot(9, scale=2))
        got = w.broadcast(groups.prefix(3), 0, snapshot(8) if rank == 0 else None)
        r["bcast3"] = same_bits(got, snapshot(8))
        dist.barrier()
        if rank == 0:
            _corrupt(w, 5)
        dist.barrier()
        if rank != 0:
            try:
                w.fetch(5)
                r["crc"] = "no error"
            except RuntimeError as e:
                r["crc"] = "checksum" in str(e)
        dist.barrier()
        r["stats"] = w.stats.as_dict()
    finally:
        if rank == 0:
            w.close()
            w.close()  # idempotent
    dist.barrier()  # the core has closed
    if rank != 0 and kind == "torch":
        try:
            w.fetch(4)
            r["after_close"] = "no error"
        except RuntimeError as e:
            r["after_close"] = "closed" in str(e)
    dist.barrier()
    if rank != 0:
        w.close()
    return r


def _check(kind: str, out: list[dict]) -> None:
    for rank, r in enumerate(out):
        assert r["first"] and list(r["latest"]) == [0, True, 0, 0], (rank, r)
        assert r["held"] == [2, 4, 5], (rank, r["held"])  # newest 2 + newest published
        assert list(r["pointers"]) == [5, 2] and r["fetch_latest"] == 5
        assert r["published_fallback"] == [2, 2, 2, 4, 5], r["published_fallback"]
        assert r["future"] == "KeyError"
        assert r["bcast3"] and (r["bcast2"] if rank < 2 else "bcast2" not in r)
        if rank != 0:
            assert r["crc"] is True, r["crc"]
            payload = r["stats"]["bytes_by_path"]
            assert r["stats"]["fetches"] > 0 and r["stats"]["broadcasts"] == (2 if rank == 1 else 1)
            if kind != "store":
                assert payload["store"] == 0, payload  # nothing of model size through the store
        if kind == "torch" and rank != 0:
            assert r["after_close"] is True
    if kind == "torch":
        assert out[0]["stats"]["served"] > 0


@pytest.mark.parametrize("kind", [k for k in TRANSPORTS if k != "mooncake"])
def test_transport_contract(kind):
    _check(kind, run_ranks(_contract, 3, kind))


@pytest.mark.skipif("mooncake" not in TRANSPORTS, reason="the factory cannot build mooncake here")
def test_mooncake_transport_contract_inside_a_private_netns():
    problem = netns_problem()
    if problem:
        pytest.skip(problem)
    _check("mooncake", run_ranks_in_netns("tests.contracts.test_transport_contract:_contract", 3, "mooncake"))


def _core_fails_mid_run():
    """The core fails right after serving a read; its transport is closed in a `finally`, as
    gyre.runtime.job does. The process must exit promptly (no server thread keeps it alive)."""
    rank = dist.get_rank()
    w, _ = _build("torch")
    try:
        if rank == 0:
            w.post(0, snapshot(0), published=True)
        dist.barrier()
        if rank == 1:
            assert same_bits(w.fetch(0), snapshot(0))
        dist.barrier()
        if rank == 0:
            raise RuntimeError("planted failure on the core")
    finally:
        w.close()
    return rank


def test_torch_transport_core_failure_does_not_hang():
    t0 = time.monotonic()
    with pytest.raises(Exception) as err:
        run_ranks(_core_fails_mid_run, 2)
    assert "planted failure on the core" in str(err.value) or "ChildFailedError" in type(err.value).__name__
    assert time.monotonic() - t0 < 90
