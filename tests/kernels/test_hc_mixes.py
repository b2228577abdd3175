import pytest
import torch

from kernels import hc_mixes
from kernels.hc_mixes import hc_mixes_commuted, hc_mixes_formula, hc_mixes_reference
from tests.kernels.conftest import case_generator


# (leading shape, N streams, D, M outputs): the model's (2 + N) * N weights, the head's N, odd sizes
CASES = [((2, 5), 2, 8, 8), ((3,), 4, 12, 24), ((1, 7), 3, 5, 3), ((2, 3), 1, 33, 3)]


@pytest.mark.parametrize("impl", [hc_mixes_reference, hc_mixes_commuted])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("lead, n, d, m", CASES)
def test_reference_is_the_formula(impl, dtype, lead, n, d, m):
    """The reference (analytic backward) and what compiled code traces (the row factor applied after the
    product, autograd through it): forward and backward (x and fn) against autograd through the definition, on
    fresh random inputs, under autocast (fp32 regardless); fp64 pins the algebra, fp32 / bf16 the rounding."""
    g = case_generator("hc_mixes", impl.__name__, dtype, lead, n, d, m)
    x = (torch.randn(*lead, n * d, generator=g, dtype=torch.float64) * 3).to(dtype)
    fn = (torch.randn(m, n * d, generator=g, dtype=torch.float64) * 0.3).to(dtype)
    dy = torch.randn(*lead, m, generator=g, dtype=torch.float64)
    xa, fa = x.detach().requires_grad_(), fn.detach().requires_grad_()
    xb, fb = x.detach().requires_grad_(), fn.detach().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want, got = hc_mixes_formula(xa, fa, 1e-6), impl(xb, fb, 1e-6)
    acc = torch.promote_types(dtype, torch.float32)
    assert got.dtype == want.dtype == acc and got.shape == (*lead, m)
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, want, **tol)
    want.backward(dy.to(acc))
    got.backward(dy.to(acc))
    assert xb.grad.dtype == dtype and fb.grad.dtype == dtype
    gtol = tol if dtype != torch.bfloat16 else dict(rtol=1e-2, atol=1e-2)  # both round the fp32 grads to bf16
    torch.testing.assert_close(xb.grad, xa.grad, **gtol)
    torch.testing.assert_close(fb.grad, fa.grad, **gtol)


def test_gradcheck():
    g = case_generator("hc_mixes-gradcheck")
    x = torch.randn(3, 2, 10, generator=g, dtype=torch.float64, requires_grad=True)
    fn = torch.randn(4, 10, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: hc_mixes_reference(a, b, 1e-6), (x, fn))


def test_fp32_under_autocast_and_only_the_grads_asked_for():
    g = case_generator("hc_mixes-autocast")
    x = torch.randn(4, 6, generator=g, requires_grad=True)
    fn = torch.randn(3, 6, generator=g)  # a constant: no gradient is computed for it
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = hc_mixes(x, fn, 1e-6)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, hc_mixes_formula(x, fn, 1e-6), rtol=1e-6, atol=1e-6)
    y.sum().backward()
    assert x.grad is not None and fn.grad is None


def test_the_model_uses_it():
    from trainer.models.deepseek_v4.args import ModelArgs
    from trainer.models.deepseek_v4.model import HyperConnection, HyperHead

    g = case_generator("hc_mixes-model")
    cfg = ModelArgs(hidden_size=8, hc_mult=3, hc_sinkhorn_iters=2)
    hc, head = HyperConnection(cfg), HyperHead(cfg)
    with torch.no_grad():
        hc.fn.copy_(torch.randn(hc.fn.shape, generator=g))
        head.fn.copy_(torch.randn(head.fn.shape, generator=g))
    x = torch.randn(2, 5, 3, 8, generator=g)
    pre_w = hc_mixes_formula(x.reshape(2, 5, -1), hc.fn, cfg.norm_eps)[..., :3]
    pre = torch.sigmoid(pre_w * hc.scale[0] + hc.base[:3]) + cfg.hc_eps
    torch.testing.assert_close(hc(x)[2], (pre.unsqueeze(-1) * x).sum(2), rtol=1e-6, atol=1e-6)
    pre = torch.sigmoid(hc_mixes_formula(x.flatten(2), head.fn, cfg.norm_eps) * head.scale + head.base) + cfg.hc_eps
    torch.testing.assert_close(head(x), (pre.unsqueeze(-1) * x).sum(2), rtol=1e-6, atol=1e-6)


def test_compiled_code_traces_the_definitions():
    """Under torch.compile the Function-based references hand the definition to the compiler (``register(...,
    traced=...)``: inductor fuses it itself; tracing the Functions made the cold compile of the tiny model ~15 %
    longer). As in the trainer, the backends are chosen before compiling."""
    from kernels import hc_expand, resolve_all, rms_norm, sinkhorn

    seen = []

    def backend(gm, _inputs):
        seen.append({str(n.target) for n in gm.graph.nodes})
        return gm

    def f(x, fn, post, comb, y, xs, lg):
        return (hc_mixes(x, fn, 1e-6), hc_expand(post, comb, y, xs), rms_norm(y, None, 1e-6), sinkhorn(lg, 3, 1e-6))

    g = case_generator("hc-compile")
    args = (torch.randn(2, 3, 8, generator=g), torch.randn(4, 8, generator=g), torch.rand(2, 3, 2, generator=g),
            torch.rand(2, 3, 2, 2, generator=g), torch.randn(2, 3, 4, generator=g), torch.randn(2, 3, 2, 4, generator=g),
            torch.randn(2, 3, 2, 2, generator=g))
    args = tuple(t.requires_grad_() for t in args)  # (without inputs that need a gradient a Function is inlined)
    resolve_all("cpu")
    torch._dynamo.reset()
    try:
        out = torch.compile(f, backend=backend, fullgraph=True)(*args)
    finally:
        torch._dynamo.reset()
    assert seen and not any("Function" in t or "autograd" in t for t in seen[0]), seen
    for got, want in zip(out, f(*args)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

