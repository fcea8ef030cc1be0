"""The fused gyre:: ops against the float64 reference; opcheck; errors; the fallback warning."""

from __future__ import annotations

import logging

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gyre.loss as L
from gyre.loss import _ext
from gyre.loss import reference as R
from tests.loss.helpers import CLIP, random_step, rel, token_weight

pytestmark = pytest.mark.skipif(not L.extension_available(), reason="gyre._C not built (pip install -e .)")

TOL = {torch.float32: 1e-6, torch.bfloat16: 1e-2, torch.float64: 1e-12}


def _logits(gen, t, v, dtype, scale=3.0):
    return (torch.randn(t, v, generator=gen, dtype=torch.float64) * scale).to(dtype)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), t=st.integers(1, 33), v=st.integers(1, 5000),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float64]))
def test_logprobs_match_float64_reference(seed, t, v, dtype):
    g = torch.Generator().manual_seed(seed)
    x = _logits(g, t, v, dtype).requires_grad_()
    y = torch.randint(0, v, (t,), generator=g)
    up = torch.randn(t, generator=g, dtype=torch.float64)
    out = L.token_logprobs(x, y)
    assert out.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    (out.double() * up).sum().backward()
    xr = x.detach().double().requires_grad_()
    ref = R.token_logprobs(xr, y)
    (ref * up).sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(x.grad).all()
    # value: the fused op reads the same (rounded) logits, so only accumulation error remains
    assert rel(out, ref) <= TOL[dtype]
    # gradient: bf16 grads are rounded to bf16 on output (2^-9 relative)
    assert rel(x.grad, xr.grad) <= TOL[dtype]


def test_logprobs_extreme_logits_stay_finite():
    x = torch.tensor([[1e4, -1e4, 0.0, 3.0], [-float("inf"), 2.0, -float("inf"), 1.0],
                      [-3e4, -3e4, -3e4, -3e4]], requires_grad=True)
    x_wide = torch.cat([torch.full((1, 5000), -float("inf")), torch.zeros(1, 3)], 1).requires_grad_()
    for logits, y in ((x, torch.tensor([0, 1, 2])), (x_wide, torch.tensor([5001]))):
        out = L.token_logprobs(logits, y)
        out.sum().backward()
        ref = R.token_logprobs(logits.detach().double(), y)
        assert torch.isfinite(out).all() and torch.isfinite(logits.grad).all()
        torch.testing.assert_close(out.double(), ref, rtol=1e-6, atol=1e-6)
    # all −inf except the first-block-empty row: lse = log 3, ℓ = −log 3
    assert float(L.token_logprobs(x_wide.detach(), torch.tensor([5001]))) == pytest.approx(-1.0986123, rel=1e-6)


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), t=st.integers(1, 40), chunk=st.integers(1, 17),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_hidden_chunked_matches_reference(seed, t, chunk, dtype):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(t, 24, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    w = (torch.randn(301, 24, generator=g, dtype=torch.float64) * 0.3).to(dtype).requires_grad_()
    y = torch.randint(0, 301, (t,), generator=g)
    up = torch.randn(t, generator=g, dtype=torch.float64)
    (L.token_logprobs_from_hidden(h, w, y, chunk_size=chunk).double() * up).sum().backward()
    hr, wr = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref = R.token_logprobs_from_hidden(hr, wr, y)
    (ref * up).sum().backward()
    out = L.token_logprobs_from_hidden(h.detach(), w.detach(), y, chunk_size=chunk)
    # bf16: logits = hidden @ wᵀ are formed in bf16 (as any bf16 LM head does), so 1e-2.
    assert rel(out, ref) <= TOL[dtype] * (1 if dtype == torch.bfloat16 else 5)
    assert rel(h.grad, hr.grad) <= TOL[dtype] * 5 and rel(w.grad, wr.grad) <= TOL[dtype] * 5


def test_hidden_chunked_gradcheck_float64():
    g = torch.Generator().manual_seed(3)
    h = torch.randn(7, 5, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(11, 5, generator=g, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, 11, (7,), generator=g)
    assert torch.autograd.gradcheck(lambda a, b: L.token_logprobs_from_hidden(a, b, y, chunk_size=3), (h, w))


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), num_exec=st.integers(1, 8), prepass=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.float64]))
def test_gspo_loss_matches_reference_random_packings(seed, num_exec, prepass, dtype):
    g = torch.Generator().manual_seed(seed)
    p = random_step(g, num_exec, 10, 23, 6)
    lp_full = R.token_logprobs_from_hidden(p["hidden"], p["weight"], p["targets"]).detach()
    n = lp_full.numel()
    # random packing: shuffle and interleave non-target positions (exec_index −1)
    perm = torch.randperm(n, generator=g)
    pad = int(torch.randint(0, 5, (1,), generator=g))
    lp = torch.cat([lp_full[perm], torch.randn(pad, generator=g, dtype=torch.float64)]).to(dtype)
    b = torch.cat([p["behavior"][perm], torch.zeros(pad, dtype=torch.float64)]).float()
    ei = torch.cat([p["exec_index"][perm], torch.full((pad,), -1)])
    mask = ei >= 0
    tw = torch.where(mask, token_weight(p["advantages"], p["lengths"], ei.clamp_min(0), num_exec), 0.0)
    sums = R.exec_logratio_partial_sums(lp, b, mask, ei, num_exec) if prepass else None
    a = lp.clone().requires_grad_()
    loss, m = L.gspo_loss(a, b, mask, ei, tw, p["advantages"], p["lengths"], exec_logratio_sum=sums, **CLIP)
    loss.backward()
    r = lp.double().clone().requires_grad_()
    loss_r, m_r = R.gspo_loss(r, b, mask, ei, tw, p["advantages"], p["lengths"], exec_logratio_sum=sums, **CLIP)
    loss_r.backward()
    assert loss.item() == pytest.approx(loss_r.item(), rel=1e-12, abs=1e-15)
    assert a.grad.dtype == dtype
    assert rel(a.grad, r.grad) <= TOL[dtype] if r.grad.norm() > 0 else a.grad.abs().max() == 0
    for k, v in m_r.items():
        assert m[k] == pytest.approx(v, rel=1e-9, abs=1e-12), k
    torch.testing.assert_close(L.exec_logratio_partial_sums(lp, b, mask, ei, num_exec),
                               R.exec_logratio_partial_sums(lp, b, mask, ei, num_exec), rtol=1e-12, atol=1e-14)


def _opcheck_inputs():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 9, generator=g, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, 9, (5,), generator=g)
    h = torch.randn(5, 4, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(9, 4, generator=g, dtype=torch.float64, requires_grad=True)
    lp = torch.randn(6, generator=g, dtype=torch.float64, requires_grad=True)
    b = lp.detach() + 0.01 * torch.randn(6, generator=g, dtype=torch.float64)
    mask = torch.tensor([True, True, False, True, True, True])
    ei = torch.tensor([0, 1, -1, 0, 1, 1])
    tw = torch.tensor([-0.25, 0.1, 0.0, -0.25, 0.1, 0.1], dtype=torch.float64)
    adv = torch.tensor([1.0, -0.5], dtype=torch.float64)
    lens = torch.tensor([2, 3])
    lse = torch.logsumexp(x.detach(), -1)
    return {
        "logprobs_fwd": (x, y),
        "logprobs_bwd": (torch.randn(5, dtype=torch.float64), x.detach(), y, lse),
        "logprobs_hidden_fwd": (h, w, y, 2),
        "logprobs_hidden_bwd": (torch.randn(5, dtype=torch.float64), h.detach(), w.detach(), y,
                                torch.logsumexp(h.detach() @ w.detach().t(), -1), 2),
        "exec_logratio_sums": (lp.detach(), b, mask, ei, 2),
        "gspo_loss_fwd": (lp, b, mask, ei, tw, adv, lens, None, 0.005, 0.005, 5.0),
        "gspo_loss_fwd_prepass": (lp, b, mask, ei, tw, adv, lens, torch.tensor([0.001, -0.2], dtype=torch.float64),
                                  0.005, 0.005, 5.0),
    }


@pytest.mark.parametrize("name", list(_opcheck_inputs()))
def test_opcheck(name):
    args = _opcheck_inputs()[name]
    op = getattr(torch.ops.gyre, name.removesuffix("_prepass")).default
    torch.library.opcheck(op, args)


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match="targets out of range"):
        L.token_logprobs(torch.zeros(2, 4), torch.tensor([0, 4]))
    with pytest.raises(RuntimeError, match="out of range"):
        torch.ops.gyre.logprobs_fwd(torch.zeros(2, 4), torch.tensor([0, -1]))
    with pytest.raises(RuntimeError, match="exec_index"):
        torch.ops.gyre.exec_logratio_sums(torch.zeros(2), torch.zeros(2), torch.ones(2, dtype=torch.bool),
                                          torch.tensor([0, 3]), 2)
    with pytest.raises(RuntimeError, match="exec_lengths"):
        torch.ops.gyre.gspo_loss_fwd(torch.zeros(1), torch.zeros(1), torch.ones(1, dtype=torch.bool),
                                     torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.float64),
                                     torch.ones(1, dtype=torch.float64), torch.zeros(1, dtype=torch.long),
                                     None, 0.005, 0.005, 5.0)
    with pytest.raises(ValueError, match="lm_head_weight"):
        L.token_logprobs_from_hidden(torch.zeros(2, 3), torch.zeros(4, 5), torch.tensor([0, 1]))


def test_fallback_warns_once_and_matches(monkeypatch, caplog):
    saved = dict(_ext._state)
    monkeypatch.setenv("GYRE_LOSS_BACKEND", "reference")
    _ext._state.clear()
    try:
        with caplog.at_level(logging.WARNING, logger="gyre.loss._ext"):
            x, y = torch.randn(3, 7), torch.tensor([1, 2, 6])
            a = L.token_logprobs(x, y)
            L.token_logprobs(x, y)
        warnings = [r for r in caplog.records if "reference" in r.getMessage()]
        assert len(warnings) == 1 and "\n" not in warnings[0].getMessage()
    finally:
        _ext._state.clear()
        _ext._state.update(saved)
    torch.testing.assert_close(a, L.token_logprobs(x, y), rtol=1e-6, atol=1e-6)
