"""GPU backends: a Megatron-core training step (the SGLang engine: tests/gpu/test_sglang_gpu.py).

Skipped without CUDA (and without megatron-core). Run on a GPU machine:
    pytest -m gpu tests/gpu/test_backends_gpu.py
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _record(name: str, figures: dict) -> None:
    """benchmarks/gpu_check.py collects these figures (GYRE_GPU_CHECK_FIGURES names its file)."""
    import json
    import os

    path = os.environ.get("GYRE_GPU_CHECK_FIGURES")
    if not path:
        return
    seen = json.loads(open(path).read()) if os.path.exists(path) else {}
    seen[name] = figures
    with open(path, "w") as f:
        json.dump(seen, f, indent=1)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


# Tolerances against the fp32 CPU actor. fp32: both run fp32 matmuls (TF32 is off for matmuls by
# default), so the differences are summation order only. bf16: parameters and activations
# rounded to 8 bits of mantissa, so ~1e-2 relative per tensor; uncalibrated until the first run.
TOL = {"float32": dict(logprob=1e-3, loss=1e-4, grad=1e-3), "bfloat16": dict(logprob=5e-2, loss=5e-2, grad=1e-1)}


@needs_cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_megatron_step_matches_cpu_actor(tmp_path, dtype):
    """One GSPO step through Megatron-core (TP=1) against the CPU actor on the same weights and
    micro-steps: the same log-probs, loss and gradients (mapped HF → Megatron names) within TOL;
    the update moves the fp32 masters (bf16: through fp32 main grads) and exports HF names."""
    pytest.importorskip("megatron.core")
    import torch.distributed as dist

    from gyre.backends.config import MegatronConfig
    from gyre.backends.actors.cpu_actor import CpuActor
    from gyre.backends.actors.megatron_actor import MegatronActor, hf_to_mcore
    from tests.backends.helpers import random_step, tiny_model

    tol = TOL[dtype]
    torch.cuda.set_device(0)  # what gyre.run.bind_device does for LOCAL_RANK 0
    if not dist.is_initialized():  # the backend string gyre.run uses with CUDA
        dist.init_process_group("cpu:gloo,cuda:nccl", init_method=f"file://{tmp_path}/rdzv", rank=0, world_size=1)
    hf = tiny_model(seed=0)
    mss = random_step(hf, seed=1, num_micro=2)
    actor = MegatronActor(hf.config, hf.state_dict(), is_core=True, config=MegatronConfig(params_dtype=dtype))
    assert actor.device == torch.device("cuda", 0)
    cpu = CpuActor(tiny_model(seed=0), is_core=True)
    sums = sum(actor.exec_logratio_partial_sums(ms) for ms in mss)  # executions span both micro-steps
    sums_cpu = sum(cpu.exec_logratio_partial_sums(ms) for ms in mss)
    lp_err, loss_m, loss_c = 0.0, 0.0, 0.0
    for ms in mss:
        lp_err = max(lp_err, float((actor.forward_logprobs(ms) - cpu.forward_logprobs(ms)).abs()[ms.target_mask].max()))
        loss_m += actor.forward_backward(ms, exec_logratio_sum=sums)["loss"]
        loss_c += cpu.forward_backward(ms, exec_logratio_sum=sums_cpu)["loss"]
    assert all(p.grad is None or p.grad.dtype == getattr(torch, dtype) for p in actor._params)
    want = hf_to_mcore({n: p.grad for n, p in cpu.model.named_parameters()}, hf.config)
    got = {n: p.grad for n, p in actor.model.named_parameters() if p.grad is not None}
    grad_rel = {n: _rel(got[n].cpu(), want[n]) for n in got}
    figures = {"logprob_max_abs_err": lp_err, "loss_megatron": loss_m, "loss_cpu": loss_c,
               "loss_rel_err": abs(loss_m - loss_c) / max(abs(loss_c), 1e-12), "grad_max_rel_err": max(grad_rel.values()),
               "grads_compared": len(grad_rel), "tolerances": tol}
    _record(f"megatron_step_{dtype}", figures)
    assert lp_err < tol["logprob"], figures
    assert set(got) == set(want), sorted(set(want) ^ set(got))[:4]
    assert figures["loss_rel_err"] < tol["loss"], figures
    assert figures["grad_max_rel_err"] < tol["grad"], (figures, sorted(grad_rel.items(), key=lambda kv: -kv[1])[:3])
    masters = [m.detach().clone() for m in actor.master.masters]
    stats = actor.optimizer_step(1.0)
    assert stats["grad_norm"] > 0 and actor.has_optimizer_state
    assert all(m.dtype == torch.float32 for m in actor.master.masters)
    assert any(not torch.equal(a, b) for a, b in zip(masters, actor.master.masters))
    exported = actor.export_parameters()
    assert set(exported) == set(dict(hf.named_parameters()))
