import pytest
import torch

from kernels import hc_expand
from kernels.hc_expand import hc_expand_formula, hc_expand_reference
from tests.kernels.conftest import case_generator


# (leading shape, N streams, D): the tiny model's N=2, V4's N=4, one stream, odd sizes
CASES = [((2, 5), 2, 8), ((3,), 4, 12), ((1, 7), 3, 5), ((2, 3), 1, 33)]


def _inputs(g, lead, n, d, dtype, y_dtype=None):
    post = torch.rand(*lead, n, generator=g, dtype=torch.float64) * 2
    comb = torch.rand(*lead, n, n, generator=g, dtype=torch.float64)
    y = torch.randn(*lead, d, generator=g, dtype=torch.float64).to(y_dtype or dtype)
    x = torch.randn(*lead, n, d, generator=g, dtype=torch.float64).to(dtype)
    return post.float() if dtype != torch.float64 else post, comb.float() if dtype != torch.float64 else comb, y, x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("lead, n, d", CASES)
def test_reference_is_the_formula(dtype, lead, n, d):
    """Forward and all four gradients against autograd through the definition, on fresh random inputs
    (fp32 ``post`` / ``comb`` as the model's, streams and block output in ``dtype``)."""
    g = case_generator("hc_expand", dtype, lead, n, d)
    ins = _inputs(g, lead, n, d, dtype)
    dy = torch.randn(*lead, n, d, generator=g, dtype=torch.float64).to(dtype)
    a = [t.detach().requires_grad_() for t in ins]
    b = [t.detach().requires_grad_() for t in ins]
    want, got = hc_expand_formula(*a), hc_expand_reference(*b)
    assert got.dtype == want.dtype == dtype and got.shape == (*lead, n, d)
    tol = {torch.float64: dict(rtol=1e-12, atol=1e-12), torch.float32: dict(rtol=1e-5, atol=1e-5),
           torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}[dtype]
    torch.testing.assert_close(got, want, **tol)
    want.backward(dy)
    got.backward(dy)
    for ta, tb in zip(a, b):
        assert tb.grad.dtype == tb.dtype
        torch.testing.assert_close(tb.grad, ta.grad, **tol)


def test_gradcheck():
    g = case_generator("hc_expand-gradcheck")
    ins = [t.requires_grad_() for t in _inputs(g, (2, 3), 3, 4, torch.float64)]
    assert torch.autograd.gradcheck(hc_expand_reference, tuple(ins))


def test_streams_stay_fp32_under_autocast():
    """A bf16 block output (autocast) joins fp32 streams without rounding them to bf16; a constant input gets
    no gradient."""
    g = case_generator("hc_expand-autocast")
    post, comb, y, x = _inputs(g, (2, 4), 2, 16, torch.float32, y_dtype=torch.bfloat16)
    x.requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = hc_expand(post, comb, y, x)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, hc_expand_formula(post, comb, y, x), rtol=1e-6, atol=1e-6)
    out.sum().backward()
    assert x.grad is not None and x.grad.dtype == torch.float32


def test_the_model_uses_both_mhc_ops():
    from kernels import registry
    from tests.trainer.helpers import tiny_model

    model = tiny_model(seed=1, num_layers=1, layer_types=["sliding_attention"], mlp_layer_types=["moe"])
    registry.clear_choices()
    model(torch.randint(0, 64, (1, 8))).float().sum().backward()
    assert {"hc_pre/cpu", "hc_expand/cpu"} <= set(registry.choices()), registry.choices()
    registry.clear_choices()
    with registry.use_backends(hc_pre="reference"):  # the reference hc_pre composes hc_mixes and sinkhorn
        model(torch.randint(0, 64, (1, 8))).float().sum().backward()
    assert {"hc_pre/cpu", "hc_mixes/cpu", "sinkhorn/cpu", "hc_expand/cpu"} <= set(registry.choices())


def test_outputs_are_not_views():
    """Zero-bubble pipelining detaches stage outputs in place, which a view forbids."""
    from kernels.hc_mixes import hc_mixes_reference

    g = case_generator("hc-not-views")
    post, comb, y, x = _inputs(g, (2, 3), 2, 4, torch.float32)
    assert hc_expand_reference(post, comb, y, x.requires_grad_())._base is None
    assert hc_mixes_reference(x.reshape(2, 3, 8), torch.randn(4, 8, generator=g), 1e-6)._base is None


def test_stream_gradients_are_base_tensors_that_autograd_accumulates_in_place():
    """The streams feed ``hc_mixes``, the collapse and ``hc_expand``: autograd sums their gradients, in place
    into the first one only if that is a base tensor (a view costs a fresh stream-sized sum per mixing)."""
    from kernels.hc_mixes import hc_mixes_reference

    g = case_generator("hc-grad-bases")
    post, comb, y, x = _inputs(g, (2, 3), 2, 4, torch.float32)
    x.requires_grad_()
    out = hc_expand_reference(post.requires_grad_(), comb.requires_grad_(), y.requires_grad_(), x)
    mixes = hc_mixes_reference(x.reshape(2, 3, 8), torch.randn(4, 8, generator=g).requires_grad_(), 1e-6)
    with torch.no_grad():  # (as the engine runs a backward)
        dx = out.grad_fn.apply(torch.randn(out.shape, generator=g))[3]
        assert dx._base is None and dx.is_contiguous()
        dx = mixes.grad_fn.apply(torch.randn(mixes.shape, generator=g))[0]
    assert dx._base is None and dx.shape == (2, 3, 8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lead, n, d", CASES + [((2,), 4, 300)])
def test_triton_matches_reference(triton_device, dtype, lead, n, d):
    """Forward and the four gradients against the reference computed in fp32 on the same values (fp32
    ``post`` / ``comb`` as the model's), outputs poisoned; ``D = 300`` spans several chunks."""
    from kernels.hc_expand import hc_expand_triton
    from tests.kernels.conftest import assert_close

    g = case_generator("hc_expand-triton", dtype, lead, n, d)
    ins = _inputs(g, lead, n, d, dtype)
    dy = torch.randn(*lead, n, d, generator=g).to(dtype)
    ref = [t.detach().float().requires_grad_() for t in ins]
    tri = [t.detach().to(triton_device).requires_grad_() for t in ins]
    want, got = hc_expand_reference(*ref), hc_expand_triton(*tri)
    assert got.dtype == dtype and got.shape == (*lead, n, d) and got._base is None
    assert_close(got.cpu(), want, dtype)
    want.backward(dy.float())
    got.backward(dy.to(triton_device))
    for tr, rr in zip(tri, ref):
        assert tr.grad.dtype == tr.dtype and tr.grad.shape == tr.shape and tr.grad._base is None
        assert_close(tr.grad.cpu(), rr.grad, dtype)
