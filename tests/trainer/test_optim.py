"""``trainer.optim``: AdamW runs fused only where every parameter is on one device type, CUDA or CPU, plain or on
one mesh; the fused CPU step equals the foreach one; gradient clipping is torch's."""

import math
from types import SimpleNamespace

import pytest
import torch

from trainer.optim import adamw_fused, clear_deferred_clip, clip_grad_norm_, step_optimizers


def test_adamw_is_fused_only_for_plain_parameters_on_one_device_type():
    cuda, cpu = SimpleNamespace(device=torch.device("cuda", 0)), torch.nn.Parameter(torch.zeros(2))
    npu = SimpleNamespace(device=torch.device("meta"))  # any other device type keeps foreach
    assert adamw_fused([cuda, cuda])
    assert adamw_fused([cpu, cpu])
    assert not adamw_fused([cuda, cpu])  # mixed devices: one fused group would refuse them
    assert not adamw_fused([npu])
    assert not adamw_fused([])


def test_fused_cpu_adamw_matches_foreach():
    torch.manual_seed(0)
    shapes = [(17, 5), (3, 4, 9), (11,)]
    params = {k: [torch.nn.Parameter(torch.randn(s)) for s in shapes] for k in ("fused", "foreach")}
    for a, b in zip(*params.values()):
        b.data.copy_(a.data)
    opts = {k: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=k == "fused" or None,
                                 foreach=k == "foreach" or None) for k, ps in params.items()}
    for _ in range(5):
        grads = [torch.randn(s) for s in shapes]
        for k, ps in params.items():
            for p, g in zip(ps, grads):
                p.grad = g.clone()
            opts[k].step()
    for a, b in zip(*params.values()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_sharded_parameters_are_fused_only_on_one_mesh(monkeypatch):
    import torch.distributed.tensor as dt

    class FakeDTensor(SimpleNamespace):
        pass

    monkeypatch.setattr(dt, "DTensor", FakeDTensor)
    dev = torch.device("cuda", 0)
    assert adamw_fused([FakeDTensor(device=dev, device_mesh="dp"), FakeDTensor(device=dev, device_mesh="dp")])
    # expert / tensor parallel layouts: parameters on several meshes keep foreach
    assert not adamw_fused([FakeDTensor(device=dev, device_mesh="dp"), FakeDTensor(device=dev, device_mesh="ep")])
    assert not adamw_fused([FakeDTensor(device=dev, device_mesh="dp"), SimpleNamespace(device=dev)])


@pytest.mark.parametrize("scale", [1e-3, 0.5, 3.0, float("inf"), float("nan")])
def test_clip_grad_norm_is_torchs_norm_and_clipping(scale):
    """The same norm and the same gradients as ``torch.nn.utils.clip_grad_norm_``, bit for bit, below the threshold
    (no multiply), above it, and for non-finite norms; parameters without a gradient are left alone."""
    g = torch.Generator().manual_seed(0)
    shapes = [(7, 5), (3,), (4, 4, 2)]
    grads = [torch.randn(s, generator=g) * scale / 4 for s in shapes]
    ours, theirs = ([torch.nn.Parameter(torch.zeros(s)) for s in shapes] + [torch.nn.Parameter(torch.zeros(2))]
                    for _ in range(2))
    for a, b, gr in zip(ours, theirs, grads):
        a.grad, b.grad = gr.clone(), gr.clone()
    norm = clip_grad_norm_(ours, 1.0)
    want = float(torch.nn.utils.clip_grad_norm_(theirs, 1.0))
    assert norm == want or (math.isnan(norm) and math.isnan(want))
    for a, b in zip(ours[:3], theirs[:3]):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0, equal_nan=True)
    assert ours[3].grad is None
    if norm < 0.5:
        assert all(torch.equal(a.grad, gr) for a, gr in zip(ours, grads))  # untouched


def _params_and_grads(scale: float, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(7, 5), (3,), (4, 4, 2), (33,)]
    params = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]
    grads = [torch.randn(s, generator=g) * scale for s in shapes]
    return params, grads


def _clone(params, grads):
    ps = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for p, gr in zip(ps, grads):
        p.grad = gr.clone()
    return ps


@pytest.mark.parametrize("scale", [0.02, 3.0])
def test_clipping_left_to_the_fused_adamw_step_updates_as_clipping_first(scale):
    """Above the threshold a fused AdamW applies the clipping factor as it reads the gradients: the same update
    (to a rounding) as multiplying the gradients first, the clipped gradients written back, the factor cleared;
    the optimizer state the same. Below it nothing is deferred (and nothing multiplied)."""
    params, grads = _params_and_grads(scale)
    ours, theirs = _clone(params, grads), _clone(params, grads)
    opt_ours = torch.optim.AdamW(ours, lr=1e-2, weight_decay=0.1, fused=True)
    opt_theirs = torch.optim.AdamW(theirs, lr=1e-2, weight_decay=0.1, fused=True)
    for it in range(3):
        norm = clip_grad_norm_(ours, 1.0, [opt_ours])
        want = float(torch.nn.utils.clip_grad_norm_(theirs, 1.0))
        assert norm == want
        deferred = getattr(opt_ours, "grad_scale", None) is not None
        assert deferred == (want > 1.0)
        if deferred:  # nothing multiplied yet
            assert all(torch.equal(p.grad, g) for p, g in zip(ours, grads if it == 0 else new))
        step_optimizers([opt_ours])
        opt_theirs.step()
        assert getattr(opt_ours, "grad_scale", None) is None
        for a, b in zip(ours, theirs):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=0)  # the clipped gradient, written back
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
            for key in ("exp_avg", "exp_avg_sq", "step"):
                torch.testing.assert_close(opt_ours.state[a][key], opt_theirs.state[b][key], rtol=1e-5, atol=0)
        new = [torch.randn(p.shape) * scale for p in ours]
        for a, b, g in zip(ours, theirs, new):
            a.grad, b.grad = g.clone(), g.clone()


def test_clipping_is_applied_to_the_gradients_where_the_step_cannot_take_it():
    """Multiplied now, bit for bit as torch: a foreach AdamW, a fused one that does not hold every parameter,
    a non-finite norm; no factor is left on the optimizer. ``clear_deferred_clip`` forgets a deferred one."""
    params, grads = _params_and_grads(3.0)
    want = _clone(params, grads)
    torch.nn.utils.clip_grad_norm_(want, 1.0)
    for make in (lambda ps: [torch.optim.AdamW(ps, lr=1e-2, foreach=True)],
                 lambda ps: [torch.optim.AdamW(ps[:-1], lr=1e-2, fused=True)]):
        ps = _clone(params, grads)
        opts = make(ps)
        clip_grad_norm_(ps, 1.0, opts)
        assert all(getattr(o, "grad_scale", None) is None for o in opts)
        for a, b in zip(ps, want):
            torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)
    ps = _clone(params, [g * float("inf") for g in grads])
    opt = torch.optim.AdamW(ps, lr=1e-2, fused=True)
    assert math.isinf(clip_grad_norm_(ps, 1.0, [opt])) or math.isnan(clip_grad_norm_(ps, 1.0, [opt]))
    assert getattr(opt, "grad_scale", None) is None
    ps = _clone(params, grads)
    opt = torch.optim.AdamW(ps, lr=1e-2, fused=True)
    clip_grad_norm_(ps, 1.0, [opt])
    assert opt.grad_scale is not None
    clear_deferred_clip(opt)
    assert opt.grad_scale is None
