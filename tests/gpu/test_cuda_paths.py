"""The CUDA side of issue 17's CPU-tested paths (benchmarks/gpu_check.py runs these on one GPU;
skipped without CUDA):

* the built-in engine on CUDA computes the CPU engine's logits and samples the same tokens;
* actor offload / restore on CUDA: the state goes to pinned host memory, the device memory is
  given back, and it comes back bit for bit (the CPU tests cannot see pinning or the allocator);
* collectives on a "cpu:gloo,cuda:nccl" group move CUDA tensors over NCCL (one rank: NCCL will
  not put two ranks on one GPU, so this checks the device plumbing, not a reduction).
"""

from __future__ import annotations

import asyncio

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module")
def nccl_world(tmp_path_factory):
    import torch.distributed as dist

    torch.cuda.set_device(0)
    if not dist.is_initialized():
        rdzv = tmp_path_factory.mktemp("rdzv") / "file"
        dist.init_process_group("cpu:gloo,cuda:nccl", init_method=f"file://{rdzv}", rank=0, world_size=1)
    yield dist.group.WORLD


def test_decoder_on_cuda_gives_the_cpu_logits():
    from gyre.backends.engines.decoder import DecoderWeights, KVCache, extend
    from tests.backends.helpers import tiny_model

    model = tiny_model(seed=0)
    ids, pos = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6]), torch.tensor([0, 1, 2, 3, 0, 1, 2, 3])
    out = {}
    for dev in ("cpu", "cuda"):
        w = DecoderWeights.from_state_dict(model.state_dict(), model.config, device=dev)
        caches = [KVCache.empty(w, 2), KVCache.empty(w, 2)]
        first = extend(w, ids, pos, [4, 4], caches, all_logits=True)
        step = extend(w, torch.tensor([7, 8]), torch.tensor([4, 4]), [1, 1], caches)
        assert first.device.type == dev and caches[0].k[0].device.type == dev
        out[dev] = (first.cpu(), step.cpu())
    for a, b in zip(out["cpu"], out["cuda"]):
        assert (a - b).abs().max() < 1e-4


def test_engine_on_cuda_samples_what_the_cpu_engine_samples():
    from gyre.backends.engines.cpu_engine import CpuEngine
    from gyre.backends.protocols import SamplingParams
    from tests.backends.helpers import tiny_model

    model = tiny_model(seed=0)

    async def run(dev):
        eng = CpuEngine(model.config, model.state_dict(), device=dev)
        await eng.start()
        events = [e async for e in eng.generate("r", [1, 2, 3], SamplingParams(max_tokens=16, seed=7))]
        held = torch.cuda.memory_allocated() if dev == "cuda" else 0
        await eng.release_memory()
        if dev == "cuda":  # the weights wait in pinned host memory while the cell trains
            assert eng._weights.device.type == "cpu" and eng._weights.lm_head.is_pinned()
            assert torch.cuda.memory_allocated() < held
        await eng.resume()
        assert eng._weights.device.type == dev
        again = [e async for e in eng.generate("s", [1, 2, 3], SamplingParams(max_tokens=16, seed=7))]
        await eng.stop()
        assert [e.token_id for e in again] == [e.token_id for e in events]
        return [e.token_id for e in events], torch.tensor([e.logprob for e in events])

    cpu_tokens, cpu_lp = asyncio.run(run("cpu"))
    gpu_tokens, gpu_lp = asyncio.run(run("cuda"))
    assert gpu_tokens == cpu_tokens and (gpu_lp - cpu_lp).abs().max() < 1e-3


def _trained(seed=0):
    """A GPU model after one AdamW step with the next step's gradients accumulated."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(2048, 4096), torch.nn.Linear(4096, 2048)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(64, 2048, device="cuda")
    model(x).square().mean().backward()
    opt.step()
    model(x).square().mean().backward()
    return model, opt


def _state(model, opt):
    params = list(model.parameters())
    return ([p.detach().clone() for p in params] + [p.grad.clone() for p in params]
            + [v.clone() for s in opt.state.values() for v in s.values()])


def test_offload_goes_to_pinned_memory_frees_the_device_and_restores_bit_exact():
    from gyre.backends.actors.memory import ActorMemory

    model, opt = _trained()
    params = list(model.parameters())
    before = _state(model, opt)
    mem = ActorMemory.of(params, optimizers=[opt])
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    moved = mem.offload()
    assert all(p.device.type == "cpu" and p.is_pinned() and p.grad.is_pinned() for p in params)
    assert all(v.is_pinned() for s in opt.state.values() for k, v in s.items() if k != "step")
    # params + grads + 2 moments, fp32: the allocator has them back
    assert moved >= 4 * sum(p.numel() * 4 for p in params)
    assert held - torch.cuda.memory_allocated() >= 0.95 * moved
    mem.restore()
    after = _state(model, opt)
    assert all(a.device == b.device and torch.equal(a, b) for a, b in zip(before, after))
    # a step after the round trip equals one without (a twin that never left the GPU)
    twin, twin_opt = _trained()
    opt.step()
    twin_opt.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters()))


def test_megatron_actor_offload_restore_on_cuda(nccl_world):
    pytest.importorskip("megatron.core")
    from gyre.backends.config import MegatronConfig
    from gyre.backends.actors.megatron_actor import MegatronActor
    from tests.backends.helpers import tiny_model

    hf = tiny_model(seed=0)
    actor = MegatronActor(hf.config, hf.state_dict(), is_core=True, config=MegatronConfig(params_dtype="bfloat16"))
    for p in actor._params:
        p.grad = torch.randn_like(p)
    actor.optimizer_step(1.0)
    for p in actor._params:
        p.main_grad = torch.randn(p.shape, device=p.device)
    snap = ([p.detach().clone() for p in actor._params], [p.main_grad.clone() for p in actor._params],
            [m.detach().clone() for m in actor.master.masters],
            [{k: v.clone() for k, v in s.items()} for s in actor.optimizer.state.values()])
    held = torch.cuda.memory_allocated()
    assert actor.offload() > 0
    assert torch.cuda.memory_allocated() < held and all(p.device.type == "cpu" for p in actor._params)
    actor.restore()
    assert all(torch.equal(a, b) for a, b in zip(snap[0], actor._params))
    assert all(torch.equal(a, b.main_grad) for a, b in zip(snap[1], actor._params))
    assert all(torch.equal(a, b) for a, b in zip(snap[2], actor.master.masters))
    assert all(torch.equal(s[k], t[k]) for s, t in zip(snap[3], actor.optimizer.state.values()) for k in s)
    assert actor.optimizer_step(1.0)["version"] == 2.0


def test_collectives_on_a_multibackend_group_use_cuda_and_nccl(nccl_world):
    import torch.distributed as dist

    from gyre.backends.actors.cpu_actor import CpuActor
    from gyre.backends.devices import collective_device
    from gyre.backends.transfer.snapshots import TorchDistTransport
    from tests.backends.helpers import tiny_model

    assert collective_device(nccl_world) == torch.device("cuda", 0)
    t = torch.ones(3, device="cuda")
    dist.all_reduce(t, group=nccl_world)  # NCCL on the CUDA tensor
    assert t.tolist() == [1.0, 1.0, 1.0]
    actor = CpuActor(tiny_model(seed=0), is_core=True)
    for p in actor.model.parameters():
        p.grad = torch.full_like(p, 2.0)
    actor.reduce_gradients(nccl_world)  # staged through cuda:0 and back
    assert all(p.grad.device.type == "cpu" and torch.equal(p.grad, torch.full_like(p, 2.0)) for p in actor.model.parameters())
    params = actor.export_parameters()
    assert TorchDistTransport(nccl_world, src=0).share(params) is params
