import pytest
import torch

from kernels import backends, get, rms_norm


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


def test_registry_falls_back_to_reference(monkeypatch):
    assert "reference" in backends("rms_norm")
    assert get("rms_norm", "cuda") is get("rms_norm", "cpu")
    monkeypatch.setenv("TREX_KERNEL_BACKEND", "triton")
    with pytest.raises(KeyError, match="no available 'triton' backend"):
        get("rms_norm", "cpu")
    with pytest.raises(KeyError, match="no kernel registered"):
        get("nope")
