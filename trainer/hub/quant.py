"""FP8 block and MXFP4 (de)quantisation of the published DeepSeek-V4 weights.

FP8 (e4m3) weights ``q [out, in]`` carry a ``scale [ceil(out/128), ceil(in/128)]``, a multiplier per
128 x 128 block: ``W[i, j] = float(q[i, j]) * scale[i // 128, j // 128]``. The scale is E8M0 (a power of
two; V4-Flash / V4-Pro) or float32 (V4-Flash-Base).

MXFP4 routed experts (V4-Flash / V4-Pro) are int8 bytes ``[out, in/2]``, each holding two E2M1 codes
(low nibble = even input, high nibble = odd input; code = sign bit 3 + an index into
``{0, .5, 1, 1.5, 2, 3, 4, 6}``), with an E8M0 scale per 32 inputs, ``[out, in/32]``:
``W[r, k] = E2M1[code(r, k)] * scale[r, k // 32]``.

Write-back uses the published quantiser's power-of-two scales: ``s = 2^ceil(log2(amax / 448))`` per FP8
block (stored as E8M0, or as float32 for Flash-Base) and ``s = 2^ceil(log2(amax / 6))`` per 32-group for
MXFP4, then round to nearest (even) on the code grid, and then puts the quantised values in a canonical
form: the smallest power-of-two scale that holds them exactly, doubled when the largest code would then be
448 (6) and the values are exact at the doubled scale too. The largest code ends in [224, 448] ([3, 6]),
and the result depends on the quantised values alone, so quantising already-quantised values is
idempotent. (Where two encodings hold the same values, the published file may hold the other one: an
export that is given the published checkpoint as its reference keeps its bytes for unchanged tensors,
``trainer.hub.writer.hub_stream``.) An all-zero block gets the scale 1.
"""

from __future__ import annotations

import math

import torch

from kernels.dequant import dequant_fp8 as kernel_dequant_fp8
from kernels.dequant import dequant_mxfp4 as kernel_dequant_mxfp4

BLOCK = 128
MX_GROUP = 32
FP8_MAX = 448.0
FP4_MAX = 6.0
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
E8M0 = torch.float8_e8m0fnu
FP8 = torch.float8_e4m3fn


def _expand(scale_rc: torch.Tensor, rows: int, cols: int, block_r: int, block_c: int) -> torch.Tensor:
    return scale_rc.float().repeat_interleave(block_r, 0)[:rows].repeat_interleave(block_c, 1)[:, :cols]


def _byte_table(values_256: torch.Tensor) -> dict[torch.dtype, torch.Tensor]:
    return {dt: values_256.to(dt) for dt in (torch.float32, torch.bfloat16)}


# every e4m3 byte's value (NaN codes included), in each output dtype: a lookup beats the dtype cast on CPU
_FP8_VALUES = _byte_table(torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float())


def _check_out(dtype: torch.dtype) -> None:
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"dequantisation writes float32 or bfloat16, not {dtype}")


def _scale_as(scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``scale`` in the dtype to multiply ``dtype`` values by without a second rounding: E8M0 (powers of two,
    2^-127..2^127, all bfloat16 numbers) in ``dtype``, any other scale in float32 (a bfloat16 tensor times a
    float32 one is computed in float32 and rounded once, as ``(q.float() * s).to(bfloat16)`` is)."""
    return scale.to(dtype) if scale.dtype == E8M0 else scale.float()


def dequant_fp8(q: torch.Tensor, scale: torch.Tensor, row0: int = 0, col0: int = 0,
                dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q * scale`` in ``dtype`` (float32, or bfloat16: equal to the float32 result rounded) for FP8 codes ``q``
    whose first element is at ``(row0, col0)`` of the full weight; ``scale`` holds the blocks from ``row0 // 128,
    col0 // 128`` on (a slice reads only those).

    A whole weight goes to the ``dequant_fp8`` kernel (C++ on a CPU: one pass over the codes). A slice: one pass
    writes ``dtype`` values through a 256-entry table of the codes, a second multiplies them in place by the block
    scales broadcast over their blocks (one per block row, over the scale expanded along the columns only): no
    float32 copy of the weight or of the scales."""
    if q.dtype != FP8:
        raise TypeError(f"FP8 weight has dtype {q.dtype}, expected {FP8}")
    _check_out(dtype)
    r, c = q.shape
    if row0 == 0 and col0 == 0 and q.dim() == 2 and scale.shape == (-(-r // BLOCK), -(-c // BLOCK)):
        return kernel_dequant_fp8(q, scale, dtype)  # a whole weight: the kernel (one pass; the same values)
    out = _FP8_VALUES[dtype].index_select(0, q.reshape(-1).view(torch.uint8).int()).view(r, c)
    s = _scale_as(scale, dtype)
    ro, co = row0 % BLOCK, col0 % BLOCK
    if ro == 0 and co == 0 and r % BLOCK == 0 and c % BLOCK == 0 and r and c:
        br, bc = r // BLOCK, c // BLOCK
        out.view(br, BLOCK, bc, BLOCK).mul_(s[:br, :bc].reshape(br, 1, bc, 1))
        return out
    cols = s.repeat_interleave(BLOCK, 1)[:, co:co + c]  # [block rows, c]: 1/128 of the weight
    for i in range(math.ceil((ro + r) / BLOCK)):
        lo, hi = max(0, i * BLOCK - ro), min(r, (i + 1) * BLOCK - ro)
        if lo < hi:
            out[lo:hi].mul_(cols[i])
    return out


def _pow2_scale(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    """Smallest power of two ``s`` with ``amax / s <= qmax`` (exact: compares against ``qmax * 2^k``)."""
    amax = amax.float()
    zero = amax == 0
    k = torch.ceil(torch.log2(torch.where(zero, torch.ones_like(amax), amax) / qmax))
    k = torch.where(amax > qmax * torch.exp2(k), k + 1, k)
    k = torch.where(amax <= qmax * torch.exp2(k - 1), k - 1, k)
    k = torch.where(zero, torch.zeros_like(k), k).clamp(-127, 127)
    return torch.exp2(k)


def _blocks(t: torch.Tensor, br: int, bc: int) -> torch.Tensor:
    """``[br, bc, 128*128]`` view of ``t`` zero-padded to whole 128 x 128 blocks."""
    r, c = t.shape
    padded = torch.zeros(br * BLOCK, bc * BLOCK, dtype=t.dtype)
    padded[:r, :c] = t
    return padded.view(br, BLOCK, bc, BLOCK).transpose(1, 2).reshape(br, bc, BLOCK * BLOCK)


def _fp8(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8)


def quant_fp8(w: torch.Tensor, scale_dtype: torch.dtype = E8M0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q [out, in] e4m3, scale [ceil(out/128), ceil(in/128)] of scale_dtype)`` for a 2-D weight.

    The published rule, then a canonical form of the quantised values ``v``: the smallest power-of-two
    scale that holds them, doubled when the block's largest code would be 448 and ``v`` is exact at the
    doubled scale too (so a block whose largest code rounded down to 224 keeps that scale). The result is a
    function of ``v`` alone, hence idempotent."""
    if w.dim() != 2:
        raise ValueError(f"FP8 block quantisation needs a 2-D weight, got shape {tuple(w.shape)}")
    w = w.float()
    r, c = w.shape
    br, bc = math.ceil(r / BLOCK), math.ceil(c / BLOCK)
    scale = _pow2_scale(_blocks(w.abs(), br, bc).amax(-1), FP8_MAX)
    v = _fp8(w / _expand(scale, r, c, BLOCK, BLOCK)).float() * _expand(scale, r, c, BLOCK, BLOCK)
    amax = _blocks(v.abs(), br, bc).amax(-1)
    scale = _pow2_scale(amax, FP8_MAX)
    wide = 2 * scale
    back = _fp8(v / _expand(wide, r, c, BLOCK, BLOCK)).float() * _expand(wide, r, c, BLOCK, BLOCK)
    exact = _blocks((back != v).float(), br, bc).amax(-1) == 0  # the zero padding counts as no mismatch
    scale = torch.where((amax == FP8_MAX * scale) & exact & (scale < 2.0 ** 127), wide, scale)
    q = _fp8(v / _expand(scale, r, c, BLOCK, BLOCK))
    return q, scale.to(scale_dtype)


def dequant_fp4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[out, in]`` in ``dtype`` (float32, or bfloat16: the same values, E2M1 times a power of two being exact in
    both) from MXFP4 bytes ``[out, in/2]`` (int8) and E8M0 scales ``[out, in/32]``: the ``dequant_mxfp4`` kernel
    (C++ on a CPU: per 32-group the 16 code values scaled once, then one lookup per value)."""
    if packed.dtype not in (torch.int8, torch.uint8):
        raise TypeError(f"MXFP4 weight has dtype {packed.dtype}, expected int8 (two E2M1 codes per byte)")
    _check_out(dtype)
    r, half = packed.shape
    c = 2 * half
    if scale.shape != (r, c // MX_GROUP) or c % MX_GROUP:
        raise ValueError(f"MXFP4 scale has shape {tuple(scale.shape)}, expected {(r, c // MX_GROUP)}")
    return kernel_dequant_mxfp4(packed, scale, dtype)


def _e2m1(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded to the nearest E2M1 value, sign kept (ties to the even code, as round-to-nearest-even):
    the grid steps by 0.5 below 2, by 1 below 4 and by 2 up to 6, and an even multiple of the step is an even
    code, so ``round`` (half to even) of ``|x| / step`` is the code's rounding."""
    a = x.abs().clamp(max=FP4_MAX)
    step = torch.where(a < 2, 0.5, torch.where(a < 4, 1.0, 2.0))
    return torch.copysign(torch.round(a / step) * step, x)


def _e2m1_code(v: torch.Tensor) -> torch.Tensor:
    """The 4-bit code of E2M1 values ``v`` (sign bit 3, index into :data:`E2M1`)."""
    a = v.abs()
    index = torch.where(a < 2, a * 2, torch.where(a < 4, a + 2, a / 2 + 4)).to(torch.uint8)
    return index | (torch.signbit(v).to(torch.uint8) << 3)




def quant_fp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(packed [out, in/2] int8, scale [out, in/32] E8M0)`` for a 2-D weight whose ``in`` is a multiple of 32.

    Like :func:`quant_fp8`: the published rule, then the canonical form of the quantised values (the
    doubled scale when the largest code would be 6 and the values are exact at it, i.e. a group whose
    largest code rounded to 3 keeps its scale), so that quantising is idempotent."""
    if w.dim() != 2 or w.shape[1] % MX_GROUP:
        raise ValueError(f"MXFP4 needs a 2-D weight with in % {MX_GROUP} == 0, got shape {tuple(w.shape)}")
    r, c = w.shape
    g = w.float().view(r, c // MX_GROUP, MX_GROUP)
    scale = _pow2_scale(g.abs().amax(-1), FP4_MAX).unsqueeze(-1)
    v = _e2m1(g / scale) * scale
    amax = v.abs().amax(-1, keepdim=True)
    scale = _pow2_scale(amax, FP4_MAX)
    wide = 2 * scale
    exact = (_e2m1(v / wide) * wide == v).all(-1, keepdim=True)
    scale = torch.where((amax == FP4_MAX * scale) & exact & (scale < 2.0 ** 127), wide, scale)
    code = _e2m1_code(_e2m1(v / scale)).view(r, c // 2, 2)
    packed = (code[..., 0] | (code[..., 1] << 4)).view(torch.int8)
    return packed, scale.squeeze(-1).to(E8M0)
