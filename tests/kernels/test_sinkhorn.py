import pytest
import torch

from kernels import sinkhorn, use_backends
from kernels.sinkhorn import sinkhorn_reference, sinkhorn_triton
from tests.kernels.conftest import assert_close, case_generator


@pytest.mark.parametrize("n, iters", [(4, 20), (3, 1)])
def test_reference_is_the_models_hyper_connection(n, iters):
    from trainer.models.deepseek_v4.args import ModelArgs
    from kernels import hc_mixes
    from trainer.models.deepseek_v4.model import HyperConnection

    g = case_generator("hc", n, iters)
    cfg = ModelArgs(hidden_size=8, hc_mult=n, hc_sinkhorn_iters=iters)
    hc = HyperConnection(cfg)
    with torch.no_grad():
        hc.fn.copy_(torch.randn(hc.fn.shape, generator=g) * 0.5)
        hc.base.copy_(torch.randn(hc.base.shape, generator=g))
        hc.scale.copy_(torch.rand(3, generator=g) + 0.5)
    x = torch.randn(2, 3, n, 8, generator=g)
    with use_backends(hc_pre="reference"):  # (the C++ hc_pre runs its own Sinkhorn: tests/kernels/test_hc_pre.py)
        _, comb, _ = hc(x)
    # HyperConnection's pre-softmax comb logits
    mixes = hc_mixes(x.reshape(2, 3, -1), hc.fn, cfg.norm_eps)
    logits = mixes[..., 2 * n:].view(2, 3, n, n) * hc.scale[2] + hc.base[2 * n:].view(n, n)
    assert torch.equal(sinkhorn(logits, iters, cfg.hc_eps), comb)


def test_reference_is_nearly_doubly_stochastic():
    logits = torch.randn(5, 4, 4, generator=case_generator("ds"))
    comb = sinkhorn(logits, 20, 1e-6)
    torch.testing.assert_close(comb.sum(-2), torch.ones(5, 4), atol=1e-5, rtol=0)
    torch.testing.assert_close(comb.sum(-1), torch.ones(5, 4), atol=1e-3, rtol=0)


# (leading shape, N, iters): the model's N=4 with its 20 iterations, a non-power-of-two N, one iteration,
# more matrices than one program holds
CASES = [((2, 3), 4, 20), ((7,), 3, 3), ((1, 5), 5, 1), ((300,), 4, 2)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lead, n, iters", CASES)
def test_triton_matches_reference(triton_device, dtype, lead, n, iters):
    g = case_generator("sinkhorn", dtype, lead, n, iters)
    logits = (torch.randn(*lead, n, n, generator=g) * 2).to(dtype)
    dy = torch.randn(*lead, n, n, generator=g).to(dtype)
    lt = logits.detach().to(triton_device).requires_grad_()
    lr = logits.detach().float().requires_grad_()  # fp32 truth on the same values
    y = sinkhorn_triton(lt, iters, 1e-6)
    ref = sinkhorn_reference(lr, iters, 1e-6)
    assert y.dtype == dtype and y.shape == logits.shape
    assert_close(y.cpu(), ref, dtype)
    y.backward(dy.to(triton_device))
    ref.backward(dy.float())
    assert_close(lt.grad.cpu(), lr.grad, dtype)


def test_triton_gradcheck_fp32(triton_device):
    """The recomputing backward against finite differences (fp32: loose tolerances)."""
    logits = torch.randn(2, 3, 3, generator=case_generator("gradcheck")).to(triton_device).requires_grad_()
    eps = 1e-6
    y = sinkhorn_triton(logits, 4, eps)
    dy = torch.randn(y.shape, generator=case_generator("gradcheck-dy")).to(triton_device)
    (grad,) = torch.autograd.grad(y, logits, dy)
    h = 1e-2
    num = torch.zeros_like(logits)
    with torch.no_grad():
        for idx in range(logits.numel()):
            d = torch.zeros_like(logits).view(-1)
            d[idx] = h
            d = d.view_as(logits)
            diff = sinkhorn_triton(logits + d, 4, eps) - sinkhorn_triton(logits - d, 4, eps)
            num.view(-1)[idx] = (diff * dy).sum() / (2 * h)
    torch.testing.assert_close(grad.cpu(), num.cpu(), atol=2e-3, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("lead, n, iters", CASES)
def test_reference_is_the_formula(dtype, lead, n, iters):
    """The reference (matrices innermost) against the definition on the model's layout: forward and backward
    on fresh random inputs, to rounding (sums of N terms may add in another order)."""
    from kernels.sinkhorn import sinkhorn_formula

    g = case_generator("sinkhorn-formula", dtype, lead, n, iters)
    logits = (torch.randn(*lead, n, n, generator=g, dtype=torch.float64) * 2).to(dtype)
    dy = torch.randn(*lead, n, n, generator=g, dtype=torch.float64).to(dtype)
    la, lb = logits.detach().requires_grad_(), logits.detach().requires_grad_()
    want, got = sinkhorn_formula(la, iters, 1e-6), sinkhorn_reference(lb, iters, 1e-6)
    assert got.dtype == dtype and got.shape == logits.shape and got.is_contiguous()
    tol = {torch.float64: dict(rtol=1e-12, atol=1e-12), torch.float32: dict(rtol=1e-6, atol=1e-6),
           torch.bfloat16: dict(rtol=1e-2, atol=1e-2)}[dtype]
    torch.testing.assert_close(got, want, **tol)
    want.backward(dy)
    got.backward(dy)
    torch.testing.assert_close(lb.grad, la.grad, **(tol if dtype != torch.float32 else dict(rtol=1e-5, atol=1e-5)))
