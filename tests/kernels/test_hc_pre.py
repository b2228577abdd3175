import pytest
import torch

from kernels import cpp_build, hc_head, hc_pre, resolve_all, use_backends
from kernels.hc_pre import MAX_N, MAX_STEPS, SOURCE, hc_pre_cpp, hc_pre_formula
from tests.kernels.conftest import assert_close, case_generator

# (leading shape, N streams, D, Sinkhorn iterations; 0: the head, fn with N rows): the model's N = 2..4,
# odd widths (vector tails), a single stream, one iteration, a token count that is not a multiple of 16
CASES = [((2, 5), 2, 64, 20), ((3, 7), 3, 37, 5), ((1, 9), 4, 33, 1), ((2, 3), 1, 16, 3), ((4, 6), 2, 19, 0),
         ((5,), 3, 70, 0), ((3, 11), 8, 24, 2)]


def _inputs(dtype, lead, n, d, iters, tag):
    g = case_generator("hc_pre", tag, dtype, lead, n, d, iters)
    m = n if iters == 0 else (2 + n) * n
    x = (torch.randn(*lead, n, d, generator=g, dtype=torch.float64) * 2).to(dtype)
    fn = torch.randn(m, n * d, generator=g, dtype=torch.float64) * 0.2
    base = torch.randn(m, generator=g, dtype=torch.float64) * 0.5
    scale = torch.rand(1 if iters == 0 else 3, generator=g, dtype=torch.float64) + 0.5
    return [x, fn.float(), base.float(), scale.float()], g


def _run(impl, args, iters, g_seed):
    """Outputs and the gradients of x, fn, base, scale under a random linear loss on every output."""
    leaves = [a.detach().clone().requires_grad_() for a in args]
    post, comb, h = impl(*leaves, max(iters, 1), 1e-6, 1e-6)
    outs = [t for t in (post, comb, h) if t is not None]
    g = torch.Generator().manual_seed(g_seed)
    loss = sum((o.float() * torch.randn(o.shape, generator=g)).sum() for o in outs)
    loss.backward()
    return outs, [p.grad for p in leaves]


def test_the_cpp_backend_builds_here():
    """The C++ kernels build wherever torch.compile's CPU backend works (it needs the same compiler); a
    machine without one would silently lose them, so CI fails instead."""
    assert cpp_build.compiler() is not None and cpp_build.available()
    lib = cpp_build.load(SOURCE)
    assert (lib.trex_hc_pre_max_n(), lib.trex_hc_pre_max_steps()) == (MAX_N, MAX_STEPS)  # the Python guard's limits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lead, n, d, iters", CASES)
def test_cpp_is_the_formula(dtype, lead, n, d, iters):
    """Forward (post, comb, h) and backward (x, fn, base, scale) of the C++ kernel against autograd through the
    definition, fresh random inputs; bf16 streams: h and dx are rounded once (the reference rounds the
    collapse's and the mixes' dx separately before adding them)."""
    args, _ = _inputs(dtype, lead, n, d, iters, "cpp")
    want_out, want_grad = _run(hc_pre_formula, args, iters, 7)
    got_out, got_grad = _run(hc_pre_cpp, args, iters, 7)
    assert [o.dtype for o in got_out] == [o.dtype for o in want_out]
    assert [o.shape for o in got_out] == [o.shape for o in want_out]
    for got, want in zip(got_out, want_out):
        assert_close(got, want, torch.float32 if got.dtype == torch.float32 else dtype)
    for got, want in zip(got_grad, want_grad):
        assert got.dtype == want.dtype
        assert_close(got, want, dtype)


def test_cpp_matches_the_formula_in_fp64_algebra():
    """fp32 C++ against the definition evaluated in fp64 (pins the algebra, not the rounding): every gradient
    within fp32 accumulation error."""
    args, _ = _inputs(torch.float32, (4, 8), 3, 40, 6, "fp64")
    got_out, got_grad = _run(hc_pre_cpp, args, 6, 3)
    want_out, want_grad = _run(hc_pre_formula, [a.double() for a in args], 6, 3)
    for got, want in zip(got_out + got_grad, want_out + want_grad):
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)


def test_the_kernel_runs_and_is_deterministic():
    """The C++ path is taken (the custom op is in the autograd graph) and two runs agree bit for bit."""
    args, _ = _inputs(torch.bfloat16, (4, 40), 2, 48, 20, "det")
    x = args[0].detach().requires_grad_()
    _post, _comb, h = hc_pre_cpp(x, *args[1:], 20, 1e-6, 1e-6)
    assert "HcPreCpu" in type(h.grad_fn).__name__ or "hc_pre_cpu" in str(h.grad_fn), h.grad_fn
    first_out, first_grad = _run(hc_pre_cpp, args, 20, 5)
    second_out, second_grad = _run(hc_pre_cpp, args, 20, 5)
    for a, b in zip(first_out + first_grad, second_out + second_grad):
        assert torch.equal(a, b)


@pytest.mark.parametrize("why", ["fp64", "fp16", "n9", "iters"])
def test_unsupported_inputs_run_the_reference(why):
    lead, n, d, iters = ((2, 3), 9 if why == "n9" else 2, 8, 200 if why == "iters" else 3)
    args, _ = _inputs(torch.float32, lead, n, d, iters, why)
    if why in ("fp64", "fp16"):
        args[0] = args[0].to(torch.float64 if why == "fp64" else torch.float16)
    want = hc_pre_formula(*args, iters, 1e-6, 1e-6)
    got = hc_pre_cpp(*args, iters, 1e-6, 1e-6)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_compiled_code_calls_the_custom_op():
    """Inside torch.compile the C++ kernel is one opaque node (no graph break, fullgraph), forward and
    backward, with the eager results."""
    seen = []

    def backend(gm, _inputs):
        seen.append({str(nd.target) for nd in gm.graph.nodes})
        return gm

    args, _ = _inputs(torch.bfloat16, (2, 17), 2, 32, 4, "compile")
    head_args, _ = _inputs(torch.bfloat16, (2, 17), 2, 32, 0, "compile-head")

    def f(x, fn, base, scale, hfn, hbase, hscale):
        post, comb, h = hc_pre(x, fn, base, scale, 4, 1e-6, 1e-6)
        return post, comb, h, hc_head(x, hfn, hbase, hscale, 1e-6, 1e-6)

    inputs = [a.detach().requires_grad_() for a in args + head_args[1:]]
    resolve_all("cpu")
    torch._dynamo.reset()
    try:
        out = torch.compile(f, backend=backend, fullgraph=True)(*inputs)
    finally:
        torch._dynamo.reset()
    assert seen and any("trex.hc_pre_cpu" in t for t in seen[0]), seen
    for got, want in zip(out, f(*inputs)):
        assert torch.equal(got, want)


def test_the_model_uses_it_and_the_reference_stays_selectable():
    from trainer.models.deepseek_v4.args import ModelArgs
    from trainer.models.deepseek_v4.model import HyperConnection, HyperHead

    g = case_generator("hc_pre-model")
    cfg = ModelArgs(hidden_size=16, hc_mult=3, hc_sinkhorn_iters=4)
    hc, head = HyperConnection(cfg), HyperHead(cfg)
    with torch.no_grad():
        for p in (hc.fn, head.fn, hc.base, head.base):
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    x = torch.randn(2, 5, 3, 16, generator=g)
    got = (*hc(x), head(x))
    with use_backends(hc_pre="reference"):
        want = (*hc(x), head(x))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
