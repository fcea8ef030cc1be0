"""The clip gate with ε_low ≠ ε_high, against hand-computed values, on every path that gates.

Elsewhere the tests use ε_low = ε_high, where a gate that reads the wrong ε cannot be seen.
Here ε_low = 0.002 and ε_high = 0.05 (docs/design.md §6: A > 0 is gated above 1 + ε_high,
A < 0 below 1 − ε_low), and each execution sits where only the right ε gives its gate:

    exec  A     L  δ                 s_i             gate
    0     +1    2  (0.02, 0)         e^{0.01}  1.010  1.010 < 1.05: trained  (> 1.002: ε_low would gate it)
    1     −0.5  1  (−0.01)           e^{−0.01} 0.990  0.990 < 0.998: gated   (> 0.95: ε_high would train it)
    2     +2    1  (0.06)            e^{0.06}  1.062  1.062 > 1.05: gated
    3     −1    2  (−0.002, 0)       e^{−0.001} 0.999 0.999 ≥ 0.998: trained

|E| = 4, so ∂loss/∂ℓ_t = −m_i·A_i·ω_t/(4·L_i): exec 0 → −ω_t/8, exec 3 → +ω_t/8, the rest 0.
"""

from __future__ import annotations

import math

import pytest
import torch

import gyre.loss as L
from gyre.loss import reference as R

EPS_LOW, EPS_HIGH = 0.002, 0.05
CLIP = {"eps_low": EPS_LOW, "eps_high": EPS_HIGH, "cap": 5.0}
E = 4

#                 e0     e0    off   e1     e2    e3      e3
LP = [-1.0, -2.0, -9.0, -0.5, -1.5, -3.0, -0.25]
DELTA = [0.02, 0.0, 0.0, -0.01, 0.06, -0.002, 0.0]
EXEC = [0, 0, -1, 1, 2, 3, 3]
ADV = [1.0, -0.5, 2.0, -1.0]
LENGTHS = [2, 1, 1, 2]

# Hand values (from the table above).
GATE = [1.0, 0.0, 0.0, 1.0]
RATIO = [math.exp(0.01), math.exp(-0.01), math.exp(0.06), math.exp(-0.001)]
GRAD = [-math.exp(0.02) / 8, -1 / 8, 0.0, 0.0, 0.0, math.exp(-0.002) / 8, 1 / 8]
LOSS = -math.exp(0.02) / 8 * -1.0 - 1 / 8 * -2.0 + math.exp(-0.002) / 8 * -3.0 + 1 / 8 * -0.25


def _inputs(device: str = "cpu"):
    lp = torch.tensor(LP, dtype=torch.float64, device=device)
    b = lp - torch.tensor(DELTA, dtype=torch.float64, device=device)
    ei = torch.tensor(EXEC, device=device)
    mask = ei >= 0
    adv = torch.tensor(ADV, dtype=torch.float64, device=device)
    lens = torch.tensor(LENGTHS, device=device)
    idx = ei.clamp_min(0)
    tw = torch.where(mask, -adv[idx] / (E * lens[idx].double()), 0.0)  # −A_i/(|E|·L_i)
    return lp, b, mask, ei, tw, adv, lens


def _check(loss, grad, metrics):
    assert loss.item() == pytest.approx(LOSS, rel=1e-12)
    torch.testing.assert_close(grad.cpu(), torch.tensor(GRAD, dtype=torch.float64), rtol=1e-12, atol=1e-15)
    assert metrics["clip_frac"] == 0.5 and metrics["num_clipped"] == 2.0
    assert metrics["ratio_min"] == pytest.approx(RATIO[1], rel=1e-12)
    assert metrics["ratio_max"] == pytest.approx(RATIO[2], rel=1e-12)


@pytest.mark.parametrize("prepass", [False, True])
def test_reference_gates_each_side_with_its_own_eps(prepass):
    lp, b, mask, ei, tw, adv, lens = _inputs()
    sums = R.exec_logratio_partial_sums(lp, b, mask, ei, E) if prepass else None
    terms = R.gspo_terms(lp, b, mask, ei, adv, lens, exec_logratio_sum=sums, **CLIP)
    assert terms["gate"].tolist() == GATE
    torch.testing.assert_close(terms["ratio"], torch.tensor(RATIO, dtype=torch.float64), rtol=1e-12, atol=0)
    x = lp.clone().requires_grad_()
    loss, m = R.gspo_loss(x, b, mask, ei, tw, adv, lens, exec_logratio_sum=sums, **CLIP)
    loss.backward()
    _check(loss, x.grad, m)
    # docs/design.md §6 written literally agrees
    d = R.gspo_loss_from_definition(lp, b, mask, ei, adv, lens, E, **CLIP)
    assert d.item() == pytest.approx(LOSS, rel=1e-12)


def _devices():
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.skipif(not L.extension_available(), reason="gyre._C not built (pip install -e .)")
@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("prepass", [False, True])
def test_fused_kernel_gates_each_side_with_its_own_eps(device, prepass):
    """The fused op (gyre/csrc gspo_cpu.cpp, cuda/gspo.cu), called directly and through gspo_loss."""
    if device == "cuda" and not torch._C._dispatch_has_kernel_for_dispatch_key("gyre::gspo_loss_fwd", "CUDA"):
        pytest.skip("gyre._C built without CUDA kernels")
    lp, b, mask, ei, tw, adv, lens = _inputs(device)
    sums = torch.ops.gyre.exec_logratio_sums(lp, b, mask, ei, E) if prepass else None
    _, coeff, ratio, gate, count, _ = torch.ops.gyre.gspo_loss_fwd(lp, b, mask, ei, tw, adv, lens, sums,
                                                                   EPS_LOW, EPS_HIGH, 5.0)
    assert gate.cpu().tolist() == GATE and count.cpu().tolist() == LENGTHS
    torch.testing.assert_close(ratio.cpu(), torch.tensor(RATIO, dtype=torch.float64), rtol=1e-12, atol=0)
    torch.testing.assert_close(coeff.cpu(), torch.tensor(GRAD, dtype=torch.float64), rtol=1e-12, atol=1e-15)
    x = lp.clone().requires_grad_()
    loss, m = L.gspo_loss(x, b, mask, ei, tw, adv, lens, exec_logratio_sum=sums, **CLIP)
    loss.backward()
    _check(loss, x.grad, m)
