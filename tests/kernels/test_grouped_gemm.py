import pytest
import torch
import torch.nn.functional as F

from kernels import get, registry, use_backends
from kernels.grouped_gemm import (
    grouped_mm,
    grouped_mm_reference,
    grouped_mm_triton,
    moe_experts,
    moe_experts_composed,
    moe_experts_loop,
    moe_experts_reference,
    swiglu_limit,
    tile_schedule,
)
from kernels.router import route
from tests.kernels.conftest import assert_close, case_generator

VOCAB = 50


def _leaf(t, device="cpu"):
    return t.detach().to(device).clone().requires_grad_()


def _loop_mm(x, w, counts):
    """Per-expert slices through autograd: the definition."""
    outs, start = [], 0
    for e, n in enumerate(counts.tolist()):
        outs.append(x[start:start + n] @ w[e])
        start += n
    return torch.cat(outs)


def _case(m_counts, d, n, dtype, case):
    g = case_generator(*case)
    counts = torch.tensor(m_counts)
    x = (torch.randn(int(counts.sum()), d, generator=g)).to(dtype)
    w = (torch.randn(len(m_counts), d, n, generator=g) / d ** 0.5).to(dtype)
    dy = torch.randn(int(counts.sum()), n, generator=g).to(dtype)
    return x, w, counts, dy


COUNTS = [[3, 0, 17, 1, 0], [0, 0, 5], [4, 4, 4, 4], [0, 33, 0, 0, 2, 0, 1]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("counts", COUNTS)
def test_reference_matches_slices(dtype, counts):
    x, w, c, dy = _case(counts, 24, 20, dtype, ("ref", dtype, counts))
    xr, wr, xl, wl = _leaf(x), _leaf(w), _leaf(x), _leaf(w)
    with registry.poison_outputs():
        y = grouped_mm(xr, wr, c)
        y.backward(dy)
    ref = _loop_mm(xl, wl, c)
    ref.backward(dy)
    assert_close(y, ref, dtype)
    assert_close(xr.grad, xl.grad, dtype)
    assert_close(wr.grad, wl.grad, dtype)  # NaN-free: empty experts' dw written (zeros)
    assert (wr.grad[c == 0] == 0).all()


def test_reference_validates():
    with pytest.raises(ValueError, match="sums to"):
        grouped_mm(torch.zeros(4, 3), torch.zeros(2, 3, 5), torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="counts_e"):
        grouped_mm(torch.zeros(3, 3), torch.zeros(2, 3, 5), torch.tensor([3]))


@pytest.mark.parametrize("counts", [[3, 0, 17, 1, 0], [0, 40, 0], [1]])
def test_tile_schedule_covers_each_row_once(counts):
    c = torch.tensor(counts)
    expert_t, r0_t, r1_t = tile_schedule(c, int(c.sum()), 16)
    seen = torch.zeros(int(c.sum()), dtype=torch.long)
    starts = (torch.cumsum(c, 0) - c).tolist()
    for e, r0, r1 in zip(expert_t.tolist(), r0_t.tolist(), r1_t.tolist()):
        rows = range(r0, min(r0 + 16, r1))
        for r in rows:
            assert starts[e] <= r < starts[e] + counts[e]
            seen[r] += 1
    assert (seen == 1).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("counts,d,n", [([3, 0, 17, 1, 0], 24, 20), ([0, 0, 5], 40, 17), ([0, 33, 0, 2], 16, 33)])
def test_triton_matches_reference(triton_device, dtype, counts, d, n):
    x, w, c, dy = _case(counts, d, n, dtype, ("triton", dtype, counts))
    xt, wt = _leaf(x, triton_device), _leaf(w, triton_device)
    xr, wr = _leaf(x.float()), _leaf(w.float())  # fp32 truth on the same values
    y = grouped_mm_triton(xt, wt, c.to(triton_device), blocks=(16, 16, 16), warps=(4, 2))
    ref = grouped_mm_reference(xr, wr, c)
    assert y.dtype == dtype
    assert_close(y.cpu(), ref, dtype)
    y.backward(dy.to(triton_device))
    ref.backward(dy.float())
    assert_close(xt.grad.cpu(), xr.grad, dtype)
    assert_close(wt.grad.cpu(), wr.grad, dtype)


def test_swiglu_limit_matches_model_and_clamp_gradients():
    from trainer.models.deepseek_v4.model import swiglu as model_swiglu

    gate = torch.tensor([[2.0, 2.5, -3.0, 1.0, 0.3]], dtype=torch.float64)
    up = torch.tensor([[2.0, -2.0, 2.5, -2.5, -0.7]], dtype=torch.float64)
    gate = torch.cat([gate, torch.randn(6, 5, generator=case_generator("sw"), dtype=torch.float64) * 3])
    up = torch.cat([up, torch.randn(6, 5, generator=case_generator("sw2"), dtype=torch.float64) * 3])
    g1, u1, g2, u2 = _leaf(gate), _leaf(up), _leaf(gate), _leaf(up)
    y = swiglu_limit(g1, u1, 2.0)
    ref = model_swiglu(g2, u2, 2.0)
    assert torch.equal(y, ref)
    dy = torch.randn(ref.shape, generator=case_generator("dy"), dtype=torch.float64)
    y.backward(dy)
    ref.backward(dy)
    torch.testing.assert_close(g1.grad, g2.grad)
    torch.testing.assert_close(u1.grad, u2.grad)


def _experts_case(n, k, e, d, i, dtype, case, empty=()):
    g = case_generator(*case)
    allowed = torch.tensor([j for j in range(e) if j not in empty])
    idx = torch.stack([allowed[torch.randperm(len(allowed), generator=g)[:k]] for _ in range(n)])
    x = torch.randn(n, d, generator=g).to(dtype)
    w = torch.rand(n, k, generator=g)
    ws = [(torch.randn(e, a, b, generator=g) * 0.3).to(dtype) for a, b in ((d, i), (d, i), (i, d))]
    return x, idx, w, ws, torch.randn(n, d, generator=g).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k,e,d,i,empty", [(23, 3, 8, 32, 16, (0, 5, 7)), (5, 1, 4, 9, 7, (1, 2, 3))])
@pytest.mark.parametrize("impl", ["fused", "composed"])
def test_moe_experts_matches_the_loop(dtype, n, k, e, d, i, empty, impl):
    fn = moe_experts if impl == "fused" else moe_experts_composed
    _assert_matches_the_loop(fn, _experts_case(n, k, e, d, i, dtype, ("experts", dtype, n, impl), empty), dtype)


def _assert_matches_the_loop(fn, case, dtype):
    """``fn`` (outputs poisoned) against ``moe_experts_loop``: output and every gradient."""
    x, idx, w, ws, dy = case
    a = [_leaf(t) for t in (x, w, *ws)]
    b = [_leaf(t) for t in (x, w, *ws)]
    with registry.poison_outputs():
        y = fn(a[0], idx, a[1], *a[2:], 1.5)
        y.backward(dy)
    ref = moe_experts_loop(b[0], idx, b[1], *b[2:], 1.5)
    ref.backward(dy)
    assert_close(y, ref, dtype)
    for ta, tb in zip(a, b):
        assert_close(ta.grad, tb.grad, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_rows", [1, 7, 40])
def test_moe_experts_chunked_matches_the_loop(monkeypatch, dtype, chunk_rows):
    """The CPU path batches the elementwise work over chunks of consecutive experts: chunks of one expert, of
    several (with empty experts between them) and experts larger than a chunk all give the loop's values."""
    import kernels.grouped_gemm as gg

    monkeypatch.setattr(gg, "_CHUNK_ROWS", chunk_rows)
    case = _experts_case(31, 3, 9, 16, 12, dtype, ("chunks", dtype, chunk_rows), (2, 3))
    _assert_matches_the_loop(moe_experts_reference, case, dtype)


def test_expert_chunks_cover_each_nonempty_expert_once():
    from kernels.grouped_gemm import _expert_chunks

    sizes = [3, 0, 17, 1, 0, 0, 4, 2]
    chunks = _expert_chunks(sizes, 5)
    assert [(r0, r1) for r0, r1, _ in chunks] == [(0, 20), (20, 25), (25, 27)]
    members = [(e, r0 + s0, r0 + s1) for r0, _, ex in chunks for e, s0, s1 in ex]
    starts = [sum(sizes[:e]) for e in range(len(sizes))]
    assert members == [(e, starts[e], starts[e] + n) for e, n in enumerate(sizes) if n]
    assert _expert_chunks([0, 0], 5) == []


@pytest.mark.parametrize("lim", [1.5, 7.0, 0.1])
def test_clamp_masks_are_inclusive_like_torch_clamp(lim):
    """The backward's clamp masks (``hardtanh_backward`` with bounds widened by one fp32 ulp) pass the gradient
    exactly where ``torch.clamp``'s does, at the bounds and one ulp either side of them."""
    import math

    from kernels.grouped_gemm import _fp32_widened
    from kernels.moe_chunk_math import hardtanh_bwd as _hardtanh_bwd

    b = torch.tensor([lim], dtype=torch.float32)
    near = [torch.nextafter(b, b + 1), b, torch.nextafter(b, b - 1)]
    x = torch.cat([*near, *(-t for t in near), torch.randn(50) * 2 * lim])
    grad = torch.rand(x.shape) + 0.5
    lo, hi = _fp32_widened(-lim, math.inf), _fp32_widened(lim, -math.inf)
    for clamp_kw, (low, high) in (({"min": -lim, "max": lim}, (lo, hi)), ({"max": lim}, (-math.inf, hi))):
        xr = x.clone().requires_grad_()
        xr.clamp(**clamp_kw).backward(grad)
        assert torch.equal(_hardtanh_bwd(grad, x, low, high), xr.grad)


def test_moe_experts_triton_backends(triton_device):
    """The composition with every op on Triton (interpreted here), fp32, against the loop."""
    x, idx, w, ws, dy = _experts_case(6, 2, 5, 16, 16, torch.float32, ("experts-triton",), (3,))
    a = [_leaf(t, triton_device) for t in (x, w, *ws)]
    b = [_leaf(t) for t in (x, w, *ws)]
    with use_backends(moe_experts="triton"):
        y = moe_experts(a[0], idx.to(triton_device), a[1], *a[2:], 1.5)
        y.backward(dy.to(triton_device))
    ref = moe_experts_loop(b[0], idx, b[1], *b[2:], 1.5)
    ref.backward(dy)
    assert_close(y.cpu(), ref, torch.float32)
    for ta, tb in zip(a, b):
        assert_close(ta.grad.cpu(), tb.grad, torch.float32)


def _moe(kind, dtype, case, e=8, k=3):
    from tests.trainer.helpers import TINY
    from trainer.models.deepseek_v4.args import ModelArgs
    from trainer.models.deepseek_v4.model import MoE

    cfg = ModelArgs(**{**TINY, "n_routed_experts": e, "num_experts_per_tok": k, "swiglu_limit": 1.5})
    moe = MoE(cfg, kind, VOCAB)
    g = case_generator(*case)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        moe.expert_bias.copy_(torch.randn(e, generator=g) * 0.2)
        if moe.hash:
            moe.tid2eid.copy_(torch.rand(VOCAB, e, generator=g).argsort(-1)[:, :k])
    return moe.to(dtype), cfg, g


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["moe", "hash_moe"])
def test_ops_reproduce_the_models_moe_layer(dtype, kind):
    """route -> moe_experts (+ shared expert) against ``MoE.forward``, forward and every gradient."""
    moe, cfg, g = _moe(kind, dtype, ("layer", dtype, kind))
    x = torch.randn(2, 9, cfg.hidden_size, generator=g).to(dtype)
    ids = torch.randint(0, VOCAB, (2, 9), generator=g)
    dy = torch.randn(x.shape, generator=g).to(dtype)
    x_m = _leaf(x)
    ref = moe(x_m, ids)
    ref.backward(dy)
    grads_m = {name: p.grad.clone() for name, p in moe.named_parameters()}
    moe.zero_grad()

    x_o = _leaf(x)
    x_nd = x_o.reshape(-1, cfg.hidden_size)
    w, idx, _ = route(moe.gate(x_nd), moe.expert_bias, cfg.num_experts_per_tok, cfg.scoring_func,
                      cfg.routed_scaling_factor, indices_nk=moe.tid2eid[ids.reshape(-1)] if moe.hash else None)
    y = moe_experts(x_nd, idx, w, moe.w_gate, moe.w_up, moe.w_down, cfg.swiglu_limit) + moe.shared(x_nd)
    y = y.view_as(x)
    y.backward(dy)
    tol = dtype if dtype == torch.bfloat16 else torch.float32
    assert_close(y, ref, tol)
    assert_close(x_o.grad, x_m.grad, tol)
    for name, p in moe.named_parameters():
        assert_close(p.grad, grads_m[name], tol)


def test_moe_experts_partial_grads_and_no_tokens():
    x, idx, w, ws, dy = _experts_case(4, 2, 5, 8, 8, torch.float32, ("partial",))
    xa = _leaf(x)
    y = moe_experts(xa, idx, w, *ws, 1.5)  # only x needs a gradient
    y.backward(dy)
    xb = _leaf(x)
    moe_experts_loop(xb, idx, w, *ws, 1.5).backward(dy)
    assert_close(xa.grad, xb.grad, torch.float32)
    empty = moe_experts(x[:0], idx[:0], w[:0], *ws, 1.5)
    assert empty.shape == (0, 8)


def test_moe_experts_under_autocast_runs_the_gemms_in_bf16():
    """Like ``nn.Linear`` under ``torch.autocast``: bf16 GEMMs, bf16 output, fp32 gradients for fp32 weights;
    the same values as the per-expert loop (whose matmuls autocast casts)."""
    x, idx, w, ws, dy = _experts_case(19, 2, 6, 16, 8, torch.float32, ("autocast",), (4,))
    a = [_leaf(t) for t in (x, w, *ws)]
    b = [_leaf(t) for t in (x, w, *ws)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = moe_experts(a[0], idx, a[1], *a[2:], 1.5)
        ref = moe_experts_loop(b[0], idx, b[1], *b[2:], 1.5)
    assert y.dtype == torch.bfloat16
    y.float().backward(dy)
    ref.float().backward(dy)
    assert_close(y, ref.to(y.dtype), torch.bfloat16)
    for ta, tb in zip(a, b):
        assert ta.grad.dtype == torch.float32
        assert_close(ta.grad, tb.grad, torch.bfloat16)


def test_registry_picks_reference_on_cpu():
    assert get("moe_experts", "cpu") is moe_experts_reference
    assert get("grouped_mm", "cpu") is grouped_mm_reference
    x = torch.randn(4, 3)
    eye = torch.eye(3)[None].expand(2, 3, 3)
    assert torch.equal(F.linear(x, torch.eye(3)), grouped_mm(x, eye, torch.tensor([1, 3])))


@pytest.fixture
def fused_chunk_math():
    from kernels import moe_chunk_math

    moe_chunk_math.fuse("inductor")
    try:
        yield
    finally:
        moe_chunk_math.fuse(None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_experts_with_fused_chunk_math_matches_the_loop(monkeypatch, fused_chunk_math, dtype):
    """The CPU path's element-wise work compiled (``moe_chunk_math.fuse``, as a compiled model runs it): chunks
    of varying row counts (one dynamic-shape graph) give the loop's output and gradients."""
    import kernels.grouped_gemm as gg
    from kernels import moe_chunk_math

    assert moe_chunk_math.fused()
    monkeypatch.setattr(gg, "_CHUNK_ROWS", 7)
    case = _experts_case(31, 3, 9, 16, 12, dtype, ("fused-chunks", dtype), (2, 3))
    _assert_matches_the_loop(moe_experts_reference, case, dtype)


def test_aligned_rows_pad_each_expert_block_with_weightless_rows():
    from kernels.grouped_gemm import _aligned_rows

    sizes = [3, 0, 8, 1]
    token_m = torch.arange(12) + 5
    w_m = torch.rand(12, generator=case_generator("aligned-rows")) + 0.5
    token_p, w_p, rows_m, padded = _aligned_rows(token_m, w_m, sizes, 4)
    assert padded == [4, 0, 8, 4] and token_p.numel() == w_p.numel() == 16
    assert rows_m.tolist() == [0, 1, 2, 4, 5, 6, 7, 8, 9, 10, 11, 12]  # each expert's block starts aligned
    assert torch.equal(token_p[rows_m], token_m) and torch.equal(w_p[rows_m], w_m)
    pad = torch.ones(16, dtype=torch.bool).index_fill_(0, rows_m, False)
    assert (w_p[pad] == 0).all() and (token_p[pad] == 0).all()
    assert _aligned_rows(token_m, w_m, [4, 0, 8], 4)[2] is None  # already aligned: the layout as it is


def test_padded_row_counts_stay_few_per_doubling():
    from kernels.grouped_gemm import _padded

    assert [_padded(n, 64) for n in (0, 1, 64, 65, 1000, 1024, 1025, 5000)] == [0, 64, 64, 128, 1024, 1024, 1088, 5120]
    assert _padded(37, 1) == 37
    for lo in (1024, 4096, 65536):
        counts = {_padded(n, 64) for n in range(lo, 2 * lo)}
        assert len(counts) <= 17 and all(0 <= _padded(n, 64) - n <= n // 16 for n in range(lo, 2 * lo, 7))


@pytest.mark.parametrize("align", [8, 64])
@pytest.mark.parametrize("chunk_rows", [7, 40])
def test_moe_experts_with_padded_expert_rows_matches_the_loop(monkeypatch, align, chunk_rows):
    """16-bit CPU inputs pad each expert's rows (oneDNN builds a kernel per GEMM shape); forced on fp32 here so
    that the padded layout is checked to fp32 precision: output and every gradient, with chunks of one or
    several experts, empty experts, and (poisoned) scratch rows."""
    import kernels.grouped_gemm as gg

    assert gg._row_align(torch.zeros(1, dtype=torch.bfloat16)) == 64 and gg._row_align(torch.zeros(1)) == 1
    monkeypatch.setattr(gg, "_row_align", lambda x: align)
    monkeypatch.setattr(gg, "_CHUNK_ROWS", chunk_rows)
    case = _experts_case(31, 3, 9, 16, 12, torch.float32, ("padded", align, chunk_rows), (2, 3))
    _assert_matches_the_loop(moe_experts_reference, case, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("weighted", [True, False])
def test_combine_sums_each_tokens_rows(dtype, k, weighted):
    """``moe_chunk_math.combine``'s per-choice sum (eager, and compiled as the fused chunk math runs it) against
    accumulating the weighted rows into a zeroed tensor of the accumulation dtype: equal bit for bit for k <= 2,
    to rounding for k = 3; the result in the rows' dtype."""
    from kernels.moe_chunk_math import combine_rows

    g = case_generator("combine", dtype, k, weighted)
    n, m, d = 13, 50, 7
    rows = torch.randn(m, d, generator=g, dtype=torch.float64).to(dtype)
    pos = torch.randperm(m, generator=g)[: n * k].view(n, k)
    w = torch.rand(n, k, generator=g) if weighted else None
    acc = torch.promote_types(dtype, torch.float32)
    want = torch.zeros(n, d, dtype=acc)
    for j in range(k):
        want += rows[pos[:, j]].to(acc) * (w[:, j:j + 1].to(acc) if weighted else 1)
    want = want.to(dtype)
    for fn in (combine_rows, torch.compile(combine_rows, backend="inductor", dynamic=True)):
        got = fn(rows, pos, w)
        assert got.dtype == dtype and got.shape == (n, d)
        if k <= 2:
            assert torch.equal(got, want)
        else:
            torch.testing.assert_close(got, want)
