"""The multi-rank launcher itself: ranks see torchrun's environment and can all-reduce."""

import os

import pytest
import torch
import torch.distributed as dist

from tests.distributed import run_ranks


def _env_and_sum():
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"]), t.item()


@pytest.mark.multirank
@pytest.mark.jobs  # a gloo world
def test_ranks_get_torchrun_env_and_allreduce():
    out = run_ranks(_env_and_sum, 3)
    assert [o[0] for o in out] == [0, 1, 2]
    assert all(o[1] == 3 for o in out)
    assert [o[2] for o in out] == [0, 1, 2]
    assert all(o[3] == 6.0 for o in out)  # 1 + 2 + 3
