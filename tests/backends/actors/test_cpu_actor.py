"""CPU actor on one process: loss gradients, micro-step invariance, roles, parameters, checkpoints."""

from __future__ import annotations

import pytest
import torch

from gyre.backends.config import OptimizerConfig
from gyre.backends.actors.cpu_actor import CpuActor
from gyre.backends.models.hf import packed_logits
from gyre.backends.protocols import Actor
from gyre.loss import LossConfig
from tests.backends.helpers import finish_step, merge, random_step, tiny_model


@pytest.fixture(scope="module")
def step():
    return random_step(tiny_model(seed=0, dtype=torch.float64), seed=3, num_exec=3, seqs_per_exec=2, num_micro=3)


def grads(actor):
    return {n: p.grad.clone() for n, p in actor.model.named_parameters() if p.grad is not None}


def test_satisfies_protocol():
    assert isinstance(CpuActor(tiny_model(), is_core=True), Actor)


def test_forward_logprobs_match_float64_log_softmax(step):
    """ℓ_t equals a float64 log-softmax of the model's own packed logits at targets[t]."""
    model = tiny_model(seed=0, dtype=torch.float64)
    ms = step[0]
    got = CpuActor(model, is_core=False).forward_logprobs(ms)
    with torch.no_grad():
        logits = packed_logits(model, ms.input_ids, ms.position_ids, ms.cu_seqlens)
    ref = torch.log_softmax(logits, -1).gather(1, ms.targets[:, None])[:, 0]
    assert torch.allclose(got.double(), ref, atol=1e-10)


def test_gradient_equals_hand_derived_surrogate(step):
    """With every execution inside its clip range and no ω capped, ∂loss/∂θ equals the gradient
    of Σ_t ω_t·token_weight_t·ℓ_t with ω_t = exp(ℓ_t − b_t) held constant (docs/design.md §6)."""
    actor = CpuActor(tiny_model(seed=0, dtype=torch.float64), is_core=True,
                     loss=LossConfig(eps_low=10.0, eps_high=10.0, cap=1e9))
    sums = sum(actor.exec_logratio_partial_sums(ms) for ms in step)
    for ms in step:
        actor.forward_backward(ms, exec_logratio_sum=sums)
    got = grads(actor)

    ref_model = tiny_model(seed=0, dtype=torch.float64)
    total = 0.0
    for ms in step:
        logits = packed_logits(ref_model, ms.input_ids, ms.position_ids, ms.cu_seqlens)
        lp = torch.log_softmax(logits, -1).gather(1, ms.targets[:, None])[:, 0]
        w = torch.exp(lp.detach() - ms.behavior_logprobs.double())
        total = total + (ms.target_mask * w * ms.token_weight * lp).sum()
    total.backward()
    for n, p in ref_model.named_parameters():
        assert torch.allclose(got[n], p.grad, rtol=1e-8, atol=1e-12), n


def test_gradients_do_not_depend_on_the_cut_into_micro_steps():
    """The same step cut into 1 micro-step or into 4 gives the same accumulated gradient."""
    behaviour = tiny_model(seed=0, dtype=torch.float64)
    four = random_step(behaviour, seed=5, num_exec=3, num_micro=4)
    one = [merge(four)]
    out = []
    for mss in (four, one):
        actor = CpuActor(tiny_model(seed=0, dtype=torch.float64), is_core=True)
        sums = sum(actor.exec_logratio_partial_sums(ms) for ms in mss)
        for ms in mss:
            actor.forward_backward(ms, exec_logratio_sum=sums)
        out.append(grads(actor))
    for n in out[0]:
        assert torch.allclose(out[0][n], out[1][n], rtol=1e-9, atol=1e-14), n


def test_only_the_core_steps_and_clipping_applies(step):
    sat = CpuActor(tiny_model(), is_core=False)
    with pytest.raises(RuntimeError, match="satellite"):
        sat.optimizer_step(1.0)
    assert not sat.has_optimizer_state
    core = CpuActor(tiny_model(seed=0, dtype=torch.float64), is_core=True, config=OptimizerConfig(lr=0.0))
    sums = sum(core.exec_logratio_partial_sums(ms) for ms in step)  # executions span the micro-steps
    for ms in step:
        core.forward_backward(ms, exec_logratio_sum=sums)
    norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in core.model.parameters() if p.grad is not None))
    clip = float(norm) / 4
    before = {n: p.grad.clone() for n, p in core.model.named_parameters() if p.grad is not None}
    core.optimizer.step = lambda: None  # observe the clipped gradients before they are cleared
    seen = {}
    orig_zero = core.zero_grad
    core.zero_grad = lambda: seen.update({n: p.grad.clone() for n, p in core.model.named_parameters()}) or orig_zero()
    out = core.optimizer_step(clip)
    assert out["grad_norm"] == pytest.approx(float(norm), rel=1e-9)
    for n, g in before.items():
        assert torch.allclose(seen[n], g * clip / float(norm), rtol=1e-6), n
    assert core.version == 1


def test_linear_lr_decay_reaches_the_optimizer(step):
    """lr 1e-3 decaying over 3 steps to 0.1×: 1.0, 0.7, 0.4, 0.1, 0.1 (×1e-3), by version, so an
    actor resumed at version 2 continues at 0.4e-3. Adam's first update is lr·g/(|g|+eps), so the
    largest parameter move of a fresh optimizer's first step is the lr it used."""
    cfg = OptimizerConfig(lr=1e-3, lr_decay_steps=3, min_lr_ratio=0.1, max_grad_norm=1e9)
    assert [cfg.lr_at(v) for v in range(5)] == pytest.approx([1e-3, 0.7e-3, 0.4e-3, 0.1e-3, 0.1e-3])
    for version, expected in ((0, 1e-3), (2, 0.4e-3)):
        actor = CpuActor(tiny_model(seed=0, dtype=torch.float64), is_core=True, config=cfg, version=version)
        before = {n: p.detach().clone() for n, p in actor.model.named_parameters()}
        sums = sum(actor.exec_logratio_partial_sums(ms) for ms in step)
        for ms in step:
            actor.forward_backward(ms, exec_logratio_sum=sums)
        out = actor.optimizer_step()
        moved = max(float((p.detach() - before[n]).abs().max()) for n, p in actor.model.named_parameters())
        assert out["lr"] == pytest.approx(expected) and moved == pytest.approx(expected, rel=1e-3)
    for bad in ({"lr_decay_steps": -1}, {"min_lr_ratio": 1.5}):
        with pytest.raises(ValueError, match=f"actor.{next(iter(bad))}"):
            OptimizerConfig(**bad)


def test_export_import_round_trip_and_errors():
    a, b = CpuActor(tiny_model(seed=1), is_core=False), CpuActor(tiny_model(seed=2), is_core=False)
    b.import_parameters(a.export_parameters())
    for (n, p), (_, q) in zip(a.model.named_parameters(), b.model.named_parameters()):
        assert torch.equal(p, q), n
    params = a.export_parameters()
    params.pop("model.norm.weight")
    with pytest.raises(ValueError, match="model.norm.weight"):
        b.import_parameters(params)
    params = a.export_parameters()
    params["model.norm.weight"] = torch.zeros(5)
    with pytest.raises(ValueError, match="shape"):
        b.import_parameters(params)


def test_checkpoint_loads_in_transformers_and_generates(tmp_path, step):
    """The actor's checkpoint is a plain HF directory: transformers loads it with the same
    weights, its logits match, and `generate` runs greedily to the same tokens."""
    from transformers import AutoModelForCausalLM

    actor = CpuActor(tiny_model(seed=0), is_core=True, config=OptimizerConfig(lr=1e-2))
    for ms in finish_step([step[0]]):
        actor.forward_backward(ms)
    actor.optimizer_step(1.0)
    actor.save_checkpoint(str(tmp_path))
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path))
    for n, p in actor.model.named_parameters():
        assert torch.equal(dict(loaded.named_parameters())[n], p.detach()), n
    prompt = torch.tensor([[5, 17, 33, 2]])
    out = loaded.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert out.shape == (1, 12) and torch.equal(out[0, :4], prompt[0])
    # greedy continuation re-derived by hand from the actor's own model
    seq = prompt[0].tolist()
    actor.model.eval()
    with torch.no_grad():
        for _ in range(8):
            seq.append(int(actor.model(torch.tensor([seq])).logits[0, -1].argmax()))
    assert out[0].tolist() == seq

    other = CpuActor(tiny_model(seed=9), is_core=True)
    other.load_checkpoint(str(tmp_path))
    assert other.version == 1 and other.has_optimizer_state
    for n, p in actor.model.named_parameters():
        assert torch.equal(dict(other.model.named_parameters())[n], p), n


# ---------------------------------------------------------------------------- memory hand-over
from gyre.runtime.samples import train_bundle  # noqa: E402  (the worker's way to train a bundle)


def _state(actor):
    """Every bit the actor holds: parameters, buffers, grads, AdamW moments and step, version."""
    opt = actor.optimizer.state_dict() if actor.optimizer is not None else None
    return {"params": {n: p.detach().clone() for n, p in actor.model.named_parameters()},
            "buffers": {n: b.clone() for n, b in actor.model.named_buffers()},
            "grads": {n: p.grad.clone() for n, p in actor.model.named_parameters() if p.grad is not None},
            "opt": {i: {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()} for i, s in opt["state"].items()},
            "version": actor.version}


def _same(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if torch.is_tensor(a):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    return a == b


def _trained_core(step):
    """A core after one AdamW step, with the next step's gradients accumulated (so params,
    grads, both moments and the step count are all live)."""
    actor = CpuActor(tiny_model(seed=0, dtype=torch.float64), is_core=True, config=OptimizerConfig(lr=1e-2))
    train_bundle(actor, step)
    actor.optimizer_step(1.0)
    train_bundle(actor, step)
    return actor


def test_offload_restore_is_bit_exact_and_really_moves_every_tensor(step):
    actor = _trained_core(step)
    before = _state(actor)
    assert before["grads"] and before["opt"] and all(int(s["step"]) == 1 for s in before["opt"].values())
    ptrs = {n: (p.data_ptr(), p.grad.data_ptr()) for n, p in actor.model.named_parameters()}
    moment = next(iter(actor.optimizer.state.values()))["exp_avg"].data_ptr()
    moved = actor.offload()
    # params + grads + exp_avg + exp_avg_sq (+ the step scalars), all float64
    numel = sum(p.numel() for p in actor.model.parameters())
    assert moved >= 4 * numel * 8
    # new host buffers hold the state (on CPU too: the copy is real, not a no-op)
    assert all((p.data_ptr(), p.grad.data_ptr()) != ptrs[n] for n, p in actor.model.named_parameters())
    assert next(iter(actor.optimizer.state.values()))["exp_avg"].data_ptr() != moment
    assert _same(_state(actor), before)  # offloaded state is the same bits
    assert actor.offload() == 0  # idempotent
    assert actor.restore() == moved and actor.restore() == 0
    assert _same(_state(actor), before)


def test_a_step_after_offload_and_restore_equals_one_without(step):
    plain, handed = _trained_core(step), _trained_core(step)
    handed.offload()
    handed.restore()
    for a in (plain, handed):
        train_bundle(a, step)
        a.optimizer_step(1.0)
    assert _same(_state(handed), _state(plain)) and handed.version == plain.version == 2
    # the check has teeth: a restore that lost the AdamW moments would step differently
    lost = _trained_core(step)
    lost.offload()
    lost.restore()
    for s in lost.optimizer.state.values():
        s["exp_avg"].zero_()
    train_bundle(lost, step)
    lost.optimizer_step(1.0)
    assert not _same(_state(lost)["params"], _state(plain)["params"])


def test_a_satellite_without_optimizer_offloads_params_and_grads(step):
    sat = CpuActor(tiny_model(seed=0), is_core=False)
    train_bundle(sat, step)
    before = {n: (p.detach().clone(), p.grad.clone()) for n, p in sat.model.named_parameters()}
    numel = sum(p.numel() for p in sat.model.parameters())
    assert sat.offload() == 2 * numel * 4 + sum(b.numel() * b.element_size() for b in sat.model.buffers())
    assert sat.restore() > 0
    assert all(torch.equal(p, before[n][0]) and torch.equal(p.grad, before[n][1]) for n, p in sat.model.named_parameters())
