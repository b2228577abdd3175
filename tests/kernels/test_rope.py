import pytest
import torch

from kernels import apply_rope
from kernels.rope import apply_rope_reference, apply_rope_triton, rope_formula, rope_traced
from tests.kernels.conftest import assert_close, case_generator


def _angles(b, t, f, dtype, g):
    ang = torch.rand(b, t, f, generator=g, dtype=torch.float64) * 20 - 10
    return ang.cos().to(dtype), ang.sin().to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_is_the_models(dtype):
    from trainer.models.deepseek_v4.layers import apply_rope as model_apply_rope

    g = case_generator("model", dtype)
    x = torch.randn(2, 3, 5, 12, generator=g).to(dtype)
    cos, sin = _angles(2, 5, 4, dtype, g)
    assert torch.equal(apply_rope(x, cos, sin), model_apply_rope(x, cos, sin))
    assert torch.equal(apply_rope(x, cos, -sin), model_apply_rope(x, cos, -sin))
    assert torch.equal(apply_rope(x[:, :1], cos, sin), model_apply_rope(x[:, :1], cos, sin))


def test_reference_inverse_rotation():
    g = case_generator("inverse")
    x = torch.randn(1, 2, 3, 8, generator=g, dtype=torch.float64)
    cos, sin = _angles(1, 3, 3, torch.float64, g)
    torch.testing.assert_close(apply_rope(apply_rope(x, cos, sin), cos, -sin), x)


PAIR_CASES = [(impl, shape) for impl in ("reference", "traced")
              for shape in [(2, 3, 5, 33, 8), (1, 2, 7, 16, 8), (2, 1, 9, 130, 32)]] + [("traced-compiled", (2, 3, 5, 33, 8))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("impl,shape", PAIR_CASES)
def test_the_pairwise_reference_is_the_formula(dtype, shape, impl):
    """With constant angles the reference writes the pairs into one tensor (an autograd Function), and compiled
    code traces an autograd Function that rotates the gradient back (``rope_traced``): forward bit for bit the
    formula's, the gradient too in fp32 (in bf16 the formula rounds two partial gradients to bf16 before summing
    them; the Functions round once)."""
    fn = {"reference": apply_rope_reference, "traced": rope_traced,
          "traced-compiled": torch.compile(rope_traced, dynamic=False, fullgraph=True)}[impl]
    b, h, t, c, f = shape
    g = case_generator("pairs", dtype, shape)
    x = torch.randn(b, t, h, c, generator=g).to(dtype).transpose(1, 2)  # [B, H, T, C] strided, as q is
    cos, sin = _angles(b, t, f, dtype, g)
    dy = torch.randn(b, h, t, c, generator=g).to(dtype)
    xf, xp = x.detach().requires_grad_(), x.detach().requires_grad_()
    want, got = rope_formula(xf, cos, sin), fn(xp, cos, sin)
    assert got.dtype == dtype and got.is_contiguous()
    assert torch.equal(got, want)
    assert torch.equal(fn(x, cos, -sin), rope_formula(x, cos, -sin))
    want.backward(dy)
    got.backward(dy)
    if dtype == torch.float32:
        assert torch.equal(xp.grad, xf.grad)
    else:
        assert_close(xp.grad, xf.grad, dtype)


def test_angles_that_need_a_gradient_get_one():
    g = case_generator("angle-grad")
    x = torch.randn(1, 2, 3, 8, generator=g, dtype=torch.float64)
    ang = (torch.rand(1, 3, 2, generator=g, dtype=torch.float64) * 6).requires_grad_()
    apply_rope_reference(x, ang.cos(), ang.sin()).sum().backward()
    assert ang.grad is not None and ang.grad.abs().sum() > 0


# (B, H, T, C, F): odd channel counts, nothing to pass through, the model's [B, 1, T, C] key layout
SHAPES = [(2, 3, 5, 33, 8), (1, 2, 7, 16, 8), (2, 1, 9, 130, 32)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_triton_matches_reference(triton_device, dtype, shape):
    b, h, t, c, f = shape
    g = case_generator("rope", dtype, shape)
    x = torch.randn(b, t, h, c, generator=g).to(dtype).transpose(1, 2)  # [B, H, T, C] strided, as q is
    cos, sin = _angles(b, t, f, dtype, g)
    dy = torch.randn(b, h, t, c, generator=g).to(dtype)
    xt = x.detach().to(triton_device).requires_grad_()
    xr = x.detach().float().requires_grad_()
    y = apply_rope_triton(xt, cos.to(triton_device), sin.to(triton_device))
    ref = apply_rope_reference(xr, cos, sin)  # fp32 truth on the same values (cos/sin promote either way)
    assert y.dtype == dtype and y.shape == x.shape
    assert_close(y.cpu(), ref, dtype)
    assert torch.equal(y[..., :c - 2 * f].cpu(), x[..., :c - 2 * f])  # pass-through channels are copied exactly
    y.backward(dy.to(triton_device))
    ref.backward(dy.float())
    assert_close(xt.grad.cpu(), xr.grad, dtype)


def test_triton_broadcast_batch_and_negated_sin(triton_device):
    g = case_generator("rope-bcast")
    x = torch.randn(3, 2, 4, 10, generator=g)
    cos, sin = _angles(1, 4, 3, torch.float32, g)  # one position table for the whole batch
    y = apply_rope_triton(x.to(triton_device), cos.to(triton_device), -sin.to(triton_device))
    assert_close(y.cpu(), apply_rope_reference(x, cos, -sin), torch.float32)


def test_triton_falls_back_when_angles_need_grad(triton_device):
    g = case_generator("rope-grad")
    x = torch.randn(1, 1, 3, 4, generator=g)
    cos, sin = _angles(1, 3, 2, torch.float32, g)
    cos = cos.to(triton_device).requires_grad_()
    y = apply_rope_triton(x.to(triton_device), cos, sin.to(triton_device))
    y.sum().backward()
    assert cos.grad is not None
