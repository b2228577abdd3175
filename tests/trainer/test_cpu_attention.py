"""The CPU attention path (query blocks over visible columns, the sink in the mask) against the definition."""

import pytest
import torch

import trainer.models.deepseek_v4.cpu_attention as cpu_attention


def _definition(q_bhtc, kv_bsc, sinks_h, mask_bts):
    """softmax over [q k^T / sqrt(C) masked, sink_h] times [kv; 0], in float64."""
    c = q_bhtc.shape[-1]
    logits = torch.einsum("bhtc,bsc->bhts", q_bhtc, kv_bsc) * c ** -0.5
    logits = logits.masked_fill(~mask_bts[:, None], float("-inf"))
    sink = sinks_h.view(1, -1, 1, 1).expand(*logits.shape[:3], 1)
    p = torch.cat([logits, sink], -1).softmax(-1)[..., :-1]
    return torch.einsum("bhts,bsc->bhtc", p, kv_bsc)


def _check_against_definition(q, kv, sinks, mask, dy):
    """``sink_attention_cpu``'s output and its three gradients against the float64 definition; returns the output."""
    leaves = [x.clone().requires_grad_() for x in (q, kv, sinks)]
    out = cpu_attention.sink_attention_cpu(leaves[0].transpose(1, 2), leaves[1], leaves[2], mask).transpose(1, 2)
    out.backward(dy)
    ref_leaves = [x.double().requires_grad_() for x in (q, kv, sinks)]
    ref = _definition(*ref_leaves[:2], ref_leaves[2], mask if isinstance(mask, torch.Tensor) else torch.cat(mask, -1))
    ref.backward(dy.double())
    torch.testing.assert_close(out, ref.float(), rtol=1e-5, atol=1e-5)
    for got, want in zip(leaves, ref_leaves):
        torch.testing.assert_close(got.grad, want.grad.float(), rtol=1e-4, atol=1e-5)
    return out


@pytest.mark.parametrize("block", [4, 7, 128])
@pytest.mark.parametrize("b,h,t,s,c", [(2, 3, 19, 19, 16), (1, 4, 23, 29, 8)])
def test_blocked_sink_attention_matches_the_definition(monkeypatch, block, b, h, t, s, c):
    monkeypatch.setattr(cpu_attention, "CPU_QUERY_BLOCK", block)
    g = torch.Generator().manual_seed(block * 100 + t)
    q = torch.randn(b, h, t, c, generator=g)
    kv = torch.randn(b, s, c, generator=g)
    sinks = torch.randn(h, generator=g)
    mask = torch.ones(t, s, dtype=torch.bool).tril(s - t)[None].repeat(b, 1, 1)  # causal, last query sees all
    mask &= torch.rand(b, t, s, generator=g) > 0.3  # and holes (a query may see no key: only its sink)
    mask[:, :, -3:] |= torch.rand(b, t, 3, generator=g) > 0.5  # compressed-like columns past the diagonal
    dy = torch.randn(b, h, t, c, generator=g)
    _check_against_definition(q, kv, sinks, mask, dy)


@pytest.mark.parametrize("b,h,t,s,c", [(3, 4, 1, 37, 16), (2, 3, 5, 11, 8)])
def test_few_queries_take_the_matrix_product_path_with_the_same_values(monkeypatch, b, h, t, s, c):
    """A decoding step (one query per row, up to ``CPU_DIRECT_QUERIES``) does not call the flash kernel; values and
    gradients are the definition's, a query that sees no key included."""
    def no_flash(*_a, **_k):
        raise AssertionError("few queries must not take the flash kernel")

    monkeypatch.setattr(cpu_attention._SinkFlashCPU, "apply", no_flash)
    g = torch.Generator().manual_seed(t * 10 + s)
    q, kv, sinks, dy = (torch.randn(b, h, t, c, generator=g), torch.randn(b, s, c, generator=g),
                        torch.randn(h, generator=g), torch.randn(b, h, t, c, generator=g))
    mask = torch.rand(b, t, s, generator=g) > 0.4
    mask[0, 0] = False  # sees only its sink: the output is zero
    out = _check_against_definition(q, kv, sinks, mask, dy)
    assert out[0, :, 0].abs().max() == 0


@pytest.mark.parametrize("t", [2, 21])  # the matrix-product path and the flash path
def test_a_mask_in_parts_along_the_keys_is_the_joined_mask(t):
    """The attention takes its mask as parts along the keys (window | compressed entries) and joins them itself,
    eagerly: the same output and gradients as the joined mask."""
    g = torch.Generator().manual_seed(t)
    b, h, s, c = 2, 3, 26, 8
    q, kv, sinks, dy = (torch.randn(b, h, t, c, generator=g), torch.randn(b, s, c, generator=g),
                        torch.randn(h, generator=g), torch.randn(b, h, t, c, generator=g))
    mask = torch.rand(b, t, s, generator=g) > 0.4
    whole = _check_against_definition(q, kv, sinks, mask, dy)
    parts = _check_against_definition(q, kv, sinks, (mask[..., :19], mask[..., 19:]), dy)
    torch.testing.assert_close(parts, whole, rtol=0, atol=0)


@pytest.mark.parametrize("t", [1, 3, 21])  # the matrix-product path (parts read apart) and the flash path (joined)
def test_keys_in_parts_are_the_joined_keys(t):
    """A decoding step passes the cache's window keys and the compressed entries apart (joining them would copy the
    cache): values and gradients are the definition's over the joined keys."""
    g = torch.Generator().manual_seed(100 + t)
    b, h, s, c, w = 3, 4, 29, 8, 6
    q, kv, sinks, dy = (torch.randn(b, h, t, c, generator=g), torch.randn(b, s + w, c, generator=g),
                        torch.randn(h, generator=g), torch.randn(b, h, t, c, generator=g))
    mask = torch.rand(b, t, s + w, generator=g) > 0.4
    leaves = [x.clone().requires_grad_() for x in (q, kv, sinks)]
    out = cpu_attention.sink_attention_cpu(leaves[0].transpose(1, 2), (leaves[1][:, :s], leaves[1][:, s:]), leaves[2],
                                           (mask[..., :s], mask[..., s:])).transpose(1, 2)
    out.backward(dy)
    ref_leaves = [x.double().requires_grad_() for x in (q, kv, sinks)]
    ref = _definition(*ref_leaves, mask)
    ref.backward(dy.double())
    torch.testing.assert_close(out, ref.float(), rtol=1e-5, atol=1e-5)
    for got, want in zip(leaves, ref_leaves):
        torch.testing.assert_close(got.grad, want.grad.float(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("fused", [False, True])
def test_token_major_and_head_major_queries_give_the_same_values(monkeypatch, fused):
    """Query blocks are views of contiguous token-major ``q [B, T, H, C]`` (what ``Attention._attend`` passes) and
    copies of a head-major one: the same output and gradients either way, with the sink-gradient row products
    eager or compiled (``cpu_attention.fuse``); the output is contiguous ``[B, T, H, C]``."""
    monkeypatch.setattr(cpu_attention, "CPU_QUERY_BLOCK", 8)
    monkeypatch.setattr(cpu_attention, "CPU_MATERIALISE_BLOCK", 8)
    if fused:
        cpu_attention.fuse("inductor")
    try:
        g = torch.Generator().manual_seed(3)
        b, h, t, s, c = 2, 3, 21, 25, 16
        q_bhtc = torch.randn(b, h, t, c, generator=g)
        kv, sinks, dy = torch.randn(b, s, c, generator=g), torch.randn(h, generator=g), torch.randn(b, h, t, c, generator=g)
        mask = torch.rand(b, t, s, generator=g) > 0.4
        results = []
        for q in (q_bhtc.transpose(1, 2).contiguous().transpose(1, 2), q_bhtc):  # token-major, head-major memory
            out = _check_against_definition(q, kv, sinks, mask, dy)
            assert out.transpose(1, 2).is_contiguous()
            results.append(out)
        torch.testing.assert_close(results[0], results[1], rtol=0, atol=0)
        assert cpu_attention.fused() == fused
    finally:
        cpu_attention.fuse(None)


@pytest.fixture
def fused_attention():
    cpu_attention.fuse("inductor")
    yield
    cpu_attention.fuse(None)


def _count_calls(monkeypatch, cls) -> list:
    calls = []
    apply = cls.apply
    monkeypatch.setattr(cls, "apply", lambda *a: calls.append(1) or apply(*a))
    return calls


@pytest.mark.parametrize("cols,block", [(10_000, 5), (10_000, 64), (18, 6)])
def test_compiled_blocks_take_the_materialised_scores_up_to_the_column_cap(monkeypatch, fused_attention, cols,
                                                                           block):
    """While fused, query blocks of ``CPU_MATERIALISE_BLOCK`` that see at most ``CPU_MATERIALISE_COLS`` columns
    go through the materialised score matrix, the others through the flash kernel: the definition's values and
    gradients either way (holes, queries that see only their sink, symbolic column counts across blocks)."""
    monkeypatch.setattr(cpu_attention, "CPU_MATERIALISE_BLOCK", block)
    monkeypatch.setattr(cpu_attention, "CPU_MATERIALISE_COLS", cols)
    mat = _count_calls(monkeypatch, cpu_attention._SinkSoftmaxCPU)
    flash = _count_calls(monkeypatch, cpu_attention._SinkFlashCPU)
    g = torch.Generator().manual_seed(block + cols)
    b, h, t, s, c = 2, 3, 29, 31, 16
    q, kv, sinks, dy = (torch.randn(b, h, t, c, generator=g), torch.randn(b, s, c, generator=g),
                        torch.randn(h, generator=g), torch.randn(b, h, t, c, generator=g))
    mask = torch.ones(t, s, dtype=torch.bool).tril(s - t)[None].repeat(b, 1, 1)
    mask &= torch.rand(b, t, s, generator=g) > 0.3
    mask[1, :4] = False  # the first queries of one row see only their sink
    out = _check_against_definition(q, kv, sinks, mask, dy)
    assert out[1, :, :4].abs().max() == 0
    blocks = -(-t // block)
    assert len(mat) + len(flash) == blocks
    if cols > s:
        assert len(mat) == blocks and not flash
    else:  # the first blocks see few columns (causal), the last ones more than the cap
        assert mat and flash


def test_materialised_scores_in_bf16_agree_with_the_flash_kernel(monkeypatch, fused_attention):
    """In bf16 the materialised path rounds where the flash kernel does (fp32 scores and softmax, 16-bit
    probabilities into the products): outputs and gradients within a few bf16 roundings of each other."""
    g = torch.Generator().manual_seed(7)
    b, h, t, s, c = 2, 4, 70, 70, 32
    q, kv, dy = (torch.randn(b, h, t, c, generator=g).bfloat16(), torch.randn(b, s, c, generator=g).bfloat16(),
                 torch.randn(b, h, t, c, generator=g).bfloat16())
    sinks = torch.randn(h, generator=g)
    mask = (torch.ones(t, s, dtype=torch.bool).tril() & ~torch.ones(t, s, dtype=torch.bool).tril(-20))[None]
    mask = mask.repeat(b, 1, 1)  # a causal window of 20
    results = []
    for cap in (10_000, 0):  # materialised, flash
        monkeypatch.setattr(cpu_attention, "CPU_MATERIALISE_COLS", cap)
        leaves = [x.clone().requires_grad_() for x in (q, kv, sinks)]
        out = cpu_attention.sink_attention_cpu(leaves[0].transpose(1, 2), leaves[1], leaves[2], mask)
        out.transpose(1, 2).backward(dy)
        results.append([out.float()] + [x.grad.float() for x in leaves])
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=3e-2, atol=3e-2)
