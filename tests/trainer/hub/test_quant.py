"""FP8 block and MXFP4 (de)quantisation: the published formulas, exact slicing, idempotent re-quantisation."""

from __future__ import annotations

import pytest
import torch

from trainer.hub.quant import E2M1, E8M0, FP8, dequant_fp4, dequant_fp8, quant_fp4, quant_fp8


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


def _weights(seed: int, rows: int, cols: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * 0.02 * 10 ** (torch.rand(1, generator=g).item() * 4 - 3)
    w[: rows // 3, : cols // 4] = 0  # an all-zero corner (whole blocks / groups of zeros)
    w[rows // 2] *= -1
    return w


def test_fp8_dequant_is_the_block_formula():
    g = torch.Generator().manual_seed(0)
    q = (torch.randn(200, 300, generator=g) * 100).clamp(-448, 448).to(FP8)
    s = torch.exp2(torch.randint(-20, 0, (2, 3), generator=g).float())
    w = dequant_fp8(q, s.to(E8M0))
    for i, j in [(0, 0), (127, 128), (128, 299), (199, 255)]:
        assert w[i, j].item() == q[i, j].float().item() * s[i // 128, j // 128].item()


def test_fp4_dequant_is_the_nibble_formula():
    packed = torch.tensor([[0x21, 0xF8, 0x7E] + [0] * 13], dtype=torch.uint8).view(torch.int8)
    scale = torch.tensor([[0.25]]).to(E8M0)
    w = dequant_fp4(packed, scale)[0, :6]
    # byte 0x21: low nibble 1 (0.5) then high nibble 2 (1.0); 0xF8: 8 (-0) then 15 (-6); 0x7E: 14 (-4) then 7 (6)
    want = torch.tensor([0.5, 1.0, -0.0, -6.0, -4.0, 6.0]) * 0.25
    assert torch.equal(w, want) and torch.signbit(w[2])


@pytest.mark.parametrize("shape", [(300, 200), (128, 128), (1, 7), (257, 129)])
@pytest.mark.parametrize("scale_dtype", [E8M0, torch.float32])
def test_fp8_requantisation_is_idempotent_and_accurate(shape, scale_dtype):
    for seed in range(6):
        w = _weights(seed, *shape)
        q, s = quant_fp8(w, scale_dtype)
        assert q.dtype == FP8 and s.dtype == scale_dtype
        assert s.shape == (-(-shape[0] // 128), -(-shape[1] // 128))
        back = dequant_fp8(q, s)
        amax = w.abs().max().item()
        assert (back - w).abs().max().item() <= amax / 16 + 1e-30  # e4m3: 3 mantissa bits
        q2, s2 = quant_fp8(back, scale_dtype)
        assert torch.equal(_bytes(q2), _bytes(q)) and torch.equal(_bytes(s2), _bytes(s)), (shape, seed)
        assert torch.all(torch.log2(s.float()) == torch.round(torch.log2(s.float())))  # powers of two


@pytest.mark.parametrize("shape", [(64, 96), (3, 32), (130, 256)])
def test_fp4_requantisation_is_idempotent_and_accurate(shape):
    for seed in range(6):
        w = _weights(seed, *shape)
        packed, s = quant_fp4(w)
        assert packed.dtype == torch.int8 and packed.shape == (shape[0], shape[1] // 2)
        assert s.dtype == E8M0 and s.shape == (shape[0], shape[1] // 32)
        back = dequant_fp4(packed, s)
        group_max = w.view(shape[0], -1, 32).abs().amax(-1, keepdim=True)
        assert ((back - w).view(shape[0], -1, 32).abs() <= group_max / 3 + 1e-30).all()
        p2, s2 = quant_fp4(back)
        assert torch.equal(p2, packed) and torch.equal(_bytes(s2), _bytes(s)), (shape, seed)


def test_fp4_rounds_ties_to_even_on_the_e2m1_grid():
    x = torch.zeros(1, 32)
    x[0, :8] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0])
    packed, s = quant_fp4(x)
    assert dequant_fp4(packed, s)[0, :8].tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0]
    assert s.float().item() == 2.0  # canonical: these values are exact at the doubled scale (largest code 3)
    packed, s = quant_fp4(torch.randn(4, 64))
    codes = (dequant_fp4(packed, s) / s.float().repeat_interleave(32, 1)).abs()
    assert torch.isin(codes, E2M1).all()


def test_a_block_whose_largest_code_rounded_down_keeps_its_scale():
    """The published rule gives scale 2^k with largest code 224 (or 3 for MXFP4) for some blocks; the re-quantised
    values must come back with the same scale, not 2^(k-1) with doubled codes."""
    w = torch.zeros(128, 128)
    w[0, 0] = 225.0 * 2 ** -10  # amax / s = 225 rounds to the e4m3 value 224
    w[5, 7] = 3.0 * 2 ** -10
    q, s = quant_fp8(w)
    assert s.float().item() == 2 ** -9 or s.float().item() == 2 ** -10
    q2, s2 = quant_fp8(dequant_fp8(q, s))
    assert torch.equal(_bytes(q2), _bytes(q)) and torch.equal(_bytes(s2), _bytes(s))
    g = torch.zeros(1, 32)
    g[0, 0], g[0, 1] = 3.2, 0.5  # largest code 3 at scale 1
    p, sc = quant_fp4(g)
    p2, sc2 = quant_fp4(dequant_fp4(p, sc))
    assert torch.equal(p, p2) and torch.equal(_bytes(sc), _bytes(sc2))


def test_dequantising_a_slice_reads_only_its_blocks():
    w = _weights(3, 300, 260)
    q, s = quant_fp8(w)
    full = dequant_fp8(q, s)
    for r0, r1, c0, c1 in [(0, 300, 0, 260), (130, 250, 129, 190), (127, 129, 255, 260)]:
        part = dequant_fp8(q[r0:r1, c0:c1], s[r0 // 128:-(-r1 // 128), c0 // 128:-(-c1 // 128)], r0, c0)
        assert torch.equal(part, full[r0:r1, c0:c1])


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="multiple of 32|in % 32"):
        quant_fp4(torch.zeros(4, 48))
    with pytest.raises(TypeError, match="expected int8"):
        dequant_fp4(torch.zeros(4, 16), torch.ones(4, 1).to(E8M0))
    with pytest.raises(ValueError, match="2-D"):
        quant_fp8(torch.zeros(2, 3, 4))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t.view(torch.int32)


def _fp8_formula(q: torch.Tensor, s: torch.Tensor, r0: int, c0: int) -> torch.Tensor:
    """The published formula written out: every element times its block's scale, in float32."""
    r, c = q.shape
    rows = (torch.arange(r) + r0) // 128 - r0 // 128
    cols = (torch.arange(c) + c0) // 128 - c0 // 128
    return q.float() * s.float()[rows][:, cols]


@pytest.mark.parametrize("scale_dtype", [E8M0, torch.float32])
@pytest.mark.parametrize("shape, r0, c0", [((256, 384), 0, 0), ((200, 300), 0, 0), ((130, 251), 5, 77),
                                           ((1, 129), 127, 255)])
def test_fp8_dequant_to_each_dtype_is_the_formula_rounded_once(scale_dtype, shape, r0, c0):
    """The table-and-broadcast dequantiser against the formula on every byte value (NaN codes aside), E8M0 scales
    from 2^-127 to 2^127 (or arbitrary float32 ones, Flash-Base), odd shapes and slices: float32 bit for bit, and
    bfloat16 bit for bit the float32 result rounded (one rounding, never two)."""
    g = torch.Generator().manual_seed(sum(shape) + r0)
    codes = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x01  # no NaN (NaN != NaN)
    q = codes.view(FP8)
    nb = (-(-(r0 % 128 + shape[0]) // 128), -(-(c0 % 128 + shape[1]) // 128))
    if scale_dtype == E8M0:
        s = torch.exp2(torch.randint(-127, 128, nb, generator=g).float()).to(E8M0)
    else:
        s = torch.rand(nb, generator=g) * 10 ** torch.randint(-30, 30, nb, generator=g).float()
    want = _fp8_formula(q, s, r0, c0)
    assert torch.equal(_bits(dequant_fp8(q, s, r0, c0)), _bits(want))
    assert torch.equal(_bits(dequant_fp8(q, s, r0, c0, torch.bfloat16)), _bits(want.to(torch.bfloat16)))


@pytest.mark.parametrize("rows", [1, 7, 64])
def test_fp4_dequant_to_each_dtype_is_the_formula(rows):
    """Every byte value through the 256-entry table, scales from 2^-127 to 2^127: float32 and bfloat16 equal the
    formula bit for bit (the signs of zero included)."""
    g = torch.Generator().manual_seed(rows)
    packed = torch.randint(0, 256, (rows, 48), generator=g, dtype=torch.uint8)
    packed[0, :16] = torch.arange(16, dtype=torch.uint8) * 17  # both nibbles of every code
    s = torch.exp2(torch.randint(-127, 128, (rows, 3), generator=g).float()).to(E8M0)
    lo, hi = (packed & 0xF).long(), (packed >> 4).long()
    mag = lambda code: torch.where(code >= 8, -E2M1[code & 7], E2M1[code & 7])  # noqa: E731
    want = torch.stack([mag(lo), mag(hi)], -1).flatten(-2) * s.float().repeat_interleave(32, 1)
    p = packed.view(torch.int8)
    assert torch.equal(_bits(dequant_fp4(p, s)), _bits(want))
    assert torch.equal(_bits(dequant_fp4(p, s, torch.bfloat16)), _bits(want.to(torch.bfloat16)))
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        dequant_fp4(p, s, torch.float16)
