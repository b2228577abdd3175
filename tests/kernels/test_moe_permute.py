import pytest
import torch

from kernels import get, registry
from kernels.moe_permute import (inverse_order, permute, permute_npu, permute_reference, permute_triton,
                                 unpermute, unpermute_reference, unpermute_triton)
from tests.kernels.conftest import assert_close, case_generator


def _indices(n, k, e, g, empty=()):
    """Distinct experts per token (as top-k gives), never choosing the experts in ``empty``."""
    allowed = torch.tensor([i for i in range(e) if i not in empty])
    return torch.stack([allowed[torch.randperm(len(allowed), generator=g)[:k]] for _ in range(n)])


def _leaf(t, device):
    return t.detach().to(device).clone().requires_grad_()


def _explicit(y_sorted, order, w, n):
    """``unpermute`` spelled out token by token."""
    k = w.shape[1]
    out = torch.zeros(n, y_sorted.shape[1], dtype=torch.float64)
    for m, i in enumerate(order.tolist()):
        out[i // k] += w.reshape(-1)[i].double() * y_sorted[m].double()
    return out


@pytest.mark.parametrize("n,k,e,empty", [(13, 2, 5, (0, 4)), (1, 1, 3, (1, 2)), (31, 4, 9, (2, 7, 8)), (8, 3, 3, ())])
def test_reference_permute_unpermute(n, k, e, empty):
    g = case_generator("ref", n, k, e)
    x = torch.randn(n, 7, generator=g, dtype=torch.float64)
    idx = _indices(n, k, e, g, empty)
    w = torch.rand(n, k, generator=g, dtype=torch.float64)
    with registry.poison_outputs():
        xs, counts, order = permute(x, idx, e)
        y = unpermute(xs * 2, order, w, n)
    assert counts.tolist() == [int((idx == i).sum()) for i in range(e)] and counts.shape == (e,)
    assert torch.equal(order, torch.argsort(idx.reshape(-1), stable=True))
    assert torch.equal(xs, x[order // k])
    flat = idx.reshape(-1)[order]
    assert (flat[1:] >= flat[:-1]).all()  # grouped by expert, in order
    torch.testing.assert_close(y, _explicit(xs * 2, order, w, n))
    assert torch.equal(inverse_order(order)[order], torch.arange(n * k))


def test_trailing_empty_experts_need_n_experts():
    idx = torch.tensor([[0, 1], [1, 0]])
    assert permute(torch.zeros(2, 3), idx, 5)[1].tolist() == [2, 2, 0, 0, 0]
    assert permute(torch.zeros(2, 3), idx)[1].tolist() == [2, 2]


def test_reference_gradients_fp64():
    g = case_generator("grad")
    n, k, e = 6, 2, 4
    idx = _indices(n, k, e, g, (3,))
    x = torch.randn(n, 5, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.rand(n, k, generator=g, dtype=torch.float64, requires_grad=True)

    def f(x, w):
        xs, _, order = permute_reference(x, idx, e)
        return unpermute_reference(xs.sin(), order, w, n)

    torch.autograd.gradcheck(f, (x, w))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k,e,d,empty", [(9, 2, 5, 33, (1,)), (4, 3, 6, 300, (0, 5)), (1, 1, 2, 5, (0,))])
def test_triton_matches_reference(triton_device, dtype, n, k, e, d, empty):
    g = case_generator("triton", dtype, n, k, e, d)
    x = torch.randn(n, d, generator=g).to(dtype)
    idx = _indices(n, k, e, g, empty)
    w = torch.rand(n, k, generator=g)  # router weights stay fp32
    dy = torch.randn(n, d, generator=g).to(dtype)
    xt, wt = _leaf(x, triton_device), _leaf(w, triton_device)
    xr, wr = _leaf(x.double(), "cpu"), _leaf(w.double(), "cpu")  # fp64 truth on the same values
    xs_t, counts_t, order_t = permute_triton(xt, idx.to(triton_device), e, block_d=32)
    y_t = unpermute_triton(xs_t * 1.5, order_t, wt, n, block_d=32)
    xs_r, counts_r, order_r = permute_reference(xr, idx, e)
    y_r = unpermute_reference(xs_r * 1.5, order_r, wr, n)
    assert torch.equal(counts_t.cpu(), counts_r) and torch.equal(order_t.cpu(), order_r)
    assert y_t.dtype == dtype and wt.dtype == torch.float32
    assert_close(xs_t.cpu(), xs_r, dtype)
    assert_close(y_t.cpu(), y_r, dtype)
    y_t.backward(dy.to(triton_device))
    y_r.backward(dy.double())
    assert_close(xt.grad.cpu(), xr.grad, dtype)
    assert_close(wt.grad.cpu(), wr.grad, dtype)


def test_triton_falls_back_for_fp64():
    x = torch.randn(3, 4, dtype=torch.float64)
    idx = torch.tensor([[0], [2], [0]])
    xs, counts, order = permute_triton(x, idx, 3)  # no kernel launch: fp64 is not a Triton dtype here
    assert torch.equal(xs, x[order]) and counts.tolist() == [2, 0, 1]


def test_registry_picks_reference_on_cpu():
    assert get("moe_permute", "cpu") is permute_reference
    assert get("moe_unpermute", "cpu") is unpermute_reference
    assert callable(permute_npu)  # torch_npu backend registered; untested here (no NPU)
