import pytest
import torch
import torch.nn.functional as F

from kernels import swiglu
from kernels.swiglu import swiglu_reference, swiglu_triton
from tests.kernels.conftest import assert_close, case_generator


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_is_the_models(dtype):
    from trainer.models.deepseek_v4.model import swiglu as model_swiglu

    g = case_generator("model", dtype)
    gate, up = (torch.randn(9, 40, generator=g) * 8).to(dtype), (torch.randn(9, 40, generator=g) * 8).to(dtype)
    assert torch.equal(swiglu(gate, up, 10.0), model_swiglu(gate, up, 10.0))
    assert torch.equal(swiglu(gate, up, 3.0), model_swiglu(gate, up, 3.0))


def test_reference_prob_and_no_limit():
    g = case_generator("prob")
    gate, up, p = torch.randn(4, 6, generator=g), torch.randn(4, 6, generator=g), torch.rand(4, generator=g)
    torch.testing.assert_close(swiglu(gate, up, None, p), F.silu(gate) * up * p[:, None])


def _inputs(shape, dtype, case):
    g = case_generator(*case)
    # scale 4 with limit 1.5..7 puts plenty of entries on both sides of the clamps
    gate = (torch.randn(*shape, generator=g) * 4).to(dtype)
    up = (torch.randn(*shape, generator=g) * 4).to(dtype)
    prob = torch.rand(*shape[:-1], generator=g)  # router weights stay fp32
    dy = torch.randn(*shape, generator=g).to(dtype)
    return gate, up, prob, dy


def _leaf(t, device):
    return t.detach().to(device).clone().requires_grad_()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(5, 33), (2, 3, 130), (3, 1100)])
@pytest.mark.parametrize("limit", [None, 1.5])
@pytest.mark.parametrize("with_prob", [False, True])
def test_triton_matches_reference(triton_device, dtype, shape, limit, with_prob):
    gate, up, prob, dy = _inputs(shape, dtype, ("swiglu", dtype, shape, limit, with_prob))
    gt, ut = _leaf(gate, triton_device), _leaf(up, triton_device)
    gr, ur = _leaf(gate.float(), "cpu"), _leaf(up.float(), "cpu")  # fp32 truth on the same values
    pt = _leaf(prob, triton_device) if with_prob else None
    pr = _leaf(prob, "cpu") if with_prob else None
    y = swiglu_triton(gt, ut, limit, pt)
    ref = swiglu_reference(gr, ur, limit, pr)
    assert y.dtype == dtype and y.shape == gate.shape
    assert_close(y.cpu(), ref, dtype)
    y.backward(dy.to(triton_device))
    ref.backward(dy.float())
    assert_close(gt.grad.cpu(), gr.grad, dtype)
    assert_close(ut.grad.cpu(), ur.grad, dtype)
    if with_prob:
        assert pt.grad.dtype == torch.float32 and pt.grad.shape == prob.shape
        assert_close(pt.grad.cpu(), pr.grad, dtype)


def test_triton_clamp_boundary_gradient(triton_device):
    """At exactly +-limit the clamp passes the gradient (torch's clamp backward is inclusive)."""
    gate = torch.tensor([[2.0, 2.5, -3.0, 1.0]])
    up = torch.tensor([[2.0, -2.0, 2.5, -2.5]])
    gt, ut, gr, ur = _leaf(gate, triton_device), _leaf(up, triton_device), _leaf(gate, "cpu"), _leaf(up, "cpu")
    swiglu_triton(gt, ut, 2.0).sum().backward()
    swiglu_reference(gr, ur, 2.0).sum().backward()
    assert_close(gt.grad.cpu(), gr.grad, torch.float32)
    assert_close(ut.grad.cpu(), ur.grad, torch.float32)
    assert gr.grad[0, 1] == 0 and ur.grad[0, 2] == 0 and ur.grad[0, 0] != 0


def test_triton_halves_of_a_fused_projection(triton_device):
    """``gate``/``up`` as strided views of one ``[N, 2I]`` tensor (fused w13) are read in place."""
    h = torch.randn(6, 2 * 37, generator=case_generator("fused")) * 3
    ht, hr = _leaf(h, triton_device), _leaf(h, "cpu")
    y = swiglu_triton(ht[:, :37], ht[:, 37:], 2.0)
    ref = swiglu_reference(hr[:, :37], hr[:, 37:], 2.0)
    assert_close(y.cpu(), ref, torch.float32)
    dy = torch.randn(6, 37, generator=case_generator("fused-dy"))
    y.backward(dy.to(triton_device))
    ref.backward(dy)
    assert_close(ht.grad.cpu(), hr.grad, torch.float32)
