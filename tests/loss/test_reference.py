"""The pure-torch reference against hand-computed values and docs/design.md §6 written literally."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gyre.loss import reference as R
from tests.loss.helpers import CLIP, random_step, token_weight


def hand_example():
    """2 executions, 5 targets, packed with one non-target position in between.

    exec 0: A = +1, L = 2, δ = (0.02, 0)          → s = e^{0.01} = 1.01005 > 1.005, A > 0: clipped (m = 0)
    exec 1: A = −0.5, L = 3, δ = (ln 6, −0.9, −0.9) → Σδ = ln 6 − 1.8 = −0.00824, s = 0.99726 ≥ 0.995: m = 1
            ω = (min(6, 5) = 5 (capped), e^{−0.9}, e^{−0.9})
    |E| = 2.
    """
    lp = torch.tensor([-1.0, -0.5, -7.0, -2.0, -1.5, -2.5], dtype=torch.float64)
    delta = torch.tensor([0.02, math.log(6.0), 0.0, 0.0, -0.9, -0.9], dtype=torch.float64)
    mask = torch.tensor([True, True, False, True, True, True])
    exec_index = torch.tensor([0, 1, -1, 0, 1, 1])
    b = lp - delta
    adv = torch.tensor([1.0, -0.5], dtype=torch.float64)
    lengths = torch.tensor([2, 3])
    return lp, b, mask, exec_index, adv, lengths


def test_hand_computed_two_executions():
    lp, b, mask, ei, adv, lengths = hand_example()
    # token_weight = −A_i/(|E|·L_i): exec 0 → −1/4, exec 1 → +1/12
    tw = torch.where(mask, -adv[ei.clamp_min(0)] / (2 * lengths[ei.clamp_min(0)].double()), 0.0)
    lp = lp.clone().requires_grad_()
    loss, m = R.gspo_loss(lp, b, mask, ei, tw, adv, lengths, **CLIP)
    loss.backward()
    e09 = math.exp(-0.9)
    # loss = −(1/2)·[0 + (−0.5/3)·(5·(−0.5) + e^{−0.9}·(−1.5) + e^{−0.9}·(−2.5))] = −(2.5 + 4e^{−0.9})/12
    assert loss.item() == pytest.approx(-(2.5 + 4 * e09) / 12, rel=1e-12)
    # ∂loss/∂ℓ_t = −m_i·A_i·ω_t/(|E|·L_i): exec 0 gated → 0; exec 1 → ω_t/12
    expected = torch.tensor([0.0, 5 / 12, 0.0, 0.0, e09 / 12, e09 / 12], dtype=torch.float64)
    torch.testing.assert_close(lp.grad, expected, rtol=1e-12, atol=1e-15)
    terms = R.gspo_terms(lp, b, mask, ei, adv, lengths, **CLIP)
    assert terms["gate"].tolist() == [0.0, 1.0]
    assert terms["ratio"][0].item() == pytest.approx(math.exp(0.01), rel=1e-12)
    assert terms["ratio"][1].item() == pytest.approx(math.exp((math.log(6) - 1.8) / 3), rel=1e-12)
    omega = torch.tensor([math.exp(0.02), 5.0, 0.0, 1.0, e09, e09], dtype=torch.float64)
    torch.testing.assert_close(terms["omega"], omega, rtol=1e-12, atol=0)
    assert m["clip_frac"] == 0.5 and m["clip_frac_tokens"] == pytest.approx(2 / 5)
    assert m["omega_capped_frac"] == pytest.approx(1 / 5)
    assert m["ratio_min"] == pytest.approx(math.exp((math.log(6) - 1.8) / 3))
    assert m["ratio_max"] == pytest.approx(math.exp(0.01))
    assert m["abs_delta_mean"] == pytest.approx((0.02 + math.log(6) + 1.8) / 5)
    # docs/design.md §6 written literally gives the same number
    assert R.gspo_loss_from_definition(lp, b, mask, ei, adv, lengths, 2, **CLIP).item() == pytest.approx(loss.item(), rel=1e-12)


def test_negative_advantage_clipped_below():
    # A < 0 and s < 1 − ε_low: gated. One execution, L = 1, δ = −0.01 → s = 0.990 < 0.995.
    lp = torch.tensor([-1.0], dtype=torch.float64, requires_grad=True)
    b = torch.tensor([-0.99], dtype=torch.float64)
    loss, m = R.gspo_loss(lp, b, torch.tensor([True]), torch.tensor([0]), torch.tensor([0.5], dtype=torch.float64),
                          torch.tensor([-0.5], dtype=torch.float64), torch.tensor([1]), **CLIP)
    loss.backward()
    assert m["clip_frac"] == 1.0 and float(lp.grad) == 0.0
    # ...but with a wider ε_low it trains: ∂/∂ℓ = ω·token_weight = e^{−0.01}·0.5
    lp.grad = None
    loss, m = R.gspo_loss(lp, b, torch.tensor([True]), torch.tensor([0]), torch.tensor([0.5], dtype=torch.float64),
                          torch.tensor([-0.5], dtype=torch.float64), torch.tensor([1]), **{**CLIP, "eps_low": 0.02})
    loss.backward()
    assert m["clip_frac"] == 0.0 and float(lp.grad) == pytest.approx(0.5 * math.exp(-0.01), rel=1e-12)


def test_token_logprobs_uniform_and_peaked():
    x = torch.zeros(2, 4, dtype=torch.float64)
    x[1, 2] = math.log(5.0)  # softmax row 1 = (1, 1, 5, 1)/8
    out = R.token_logprobs(x, torch.tensor([0, 2]))
    torch.testing.assert_close(out, torch.tensor([math.log(0.25), math.log(5 / 8)], dtype=torch.float64))


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), num_exec=st.integers(1, 6))
def test_packed_form_equals_definition(seed, num_exec):
    g = torch.Generator().manual_seed(seed)
    p = random_step(g, num_exec, 8, 17, 4)
    lp = R.token_logprobs_from_hidden(p["hidden"], p["weight"], p["targets"]).detach()
    n = lp.numel()
    perm = torch.randperm(n, generator=g)  # any token order
    lp, ei = lp[perm], p["exec_index"][perm]
    b, mask = p["behavior"][perm], torch.ones(n, dtype=torch.bool)
    tw = token_weight(p["advantages"], p["lengths"], ei, num_exec)
    a = lp.clone().requires_grad_()
    loss, _ = R.gspo_loss(a, b, mask, ei, tw, p["advantages"], p["lengths"], **CLIP)
    loss.backward()
    d = lp.clone().requires_grad_()
    ref = R.gspo_loss_from_definition(d, b, mask, ei, p["advantages"], p["lengths"], num_exec, **CLIP)
    ref.backward()
    assert loss.item() == pytest.approx(ref.item(), rel=1e-10, abs=1e-14)
    torch.testing.assert_close(a.grad, d.grad, rtol=1e-10, atol=1e-14)


def test_bad_inputs_name_the_field():
    lp = torch.zeros(3)
    ok = dict(behavior_logprobs=torch.zeros(3), target_mask=torch.ones(3, dtype=torch.bool),
              exec_index=torch.zeros(3, dtype=torch.long), token_weight=torch.zeros(3, dtype=torch.float64),
              advantages=torch.ones(1, dtype=torch.float64), exec_lengths=torch.tensor([3]))
    with pytest.raises(ValueError, match="behavior_logprobs"):
        R.gspo_loss(lp, **{**ok, "behavior_logprobs": torch.zeros(2)}, **CLIP)
    with pytest.raises(ValueError, match="exec_index out of range"):
        R.gspo_loss(lp, **{**ok, "exec_index": torch.tensor([0, 1, 0])}, **CLIP)
    with pytest.raises(ValueError, match="target_mask must be bool"):
        R.gspo_loss(lp, **{**ok, "target_mask": torch.ones(3)}, **CLIP)
    with pytest.raises(ValueError, match="exec_lengths"):
        R.gspo_loss(lp, **{**ok, "exec_lengths": torch.tensor([0])}, **CLIP)
    with pytest.raises(ValueError, match="targets out of range"):
        R.token_logprobs(torch.zeros(2, 4), torch.tensor([0, 4]))


def test_fallback_chunked_path_gradcheck():
    """The pure-torch chunked fallback (used when gyre._C is missing) against autograd."""
    from gyre.loss.logprobs import _ChunkedReference

    g = torch.Generator().manual_seed(4)
    h = torch.randn(7, 5, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(11, 5, generator=g, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, 11, (7,), generator=g)
    torch.testing.assert_close(_ChunkedReference.apply(h, w, y, 3), R.token_logprobs_from_hidden(h, w, y))
    assert torch.autograd.gradcheck(lambda a, b: _ChunkedReference.apply(a, b, y, 3), (h, w))


def test_microstep_entry_point_matches_hand_example():
    from gyre.loss import gspo_loss_for_microstep
    from gyre.trajectory.microstep import MicroStep

    lp, b, mask, ei, adv, lengths = hand_example()
    tw = torch.where(mask, -adv[ei.clamp_min(0)] / (2 * lengths[ei.clamp_min(0)].double()), 0.0)
    n = lp.numel()
    ms = MicroStep(input_ids=torch.zeros(n, dtype=torch.long), position_ids=torch.arange(n),
                   cu_seqlens=torch.tensor([0, n]), targets=torch.zeros(n, dtype=torch.long), target_mask=mask,
                   behavior_logprobs=b.float(), exec_index=ei, token_weight=tw, advantages=adv,
                   exec_lengths=lengths, num_executions=2)
    a = lp.clone().requires_grad_()
    loss, m = gspo_loss_for_microstep(a, ms, **CLIP)
    loss.backward()
    # behavior rounded to float32 moves δ by ~1e-8: same gates, loss to ~1e-7
    assert loss.item() == pytest.approx(-(2.5 + 4 * math.exp(-0.9)) / 12, rel=1e-6)
    assert a.grad[1].item() == pytest.approx(5 / 12, rel=1e-9) and a.grad[0].item() == 0.0
    assert m["clip_frac"] == 0.5
