"""The CUDA kernels (gyre/csrc/cuda) against the float64 CPU reference. Skipped without a GPU
or without a CUDA build of gyre._C (the CPU build never has them)."""

from __future__ import annotations

import pytest
import torch

import gyre.loss as L
from gyre.loss import _ext
from gyre.loss import reference as R
from tests.loss.helpers import CLIP, random_step, rel, token_weight

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture(autouse=True)
def _needs_cuda_kernels():
    if not (L.extension_available() and torch._C._dispatch_has_kernel_for_dispatch_key("gyre::logprobs_fwd", "CUDA")):
        pytest.skip("gyre._C built without CUDA kernels")


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2), (torch.float64, 1e-12)])
@pytest.mark.parametrize("t,v", [(1, 7), (33, 5000), (64, 151936)])
def test_logprobs_cuda_match_reference(dtype, tol, t, v):
    g = torch.Generator().manual_seed(t * v)
    x_cpu = (torch.randn(t, v, generator=g, dtype=torch.float64) * 3).to(dtype)
    y = torch.randint(0, v, (t,), generator=g)
    up = torch.randn(t, generator=g, dtype=torch.float64)
    x = x_cpu.cuda().requires_grad_()
    out = L.token_logprobs(x, y.cuda())
    (out.double() * up.cuda()).sum().backward()
    xr = x_cpu.double().requires_grad_()
    ref = R.token_logprobs(xr, y)
    (ref * up).sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(x.grad).all()
    assert rel(out.cpu(), ref) <= tol and rel(x.grad.cpu(), xr.grad) <= tol


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 5e-6), (torch.bfloat16, 2e-2)])
def test_hidden_chunked_cuda(dtype, tol):
    g = torch.Generator().manual_seed(0)
    h_cpu = torch.randn(300, 64, generator=g, dtype=torch.float64)
    w_cpu = torch.randn(5003, 64, generator=g, dtype=torch.float64) * 0.2
    y = torch.randint(0, 5003, (300,), generator=g)
    h = h_cpu.to("cuda", dtype).requires_grad_()
    w = w_cpu.to("cuda", dtype).requires_grad_()
    L.token_logprobs_from_hidden(h, w, y.cuda(), chunk_size=128).sum().backward()
    hr, wr = h_cpu.requires_grad_(), w_cpu.requires_grad_()
    ref = R.token_logprobs_from_hidden(hr, wr, y)
    ref.sum().backward()
    # TF32 may be on for float32 matmuls; allow for it
    assert rel(h.grad.cpu(), hr.grad) <= max(tol, 2e-3 if torch.backends.cuda.matmul.allow_tf32 else 0)
    assert rel(w.grad.cpu(), wr.grad) <= max(tol, 2e-3 if torch.backends.cuda.matmul.allow_tf32 else 0)


@pytest.mark.parametrize("prepass", [False, True])
def test_gspo_loss_cuda_match_reference(prepass):
    g = torch.Generator().manual_seed(5)
    p = random_step(g, 7, 12, 31, 6)
    lp = R.token_logprobs_from_hidden(p["hidden"], p["weight"], p["targets"]).detach().float()
    ei, b = p["exec_index"], p["behavior"].float()
    mask = torch.ones_like(ei, dtype=torch.bool)
    tw = token_weight(p["advantages"], p["lengths"], ei, 7)
    sums = R.exec_logratio_partial_sums(lp, b, mask, ei, 7) if prepass else None
    a = lp.cuda().requires_grad_()
    loss, m = L.gspo_loss(a, b.cuda(), mask.cuda(), ei.cuda(), tw.cuda(), p["advantages"].cuda(),
                          p["lengths"].cuda(), exec_logratio_sum=None if sums is None else sums.cuda(), **CLIP)
    loss.backward()
    r = lp.double().requires_grad_()
    loss_r, m_r = R.gspo_loss(r, b, mask, ei, tw, p["advantages"], p["lengths"], exec_logratio_sum=sums, **CLIP)
    loss_r.backward()
    assert loss.item() == pytest.approx(loss_r.item(), rel=1e-10, abs=1e-14)
    assert rel(a.grad.cpu(), r.grad) <= 1e-6
    for k, v in m_r.items():
        assert m[k] == pytest.approx(v, rel=1e-9, abs=1e-12), k
    torch.testing.assert_close(L.exec_logratio_partial_sums(lp.cuda(), b.cuda(), mask.cuda(), ei.cuda(), 7).cpu(),
                               R.exec_logratio_partial_sums(lp, b, mask, ei, 7), rtol=1e-12, atol=1e-13)


def test_opcheck_cuda():
    x = torch.randn(5, 9, device="cuda", dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, 9, (5,), device="cuda")
    torch.library.opcheck(torch.ops.gyre.logprobs_fwd.default, (x, y))
    assert _ext.usable_for(x)
