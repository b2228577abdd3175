import pytest
import torch

from kernels import add_rms_norm, rms_norm
from kernels.rms_norm import add_rms_norm_reference, add_rms_norm_triton, rms_norm_reference, rms_norm_triton
from tests.kernels.conftest import assert_close, case_generator


@pytest.mark.parametrize("shape", [(3, 7), (2, 5, 33), (1, 1, 130)])
def test_rms_norm_matches_formula_fwd_bwd(shape):
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(*shape, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(shape[-1], generator=g, dtype=torch.float64, requires_grad=True)
    y = rms_norm(x, w, 1e-6)
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ref = x2 / torch.sqrt((x2 * x2).mean(-1, keepdim=True) + 1e-6) * w2
    torch.testing.assert_close(y, ref)
    gy = torch.randn(y.shape, generator=g, dtype=torch.float64)
    (y * gy).sum().backward()
    (ref * gy).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)
    torch.testing.assert_close(w.grad, w2.grad)


def test_bf16_computes_in_fp32():
    x = torch.randn(4, 64).to(torch.bfloat16)
    w = torch.ones(64, dtype=torch.bfloat16)
    y = rms_norm(x, w, 1e-6)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), rms_norm(x.float(), w.float(), 1e-6), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unweighted_reference_is_the_models(dtype):
    from trainer.models.deepseek_v4.layers import unweighted_rms_norm

    x = torch.randn(3, 4, 37, generator=case_generator("unweighted", dtype)).to(dtype)
    assert torch.equal(rms_norm(x, None, 1e-6), unweighted_rms_norm(x, 1e-6))
    q = x.view(3, 4, 37).transpose(0, 1)  # non-contiguous, as the model's queries
    assert torch.equal(rms_norm(q, None, 1e-6), unweighted_rms_norm(q, 1e-6))


def test_add_rms_norm_reference():
    g = case_generator("add")
    x, r, w = torch.randn(2, 3, 16, generator=g), torch.randn(2, 3, 16, generator=g), torch.randn(16, generator=g)
    y, h = add_rms_norm(x, r, w, 1e-5)
    torch.testing.assert_close(h, x + r)
    torch.testing.assert_close(y, rms_norm(x + r, w, 1e-5))


def _inputs(shape, dtype, weighted, residual, case):
    g = case_generator(*case)
    x = torch.randn(*shape, generator=g).to(dtype)
    r = torch.randn(*shape, generator=g).to(dtype) if residual else None
    w = (1 + 0.5 * torch.randn(shape[-1], generator=g)).to(dtype) if weighted else None
    dy = torch.randn(*shape, generator=g).to(dtype)
    dh = torch.randn(*shape, generator=g).to(dtype)
    return x, r, w, dy, dh


def _leaves(*ts, device):
    return [None if t is None else t.detach().to(device).clone().requires_grad_() for t in ts]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(5, 33), (3, 2, 130), (1, 8)])
@pytest.mark.parametrize("weighted", [True, False])
def test_triton_rms_norm_matches_reference(triton_device, dtype, shape, weighted):
    x, _, w, dy, _ = _inputs(shape, dtype, weighted, False, ("rms", dtype, shape, weighted))
    xt, wt = _leaves(x, w, device=triton_device)
    xr, wr = _leaves(x.float(), None if w is None else w.float(), device="cpu")  # fp32 truth on the same values
    y = rms_norm_triton(xt, wt, 1e-6)
    ref = rms_norm_reference(xr, wr, 1e-6)
    assert y.dtype == dtype and y.shape == x.shape
    assert_close(y.cpu(), ref, dtype)
    y.backward(dy.to(triton_device))
    ref.backward(dy.float())
    assert_close(xt.grad.cpu(), xr.grad, dtype)
    if weighted:
        assert wt.grad.dtype == dtype
        assert_close(wt.grad.cpu(), wr.grad, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(7, 33), (2, 3, 130)])
@pytest.mark.parametrize("weighted", [True, False])
def test_triton_add_rms_norm_matches_reference(triton_device, dtype, shape, weighted):
    x, r, w, dy, dh = _inputs(shape, dtype, weighted, True, ("add_rms", dtype, shape, weighted))
    xt, rt, wt = _leaves(x, r, w, device=triton_device)
    xr, rr, wr = _leaves(x.float(), r.float(), None if w is None else w.float(), device="cpu")
    y, h = add_rms_norm_triton(xt, rt, wt, 1e-6)
    ref_y, ref_h = add_rms_norm_reference(xr, rr, wr, 1e-6)
    assert_close(h.cpu(), ref_h, dtype)
    assert_close(y.cpu(), ref_y, dtype)
    torch.autograd.backward([y, h], [dy.to(triton_device), dh.to(triton_device)])
    torch.autograd.backward([ref_y, ref_h], [dy.float(), dh.float()])
    assert_close(xt.grad.cpu(), xr.grad, dtype)
    assert_close(rt.grad.cpu(), rr.grad, dtype)
    if weighted:
        assert_close(wt.grad.cpu(), wr.grad, dtype)


def test_triton_add_rms_norm_only_normed_used(triton_device):
    """The new residual's gradient may be absent (only the normed output used)."""
    x, r, w, dy, _ = _inputs((4, 24), torch.float32, True, True, ("add_rms_partial",))
    xt, rt, wt = _leaves(x, r, w, device=triton_device)
    xr, rr, wr = _leaves(x, r, w, device="cpu")
    add_rms_norm_triton(xt, rt, wt, 1e-6)[0].backward(dy.to(triton_device))
    add_rms_norm_reference(xr, rr, wr, 1e-6)[0].backward(dy)
    for a, b in ((xt, xr), (rt, rr), (wt, wr)):
        assert_close(a.grad.cpu(), b.grad, torch.float32)


def test_triton_rms_norm_strided_rows(triton_device):
    """Rows with a stride (a column slice of a wider tensor) are read in place."""
    base = torch.randn(6, 48, generator=case_generator("strided"))
    x = base[:, 5:38].to(triton_device)
    assert_close(rms_norm_triton(x, None, 1e-6).cpu(), rms_norm_reference(base[:, 5:38], None, 1e-6), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("weighted", [True, False])
@pytest.mark.parametrize("shape, strided", [((3, 7), False), ((2, 5, 33), False), ((4, 6, 3, 130), True)])
def test_reference_function_is_the_formula(dtype, weighted, shape, strided):
    """The reference's analytic backward (fp32 / fp64) against autograd through the definition: forward, dx
    and dw on fresh random inputs, strided rows (the model's per-head queries) included."""
    from kernels.rms_norm import rms_norm_formula

    g = case_generator("rms-function", dtype, weighted, shape)
    x = (torch.randn(*shape, generator=g, dtype=torch.float64) * 3).to(dtype)
    if strided:
        x = x.transpose(1, 2)
    w = (1 + 0.5 * torch.randn(x.shape[-1], generator=g, dtype=torch.float64)).to(dtype) if weighted else None
    dy = torch.randn(x.shape, generator=g, dtype=torch.float64).to(dtype)
    xa, xb = x.detach().requires_grad_(), x.detach().requires_grad_()
    wa = w.detach().requires_grad_() if weighted else None
    wb = w.detach().requires_grad_() if weighted else None
    want, got = rms_norm_formula(xa, wa, 1e-6), rms_norm_reference(xb, wb, 1e-6)
    # weighted bf16 runs the formula itself; unweighted bf16 rounds its row sums (and the backward's terms) to
    # bf16 where the formula keeps fp32: within a few bf16 ulps of it
    tol = {torch.float64: dict(rtol=1e-12, atol=1e-12), torch.float32: dict(rtol=1e-5, atol=1e-5),
           torch.bfloat16: dict(rtol=0, atol=0) if weighted else dict(rtol=2e-2, atol=4e-2)}[dtype]
    assert got.dtype == dtype
    torch.testing.assert_close(got, want, **tol)
    want.backward(dy)
    got.backward(dy)
    torch.testing.assert_close(xb.grad, xa.grad, **tol)
    if dtype == torch.bfloat16 and not weighted:  # and as close to the fp64 truth as the formula is
        x64 = x.detach().double().requires_grad_()
        rms_norm_formula(x64, None, 1e-6).backward(dy.double())
        err_formula, err_ref = ((t.double() - x64.grad).abs().max() for t in (xa.grad, xb.grad))
        assert err_ref <= 2 * err_formula + 1e-3
    if weighted:
        torch.testing.assert_close(wb.grad, wa.grad, **(tol if dtype != torch.float32 else dict(rtol=1e-4, atol=1e-4)))
