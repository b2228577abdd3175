"""ShardedMuon: torch.optim.Muon's update, also for stacked expert weights (one matrix per expert)."""

import pytest
import torch

from trainer.muon import ShardedMuon, newton_schulz


@pytest.mark.parametrize("shape", [(8, 5), (5, 8), (16, 16), (1, 7)])
def test_plain_matrices_equal_torch_muon_bit_for_bit(shape):
    g = torch.Generator().manual_seed(hash(shape) % 1000)
    w0 = torch.randn(shape, generator=g)
    a, b = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(w0.clone())
    oa = torch.optim.Muon([a], lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    ob = ShardedMuon([b], lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    for _ in range(3):
        grad = torch.randn(shape, generator=g)
        a.grad, b.grad = grad.clone(), grad.clone()
        oa.step()
        ob.step()
    assert torch.equal(a, b)


def test_stacked_experts_are_orthogonalised_one_by_one():
    g = torch.Generator().manual_seed(0)
    w0 = torch.randn(3, 6, 4, generator=g)
    stacked = torch.nn.Parameter(w0.clone())
    singles = [torch.nn.Parameter(w0[e].clone()) for e in range(3)]
    o1 = ShardedMuon([stacked], lr=0.01, ns_dtype=torch.float32)
    o2 = ShardedMuon(singles, lr=0.01, ns_dtype=torch.float32)
    grad = torch.randn(3, 6, 4, generator=g)
    grad[1] = 0.0  # an expert that got no tokens
    stacked.grad = grad.clone()
    for e in range(3):
        singles[e].grad = grad[e].clone()
    o1.step()
    o2.step()
    for e in range(3):
        torch.testing.assert_close(stacked[e], singles[e], rtol=0, atol=1e-6)


def test_newton_schulz_fp32_approximately_orthogonalises():
    x = newton_schulz(torch.randn(32, 16), (3.4445, -4.7750, 2.0315), 10, 1e-7, torch.float32)
    s = torch.linalg.svdvals(x)
    assert s.min() > 0.5 and s.max() < 1.5  # the quintic's band around 1 (not exact U V^T by design)


def test_rejects_vectors():
    with pytest.raises(ValueError, match="2-D"):
        ShardedMuon([torch.nn.Parameter(torch.zeros(4))])
