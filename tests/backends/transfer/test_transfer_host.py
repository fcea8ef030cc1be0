"""`--transfer.host` (issue 35, item 3): what each rank's Mooncake engine advertises, and the
error a failed read gives (both ends named). Pure: environments are passed in."""

import pytest

from gyre.backends.transfer.snapshots import resolve_host, unreachable_message


def test_an_explicit_address_is_taken_as_is():
    assert resolve_host("10.0.0.5", {"GYRE_TRANSFER_HOST": "10.9.9.9"}) == "10.0.0.5"


def test_auto_takes_the_per_node_environment_first():
    env = {"GYRE_TRANSFER_HOST": "10.0.0.7", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4"}
    assert resolve_host("auto", env) == "10.0.0.7"


def test_auto_is_loopback_on_one_node():
    assert resolve_host("auto", {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "10.1.1.1"}) == "127.0.0.1"
    assert resolve_host("auto", {}) == "127.0.0.1"  # plain python: a world of one


def test_auto_across_nodes_is_the_interface_that_routes_to_master_addr(monkeypatch):
    from gyre import serving

    monkeypatch.setattr(serving, "route_address", lambda peer: {"node0": "10.2.0.2"}[peer])
    assert resolve_host("auto", {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "node0"}) == "10.2.0.2"


def test_auto_across_nodes_warns_of_a_loopback_route_and_refuses_without_master_addr(monkeypatch, caplog):
    from gyre import serving

    monkeypatch.setattr(serving, "route_address", lambda peer: "127.0.1.1")  # Debian's /etc/hosts for the own name
    # Said here, refused by the start-up probe on every rank together (not on this node's ranks alone).
    assert resolve_host("auto", {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "node0"}) == "127.0.1.1"
    assert "GYRE_TRANSFER_HOST" in caplog.text
    with pytest.raises(ValueError, match="MASTER_ADDR"):
        resolve_host("auto", {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"})


def test_a_failed_read_names_both_ends_and_the_loopback_trap():
    msg = unreachable_message("10.0.0.2", "127.0.0.1:15000", -1)
    assert "127.0.0.1:15000" in msg and "advertises 10.0.0.2" in msg and "--transfer.host auto" in msg
    assert "loopback" not in unreachable_message("10.0.0.2", "10.0.0.1:15000", -1)


def _broadcast_from_an_unreachable_source():
    """Rank 0 advertises an address nobody can reach (TEST-NET-1, no route in the namespace)."""
    import time

    import torch
    import torch.distributed as dist

    from gyre.backends.transfer.snapshots import MooncakeTransport, PeerUnreachable

    rank = dist.get_rank()
    t = MooncakeTransport(dist.group.WORLD, src=0, host="192.0.2.1" if rank == 0 else "127.0.0.1")
    t0 = time.monotonic()
    try:
        t.share({"w": torch.ones(4)} if rank == 0 else None)
        return ["shared"]
    except PeerUnreachable as e:
        return [str(e), time.monotonic() - t0]
    finally:
        t.close()


@pytest.mark.multirank
def test_a_failed_reader_fails_the_whole_broadcast_at_once_naming_both_hosts():
    """The source used to wait in a barrier for the group's timeout after a reader failed."""
    from tests.distributed import netns_problem, run_ranks_in_netns

    problem = netns_problem()
    if problem:
        pytest.skip(problem)
    out = run_ranks_in_netns("tests.backends.transfer.test_transfer_host:_broadcast_from_an_unreachable_source", 2, timeout=120)
    for msg, seconds in out:  # both ranks raised, the source too, within seconds
        assert "rank 1: " in msg and "192.0.2.1:" in msg and "advertises 127.0.0.1" in msg, msg
        assert seconds < 30, seconds


@pytest.mark.parametrize("world, local", [(1, 1), (2, 2), (4, 2), (6, 2), (8, 8), (3, 1)])
def test_every_engine_is_probed_by_a_reader_on_another_node_when_there_is_one(world, local):
    from gyre.backends.transfer.snapshots import probe_target

    targets = [probe_target(r, world, local) for r in range(world)]
    assert sorted(targets) == list(range(world))  # every rank's engine is read exactly once
    if world > local:
        assert all(t // local != r // local for r, t in enumerate(targets))  # by a rank of another node
    elif world > 1:
        assert all(t != r for r, t in enumerate(targets))


def _kv_probe_with_one_unreachable_rank():
    """Rank 1 alone advertises an address nobody can reach (TEST-NET-1): a wrong host on one node."""
    import torch.distributed as dist

    from gyre.backends.transfer.migration import MooncakeKvTransport
    from gyre.backends.transfer.snapshots import PeerUnreachable

    try:
        MooncakeKvTransport(host="192.0.2.1" if dist.get_rank() == 1 else "127.0.0.1", probe=True)
        return ["started"]
    except PeerUnreachable as e:
        return [str(e)]


@pytest.mark.multirank
def test_a_wrong_address_on_any_rank_fails_the_kv_probe_on_every_rank():
    """Issue 53 item 3: the KV-migration probe read only rank 0's engine, so a wrong address on
    another rank passed it and migrations out of that rank fell back to recomputing."""
    from tests.distributed import netns_problem, run_ranks_in_netns

    problem = netns_problem()
    if problem:
        pytest.skip(problem)
    out = run_ranks_in_netns("tests.backends.transfer.test_transfer_host:_kv_probe_with_one_unreachable_rank", 2, timeout=120)
    for (msg,) in out:
        assert "rank 0 (advertising 127.0.0.1) reading rank 1's engine at 192.0.2.1:" in msg, msg
