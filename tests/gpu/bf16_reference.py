"""What a bf16 actor is compared with, built on CPU (tests/gpu/test_backends_gpu.py uses it on the
device; tests/gpu/test_bf16_reference.py exercises it here).

A bf16 actor holds the HF weights rounded to bf16. On the tests' tiny jittered model, rounding the
weights alone moves the target log-probs by 0.11 (audit gpu-first-contact §4), twice the 5e-2 the
check used to allow against the fp32 actor: a correct bf16 path failed it. So the reference holds
the same bf16-rounded weights, computed in fp32 (`rounded_model`). What is left is bf16
arithmetic (activations, products, sums), about 0.2 nats again on this model; its bound is
calibrated on the same step: `BF16_MARGIN` × how far a correct bf16 path (the HF model itself in
bf16, on CPU) lands from that reference, floored at the fp32 tolerances.

GSPO's gate (eps 0.005 on an execution's ratio) switches executions on and off under log-prob
shifts of that size, which makes loss and gradients jump; both sides of a bf16 comparison use
the ungated loss `UNGATED` (same formula, no execution gated off).
"""

from __future__ import annotations

import copy

import torch

from gyre.loss.config import LossConfig

UNGATED = LossConfig(eps_low=1.0, eps_high=1e9)  # a ratio is > 0 and finite: nothing is gated off
BF16_MARGIN = 3.0
FP32_TOL = dict(logprob=1e-3, loss=1e-4, grad=1e-3)


def rounded_model(model: torch.nn.Module, dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    """A copy of `model` whose parameters are rounded to `dtype` (as a bf16 actor casts them) and
    held, and computed with, in float32."""
    out = copy.deepcopy(model)
    with torch.no_grad():
        for p in out.parameters():
            p.copy_(p.to(dtype).float())
    return out


def cpu_step(actor, micro_steps) -> dict:
    """One step through a CPU actor: per-micro-step log-probs, the summed loss, HF-named grads."""
    sums = sum(actor.exec_logratio_partial_sums(ms) for ms in micro_steps)
    logprobs = [actor.forward_logprobs(ms).float() for ms in micro_steps]
    loss = sum(actor.forward_backward(ms, exec_logratio_sum=sums)["loss"] for ms in micro_steps)
    grads = {n: p.grad.detach().double() for n, p in actor.model.named_parameters() if p.grad is not None}
    return {"logprobs": logprobs, "loss": loss, "grads": grads}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def gaps(got: dict, ref: dict, micro_steps) -> dict:
    """The three figures the device check asserts on: the largest |Δ log-prob| at a target, the
    loss's relative error, the largest relative error of one parameter's gradient."""
    lp = max(float((a.cpu().float() - b.float()).abs()[ms.target_mask].max())
             for a, b, ms in zip(got["logprobs"], ref["logprobs"], micro_steps))
    loss = abs(got["loss"] - ref["loss"]) / max(abs(ref["loss"]), 1e-12)
    missing = set(ref["grads"]) ^ set(got["grads"])
    if missing:
        raise ValueError(f"gradients of different parameters: {sorted(missing)[:4]}")
    grad = max(rel(got["grads"][n].cpu(), ref["grads"][n]) for n in ref["grads"])
    return {"logprob": lp, "loss": loss, "grad": grad}


def bf16_tolerance(make_model, micro_steps, margin: float = BF16_MARGIN) -> tuple[dict, dict, dict]:
    """(tolerances, the gaps they were calibrated on, the reference's step): `margin` × the gaps
    of a correct bf16 path (the HF model from `make_model()` cast to bf16, on CPU) to the
    rounded-weight fp32 reference."""
    from gyre.backends.actors.cpu_actor import CpuActor

    ref = cpu_step(CpuActor(rounded_model(make_model()), is_core=True, loss=UNGATED), micro_steps)
    bf16 = cpu_step(CpuActor(make_model().to(torch.bfloat16), is_core=True, loss=UNGATED), micro_steps)
    seen = gaps(bf16, ref, micro_steps)
    return {k: max(margin * v, FP32_TOL[k]) for k, v in seen.items()}, seen, ref
