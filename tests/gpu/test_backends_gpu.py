"""GPU backends: a Megatron-core training step (the SGLang engine: tests/gpu/test_sglang_gpu.py).

Skipped without CUDA (and without megatron-core). Run on a GPU machine:
    pytest -m gpu tests/gpu/test_backends_gpu.py
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@needs_cuda
@pytest.mark.parametrize("dtype, tol", [("float32", 1e-3), ("bfloat16", 5e-2)])  # bf16 tolerance: uncalibrated
def test_megatron_step_matches_cpu_actor(tmp_path, dtype, tol):
    """One GSPO step through Megatron-core (TP=1) gives the same log-probs as the CPU actor, moves
    the parameters (bf16: through the fp32 masters, with fp32 main grads) and exports HF names."""
    pytest.importorskip("megatron.core")
    import torch.distributed as dist

    from gyre.backends.config import MegatronConfig
    from gyre.backends.cpu_actor import CpuActor
    from gyre.backends.megatron_actor import MegatronActor
    from tests.backends.helpers import random_step, tiny_model

    torch.cuda.set_device(0)  # what gyre.run.bind_device does for LOCAL_RANK 0
    if not dist.is_initialized():  # the backend string gyre.run uses with CUDA
        dist.init_process_group("cpu:gloo,cuda:nccl", init_method=f"file://{tmp_path}/rdzv", rank=0, world_size=1)
    hf = tiny_model(seed=0)
    mss = random_step(hf, seed=1, num_micro=2)
    actor = MegatronActor(hf.config, hf.state_dict(), is_core=True, config=MegatronConfig(params_dtype=dtype))
    assert actor.device == torch.device("cuda", 0)
    cpu = CpuActor(tiny_model(seed=0), is_core=True)
    sums = sum(actor.exec_logratio_partial_sums(ms) for ms in mss)  # executions span both micro-steps
    for ms in mss:
        assert (actor.forward_logprobs(ms) - cpu.forward_logprobs(ms)).abs()[ms.target_mask].max() < tol
        actor.forward_backward(ms, exec_logratio_sum=sums)
    assert all(p.grad is None or p.grad.dtype == getattr(torch, dtype) for p in actor._params)
    masters = [m.detach().clone() for m in actor.master.masters]
    stats = actor.optimizer_step(1.0)
    assert stats["grad_norm"] > 0 and actor.has_optimizer_state
    assert all(m.dtype == torch.float32 for m in actor.master.masters)
    assert any(not torch.equal(a, b) for a, b in zip(masters, actor.master.masters))
    exported = actor.export_parameters()
    assert set(exported) == set(dict(hf.named_parameters()))
