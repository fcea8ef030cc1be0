"""Actor contract (gyre.backends.protocols.Actor), against independent float64 computations and
hand-computed values: log-probs, gradient accumulation, grad_scale before clipping, parameter
export/import, checkpoints."""

from __future__ import annotations

import pytest
import torch

from gyre.backends import factory
from gyre.backends.protocols import Actor
from gyre.backends.config import BackendConfig, ModelConfig, OptimizerConfig
from gyre.loss.config import LossConfig
from gyre.topology import ParallelConfig
from tests.backends.helpers import random_step, tiny_model

ACTORS = factory.runnable(factory.ACTORS)


def _actor(kind: str, model, *, is_core: bool, **actor) -> Actor:
    a = factory.build_actor(ModelConfig(dtype="float64"), BackendConfig(actor=kind), OptimizerConfig(**actor), LossConfig(),
                            ParallelConfig(), model.config, is_core=is_core)
    assert isinstance(a, Actor) and a.version == -1
    a.import_parameters({n: p.detach() for n, p in model.named_parameters()})
    a.version = 0
    return a


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=0, dtype=torch.float64)


@pytest.fixture(scope="module")
def step(model):
    return random_step(model, seed=3, num_exec=3, seqs_per_exec=2, num_micro=3)


def _prepass(actor: Actor, step) -> torch.Tensor:
    """s_i needs Σδ over every micro-step of an execution split across micro-steps."""
    return sum(actor.exec_logratio_partial_sums(ms) for ms in step)


def _grads(actor: Actor) -> dict[str, torch.Tensor]:
    return {n: g.clone() for n, g in actor.debug_state()["grads"].items() if g is not None}


@pytest.mark.parametrize("kind", ACTORS)
def test_forward_logprobs_equal_a_float64_per_sequence_forward(kind, model, step):
    """ℓ_t from the packed micro-step equals log-softmax of the HF model run on each sequence alone."""
    ms = step[0]
    got = _actor(kind, model, is_core=False).forward_logprobs(ms)
    cu = ms.cu_seqlens.tolist()
    for a, b in zip(cu, cu[1:]):
        with torch.no_grad():
            logits = model(input_ids=ms.input_ids[None, a:b]).logits[0].double()
        ref = torch.log_softmax(logits, -1).gather(1, ms.targets[a:b, None])[:, 0]
        assert torch.allclose(got[a:b].double(), ref, atol=1e-9)


@pytest.mark.parametrize("kind", ACTORS)
def test_forward_backward_accumulates(kind, model, step):
    """Gradients of two micro-steps, one after the other, are the sum of each one's alone."""
    both = _actor(kind, model, is_core=True)
    sums = _prepass(both, step)
    for ms in step[:2]:
        both.forward_backward(ms, exec_logratio_sum=sums)
    alone = []
    for ms in step[:2]:
        a = _actor(kind, model, is_core=True)
        a.forward_backward(ms, exec_logratio_sum=sums)
        alone.append(_grads(a))
    got = _grads(both)
    assert got and set(got) == set(alone[0])
    for n in got:
        assert torch.allclose(got[n], alone[0][n] + alone[1][n], rtol=1e-10, atol=1e-14), n
    both.zero_grad()
    assert not _grads(both)


@pytest.mark.parametrize("kind", ACTORS)
@pytest.mark.parametrize("scale,clip_at", [(3.0, 0.5), (0.25, 100.0)])  # clip active / inactive
def test_grad_scale_multiplies_the_gradient_before_clipping(kind, model, step, scale, clip_at):
    """Hand-computed: g' = s·g·min(1, C/(‖s·g‖ + 1e-6)) (torch's clip), and after AdamW's first
    step exp_avg = (1 − β1)·g'. The reported grad_norm is ‖s·g‖ (before the clip)."""
    actor = _actor(kind, model, is_core=True)
    sums = _prepass(actor, step)
    for ms in step:
        actor.forward_backward(ms, exec_logratio_sum=sums)
    g = _grads(actor)
    norm = torch.sqrt(sum((v.double() ** 2).sum() for v in g.values())).item()
    clip = clip_at * scale * norm  # C relative to the scaled norm: clip_at < 1 clips
    stats = actor.optimizer_step(max_grad_norm=clip, grad_scale=scale)
    assert stats["grad_norm"] == pytest.approx(scale * norm, rel=1e-9)
    assert actor.version == 1
    factor = scale * min(1.0, clip / (scale * norm + 1e-6))
    beta1 = OptimizerConfig().betas[0]
    state = actor.debug_state()["optimizer"]["state"]
    for i, (n, v) in enumerate(g.items()):
        assert torch.allclose(state[i]["exp_avg"], (1 - beta1) * factor * v, rtol=1e-9, atol=1e-15), n
    assert not _grads(actor)  # the step zeroes the gradients


@pytest.mark.parametrize("kind", ACTORS)
def test_export_import_round_trip_is_exact(kind, model):
    a = _actor(kind, model, is_core=False)
    out = a.export_parameters()
    changed = {n: t + 0.5 for n, t in out.items()}
    b = _actor(kind, tiny_model(seed=9, dtype=torch.float64), is_core=False)
    b.import_parameters(changed)
    back = b.export_parameters()
    assert list(back) == list(changed) and all(torch.equal(back[n], changed[n]) for n in changed)
    with pytest.raises(ValueError):
        b.import_parameters({n: t for n, t in list(changed.items())[1:]})


@pytest.mark.parametrize("kind", ACTORS)
def test_checkpoint_round_trip(kind, model, step, tmp_path):
    """Weights, optimizer state and version come back exactly."""
    a = _actor(kind, model, is_core=True)
    sums = _prepass(a, step)
    for ms in step:
        a.forward_backward(ms, exec_logratio_sum=sums)
    a.optimizer_step(grad_scale=1.0)
    a.save_checkpoint(str(tmp_path / "ck"))
    b = _actor(kind, tiny_model(seed=5, dtype=torch.float64), is_core=True)
    b.load_checkpoint(str(tmp_path / "ck"))
    assert b.version == 1
    sa, sb = a.debug_state(), b.debug_state()
    assert all(torch.equal(sa["params"][n], sb["params"][n]) for n in sa["params"])
    for i, st in sa["optimizer"]["state"].items():
        for k, v in st.items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(sb["optimizer"]["state"][i][k])), (i, k)
