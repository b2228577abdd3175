"""``trainer.parallel.grads.clip_grad_norm`` in one process: the global norm in float64 and torch's clipping rule."""

from __future__ import annotations

import math

import pytest
import torch

from trainer.optim import step_optimizers
from trainer.parallel.grads import clip_grad_norm


def _params(scale: float) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    shapes = [(7, 5), (3,), (2, 3, 4), (1,)]
    params = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * scale
    params.append(torch.nn.Parameter(torch.zeros(2)))  # no gradient: skipped
    return params


@pytest.mark.parametrize("scale", [0.01, 10.0])
def test_the_norm_is_float64_and_clipping_is_torchs(scale):
    mine, ref = _params(scale), _params(scale)
    want = math.sqrt(sum(float((p.grad.double() ** 2).sum()) for p in mine if p.grad is not None))
    norm = clip_grad_norm(mine, max_norm=1.0)
    ref_norm = torch.nn.utils.clip_grad_norm_([p for p in ref if p.grad is not None], 1.0)
    assert norm == pytest.approx(want, rel=1e-12)
    assert norm == pytest.approx(float(ref_norm), rel=1e-5)
    for a, b in zip(mine, ref):
        if a.grad is None:
            assert b.grad is None
            continue
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=0)
    if scale < 1:  # below the bound nothing is touched
        assert all(torch.equal(a.grad, b.grad) for a, b in zip(mine, _params(scale)) if a.grad is not None)


def test_a_non_finite_norm_leaves_the_gradients_alone():
    params = _params(1.0)
    params[0].grad[0, 0] = float("inf")
    before = [p.grad.clone() for p in params if p.grad is not None]
    assert math.isinf(clip_grad_norm(params, 1.0))
    assert all(torch.equal(a, p.grad) for a, p in zip(before, [p for p in params if p.grad is not None]))


def test_clipping_is_left_to_a_fused_adamw_holding_every_parameter():
    """Above the bound the factor goes to the optimizer's next step (gradients untouched until then); the update
    and the clipped gradients equal clipping first (to a rounding). A foreach AdamW gets multiplied gradients."""
    mine, ref = _params(10.0), _params(10.0)
    opt = torch.optim.AdamW(mine, lr=1e-2, fused=True)
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, fused=True)
    before = [p.grad.clone() for p in mine if p.grad is not None]
    clip_grad_norm(mine, 1.0, optimizers=[opt])
    assert opt.grad_scale is not None
    assert all(torch.equal(a, p.grad) for a, p in zip(before, [p for p in mine if p.grad is not None]))
    step_optimizers([opt])
    clip_grad_norm(ref, 1.0)
    ref_opt.step()
    assert getattr(opt, "grad_scale", None) is None
    for a, b in zip(mine, ref):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        if a.grad is not None:
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=0)
            torch.testing.assert_close(opt.state[a]["exp_avg"], ref_opt.state[b]["exp_avg"], rtol=1e-6, atol=0)
    foreach = _params(10.0)
    opt = torch.optim.AdamW(foreach, lr=1e-2, foreach=True)
    clip_grad_norm(foreach, 1.0, optimizers=[opt])
    assert getattr(opt, "grad_scale", None) is None
    for a, b in zip(foreach, ref):
        if a.grad is not None:
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=0)
