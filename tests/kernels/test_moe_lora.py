"""moe_experts_lora against the merged-weight reference: forward and backward on fresh random odd shapes, a
callable (dequantised-on-demand) base, missing projections, autocast, bad adapters."""

import pytest
import torch

from kernels.moe_lora import merged_expert_weights, moe_experts_lora, moe_experts_lora_reference


def _case(seed, n=37, d=13, i=11, e=5, k=2, r=3, projections=("gate", "up", "down")):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g, requires_grad=True)
    idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n)])
    idx[0] = torch.tensor([e - 1] * k) if k == 1 else idx[0]
    w = torch.rand(n, k, generator=g, requires_grad=True)
    base = (torch.randn(e, d, i, generator=g) / d ** .5, torch.randn(e, d, i, generator=g) / d ** .5,
            torch.randn(e, i, d, generator=g) / i ** .5)
    shapes = {"gate": (d, i), "up": (d, i), "down": (i, d)}
    lora = {p: (torch.randn(e, shapes[p][0], r, generator=g).requires_grad_(),
                torch.randn(e, r, shapes[p][1], generator=g).requires_grad_()) for p in projections}
    return x, idx, w, base, lora


def _grads(out, tensors):
    out.backward(torch.ones_like(out) * torch.linspace(-1, 1, out.numel()).view_as(out))
    got = [t.grad.clone() for t in tensors]
    for t in tensors:
        t.grad = None
    return got


@pytest.mark.parametrize("seed,projections", [(0, ("gate", "up", "down")), (1, ("gate", "down")), (2, ("up",))])
def test_forward_backward_match_the_merged_reference(seed, projections):
    x, idx, w, base, lora = _case(seed, projections=projections)
    leaves = [x, w, *[t for ab in lora.values() for t in ab]]
    got = moe_experts_lora(x, idx, w, base, lora, 0.7, 2.5)
    g_got = _grads(got, leaves)
    want = moe_experts_lora_reference(x, idx, w, base, lora, 0.7, 2.5)
    g_want = _grads(want, leaves)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    # every adapted expert that got tokens gets a gradient in both factors
    used = torch.unique(idx)
    for a, b in lora.values():
        assert (a.grad is None) and (b.grad is None)
    assert all(g[used].abs().sum() > 0 for g in g_got[2:])


def test_a_callable_base_is_produced_again_for_the_backward_and_equals_the_tensor_base():
    x, idx, w, base, lora = _case(3)
    calls = []

    def on_demand(t):
        def fn():
            calls.append(1)
            return t.clone()  # a fresh dense copy each time, as a dequantisation makes
        return fn

    leaves = [x, *[t for ab in lora.values() for t in ab]]
    got = moe_experts_lora(x, idx, w, tuple(on_demand(t) for t in base), lora, 0.5, 10.0)
    assert len(calls) == 3
    g_got = _grads(got, leaves)
    assert len(calls) == 6  # each projection's weight made again for dx
    want = moe_experts_lora(x, idx, w, base, lora, 0.5, 10.0)
    g_want = _grads(want, leaves)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_zero_b_is_the_base_and_merge_adds_the_product():
    x, idx, w, base, lora = _case(4)
    zero = {p: (a, torch.zeros_like(b)) for p, (a, b) in lora.items()}
    from kernels.grouped_gemm import moe_experts_loop
    torch.testing.assert_close(moe_experts_lora(x, idx, w, base, zero, 2.0, 3.0),
                               moe_experts_loop(x, idx, w, *base, 3.0), rtol=1e-5, atol=1e-6)
    merged = merged_expert_weights(base, lora, 0.25)
    a, b = lora["down"]
    torch.testing.assert_close(merged[2][1], base[2][1] + 0.25 * a[1] @ b[1], rtol=1e-5, atol=1e-6)


def test_autocast_runs_in_bf16():
    x, idx, w, base, lora = _case(5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = moe_experts_lora(x, idx, w, base, lora, 0.5, 3.0)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), moe_experts_lora_reference(x, idx, w, base, lora, 0.5, 3.0),
                               rtol=0.05, atol=0.15)


def test_a_bad_adapter_names_its_projection():
    x, idx, w, base, lora = _case(6)
    a, b = lora["up"]
    with pytest.raises(ValueError, match="up adapter"):
        moe_experts_lora(x, idx, w, base, {"up": (a, b[:, :2])}, 1.0, 3.0)
    with pytest.raises(ValueError, match="unknown projections"):
        moe_experts_lora(x, idx, w, base, {"w1": (a, b)}, 1.0, 3.0)
