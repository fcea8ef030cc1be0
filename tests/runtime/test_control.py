"""Control plane on real ranks: FIFO mailboxes, blobs to their taker, the snapshot board."""

import pytest
import torch
import torch.distributed as dist

from gyre.backends.transfer.weights import SnapshotBoard
from gyre.runtime.control import ControlPlane, default_store
from tests.distributed import run_ranks

pytestmark = pytest.mark.multirank


def _mailboxes():
    rank, world = dist.get_rank(), dist.get_world_size()
    cp = ControlPlane(default_store(), rank)
    for i in range(5):
        cp.send((rank + 1) % world, {"from": rank, "i": i})
    got = [cp.recv(timeout=30) for _ in range(5)]
    dist.barrier()
    return got


def test_mailboxes_are_fifo_per_sender():
    out = run_ranks(_mailboxes, 3)
    for rank, got in enumerate(out):
        assert [m["i"] for m in got] == list(range(5))
        assert {m["from"] for m in got} == {(rank - 1) % 3}


def _blobs_and_board():
    rank = dist.get_rank()
    store = default_store()
    cp, board = ControlPlane(store, rank), SnapshotBoard(store)
    if rank == 0:
        params = {"w": torch.arange(12.0).reshape(3, 4), "b": torch.tensor([1, 2, 3])}
        board.post(0, params)
        for r in (1, 2):
            cp.put_blob(f"x/{r}", {"r": r, "t": torch.full((2,), float(r))})
            cp.send(r, {"key": f"x/{r}"})
        dist.barrier()
        return None
    msg = cp.recv(timeout=60)
    blob = cp.take_blob(msg["key"])
    dist.barrier()  # after rank 0 put version 0 (put ends with a round trip, see SnapshotBoard)
    snap = board.fetch(0)
    return blob["r"], blob["t"].tolist(), snap["w"].tolist(), snap["b"].tolist()


def test_blobs_reach_their_taker_and_the_board_is_read_one_sidedly():
    out = run_ranks(_blobs_and_board, 3)
    for r in (1, 2):
        assert out[r] == (r, [float(r)] * 2, [[float(4 * i + j) for j in range(4)] for i in range(3)], [1, 2, 3])

