"""Control plane on real ranks: FIFO mailboxes, and every micro-step claimed exactly once."""

import threading
import time

import pytest
import torch
import torch.distributed as dist

from gyre.control import ControlPlane, default_store
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


def _claims(total, steps):
    rank = dist.get_rank()
    cp = ControlPlane(default_store(), rank)
    mine = []
    for step in range(steps):
        publisher = None
        if rank == 0:
            # As in a run: the controller thread publishes micro-steps as they are packed
            # (streaming) and closes the window; the core's main thread claims like everyone.
            def publish(cp=cp.clone(), step=step):
                for i in range(total):
                    cp.publish_microstep(step, i, {"step": step, "i": i, "x": torch.full((3,), float(i))})
                    time.sleep(0.002)
                cp.close_step(step, total, k=dist.get_world_size())

            publisher = threading.Thread(target=publish)
            publisher.start()
        while (got := cp.claim(step, timeout=30)) is not None:
            mine.append((step, got[0], got[1]["i"], got[1]["x"].sum().item()))
        assert cp.wait_closure(step, timeout=30) == (total, dist.get_world_size())
        if publisher is not None:
            publisher.join()
    dist.barrier()
    return mine


def test_every_microstep_claimed_exactly_once():
    total, steps = 17, 3
    out = run_ranks(_claims, 4, total, steps)
    claimed = sorted((s, i) for rank in out for (s, i, _, _) in rank)
    assert claimed == [(s, i) for s in range(steps) for i in range(total)]
    for rank in out:
        for s, i, payload_i, xsum in rank:
            assert payload_i == i and xsum == 3.0 * i  # the payload that was published under i
