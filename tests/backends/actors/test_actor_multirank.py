"""Cells 0..k−1 spreading a step's micro-steps train the same parameters as the core alone.

Real gloo ranks (tests/distributed.py). Each rank is a one-rank cell; the prefix group of the k
training cells is built by every rank up front (docs/design.md §1). The model is float64 so that the
only difference between the runs — the order gradients are summed in — stays far below 1e-6
even after AdamW's normalisation.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from gyre.backends.config import OptimizerConfig
from gyre.loss import allreduce_exec_logratio_sums
from gyre.backends.actors.cpu_actor import CpuActor
from gyre.backends.transfer.snapshots import TorchDistTransport
from tests.backends.helpers import random_step, tiny_model
from tests.distributed import run_ranks

STEPS, MICRO = 2, 4
CONFIG = OptimizerConfig(lr=1e-2, max_grad_norm=0.05, weight_decay=0.01)


def _make_steps():
    behaviour = tiny_model(seed=0, dtype=torch.float64)
    return [random_step(behaviour, seed=10 + s, num_exec=3, seqs_per_exec=2, num_micro=MICRO) for s in range(STEPS)]




def _core_alone():
    actor = CpuActor(tiny_model(seed=0, dtype=torch.float64), is_core=True, config=CONFIG)
    norms = []
    for mss in _make_steps():
        sums = sum(actor.exec_logratio_partial_sums(ms) for ms in mss)
        for ms in mss:
            actor.forward_backward(ms, exec_logratio_sum=sums)
        norms.append(actor.optimizer_step()["grad_norm"])
    return actor.export_parameters(), norms


def _train(k, rank, group, steps):
    """This rank's cell trains `steps` as one of the first k cells; returns its final state."""
    actor = CpuActor(tiny_model(seed=0, dtype=torch.float64), is_core=rank == 0, config=CONFIG)
    transport = TorchDistTransport(group, src=0)
    norms = []
    for mss in steps:
        mine = [ms for ms in mss if ms.index % k == rank]
        n = mss[0].num_executions
        partial = sum((actor.exec_logratio_partial_sums(ms) for ms in mine), torch.zeros(n, dtype=torch.float64))
        sums = partial if group is None else allreduce_exec_logratio_sums(partial, group)
        for ms in mine:
            actor.forward_backward(ms, exec_logratio_sum=sums)
        actor.reduce_gradients(group)
        if actor.is_core:
            norms.append(actor.optimizer_step()["grad_norm"])
        else:
            actor.zero_grad()
        if group is not None:  # the core sends the new parameters to the satellites
            params = transport.share(actor.export_parameters() if rank == 0 else None)
            if rank != 0:
                actor.import_parameters(params)
    return {"params": actor.export_parameters(), "has_opt": actor.has_optimizer_state,
            "optimizer": actor.optimizer is not None, "norms": norms}


def _cells():
    """k = 1, 2, 3 training cells in turn on the same 3 ranks; cells ≥ k sit the step out."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    # every rank builds every prefix group up front, in the same order, even those it is not in
    groups = {j: dist.new_group(list(range(j))) for j in range(2, world + 1)}
    steps = _make_steps()
    out = {k: (_train(k, rank, groups.get(k), steps) if rank < k else None) for k in range(1, world + 1)}
    if rank == 0:
        out["ref"] = _core_alone()
    return out


@pytest.mark.multirank
def test_cells_match_core_alone():
    res = run_ranks(_cells, 3)
    ref_params, ref_norms = res[0]["ref"]
    init = tiny_model(seed=0, dtype=torch.float64).state_dict()
    moved = max(float((p - init[name]).abs().max()) for name, p in ref_params.items())
    assert moved > 1e-3  # the steps really changed the parameters
    for k in (1, 2, 3):
        core = res[0][k]
        assert core["has_opt"] and core["optimizer"]
        assert torch.allclose(torch.tensor(core["norms"]), torch.tensor(ref_norms), rtol=1e-9)
        for name, p in ref_params.items():
            assert (core["params"][name] - p).abs().max() <= 1e-6, (k, name)
        for r in range(1, k):
            sat = res[r][k]
            assert not sat["optimizer"] and not sat["has_opt"]
            for name, p in core["params"].items():
                assert torch.equal(sat["params"][name], p), (k, r, name)
        for r in range(k, 3):
            assert res[r][k] is None
