"""GPU backends: SGLang generate + weight update, a Megatron-core training step.

Skipped without CUDA (and without sglang / megatron-core). Run on a GPU machine:
    pytest -m gpu tests/gpu/test_backends_gpu.py
"""

from __future__ import annotations

import asyncio

import pytest
import torch

pytestmark = pytest.mark.gpu

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _checkpoint(tmp_path, seed=0):
    from gyre.backends.models import build_model, model_config, save_checkpoint

    model = build_model(model_config("small", 1024, eos_token_id=1, bos_token_id=0), seed=seed)
    save_checkpoint(model, str(tmp_path))
    return model


@needs_cuda
def test_sglang_generate_logprobs_and_weight_update(tmp_path):
    """SGLang serves the actor's checkpoint: its log-probs match the trainer's, a weight update
    mid-stream keeps the request and later tokens carry the new version."""
    pytest.importorskip("sglang")
    from gyre.backends.config import SglangConfig
    from gyre.backends.models import build_model, model_config
    from gyre.backends.protocols import SamplingParams
    from gyre.backends.sglang_engine import SglangEngine

    model = _checkpoint(tmp_path)
    new = build_model(model_config("small", 1024), seed=1)

    async def go():
        eng = SglangEngine(SglangConfig(model_path=str(tmp_path), dtype="float32", mem_fraction_static=0.3))
        await eng.start()
        out = [ev async for ev in eng.generate("a", [5, 6, 7], SamplingParams(max_tokens=32, seed=0))]
        later = []
        async for ev in eng.generate("b", [5, 6, 7], SamplingParams(max_tokens=64, seed=1)):
            later.append(ev)
            if len(later) == 8:
                await eng.update_weights(new.state_dict(), version=1)
        partial_stream = eng.generate("c", [1, 2], SamplingParams(max_tokens=500, seed=2))
        first = await partial_stream.__anext__()
        aborted = await eng.abort("c")
        await eng.release_memory()
        await eng.resume()
        await eng.stop()
        return out, later, first, aborted

    out, later, first, aborted = asyncio.run(go())
    assert len(out) == 32
    from tests.backends.test_cpu_engine import actor_logprobs

    ref = actor_logprobs(model, [5, 6, 7], [e.token_id for e in out])
    assert (torch.tensor([e.logprob for e in out]) - ref).abs().max() < 2e-3  # fp32 GPU kernels
    assert later[0].version == 0 and later[-1].version == 1 and len(later) == 64
    assert aborted[0] == first and len(aborted) < 500


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
