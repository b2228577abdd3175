"""Partial interleaved RoPE, as the model's ``apply_rope``.

``apply_rope(x_bhtc, cos_btf, sin_btf)``: the trailing ``2F`` channels of ``x [B, H, T, C]`` are rotated in
consecutive pairs ``(x[c0 + 2f], x[c0 + 2f + 1])`` (``c0 = C - 2F``) by the angle whose ``cos``/``sin`` are
``[B, T, F]`` (shared by the heads): ``(a, b) -> (a cos - b sin, b cos + a sin)``; the leading ``C - 2F``
channels pass through. Math in fp32 (``cos``/``sin`` promoted from their dtype), cast back to ``x``'s dtype.
The model also undoes the rotation with ``apply_rope(out, cos, -sin)``.

Backends: ``reference`` (the model's code), ``triton`` (one program per ``(b, t, h)`` row; backward is the
same kernel with ``-sin``, the inverse rotation; no gradient for ``cos``/``sin``: if they require one, the
reference runs), ``torch_npu`` (``npu_rotary_mul(..., rotary_mode="interleave")`` on the rotated slice;
untested here).
"""

from __future__ import annotations

from typing import Any

import torch

from kernels.registry import empty_output, get, next_pow2, register, triton_dtypes, triton_jit

tl: Any = None  # triton.language, bound by registry.triton_jit on first use


# ----------------------------------------------------------------------------------------------- reference
def rope_formula(x_bhtc: torch.Tensor, cos_btf: torch.Tensor, sin_btf: torch.Tensor) -> torch.Tensor:
    """The definition: rotate the trailing channels as ``x * cos + rot(x) * sin`` (autograd through all of it,
    angles included)."""
    cos = cos_btf.repeat_interleave(2, dim=-1).unsqueeze(1)
    sin = sin_btf.repeat_interleave(2, dim=-1).unsqueeze(1)
    r = cos.shape[-1]
    nope, rope = x_bhtc[..., :-r], x_bhtc[..., -r:]
    rot = torch.stack((-rope[..., 1::2], rope[..., 0::2]), dim=-1).flatten(-2)
    return torch.cat([nope, ((rope.float() * cos) + (rot.float() * sin)).to(x_bhtc.dtype)], dim=-1)


def rope_traced(x_bhtc: torch.Tensor, cos_btf: torch.Tensor, sin_btf: torch.Tensor) -> torch.Tensor:
    """What compiled code traces for the reference: for constant angles an autograd Function whose forward and
    backward are the same rotation in real arithmetic on the pairs (:func:`_rotate_real`; the backward by
    ``-sin``), both traced and fused by inductor. Traced through autograd instead, the formula's backward scatters
    into zero tensors (``select_backward`` of its stride-2 selections): fwd + bwd of bench_20m's queries
    ``[8, 8, 512, 128]`` bf16, compiled, 3.5 ms against 7.4 ms, the same values and gradients bit for bit."""
    if cos_btf.requires_grad or sin_btf.requires_grad:
        return rope_formula(x_bhtc, cos_btf, sin_btf)
    return _RoPETraced.apply(x_bhtc, cos_btf, sin_btf)


@register("rope", "reference", traced=rope_traced)  # (compiled: inductor fuses it; no complex views)
def apply_rope_reference(x_bhtc: torch.Tensor, cos_btf: torch.Tensor, sin_btf: torch.Tensor) -> torch.Tensor:
    if cos_btf.requires_grad or sin_btf.requires_grad:
        return rope_formula(x_bhtc, cos_btf, sin_btf)
    return _RoPEPairs.apply(x_bhtc, cos_btf, sin_btf)


def _rotate_real(x_bhtc: torch.Tensor, cos_btf: torch.Tensor, sin_btf: torch.Tensor) -> torch.Tensor:
    """:func:`rope_formula`'s values for constant angles, written on the pairs ``[..., F, 2]``:
    ``(a cos - b sin, b cos + a sin)`` in fp32 (the same products and sums as the formula)."""
    f = cos_btf.shape[-1]
    acc = torch.promote_types(torch.float32, cos_btf.dtype)
    pairs = x_bhtc[..., x_bhtc.shape[-1] - 2 * f:].to(acc).unflatten(-1, (f, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    c, s = cos_btf.to(acc).unsqueeze(1), sin_btf.to(acc).unsqueeze(1)
    rotated = torch.stack((a * c - b * s, b * c + a * s), dim=-1).flatten(-2).to(x_bhtc.dtype)
    return torch.cat([x_bhtc[..., :x_bhtc.shape[-1] - 2 * f], rotated], dim=-1)


class _RoPETraced(torch.autograd.Function):
    """:func:`_rotate_real` forward, and by ``-sin`` (the inverse rotation) backward: see :func:`rope_traced`."""

    @staticmethod
    def forward(ctx, x_bhtc: torch.Tensor, cos_btf: torch.Tensor, sin_btf: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos_btf, sin_btf)
        return _rotate_real(x_bhtc, cos_btf, sin_btf)

    @staticmethod
    def backward(ctx, dy_bhtc: torch.Tensor):
        cos_btf, sin_btf = ctx.saved_tensors
        return _rotate_real(dy_bhtc, cos_btf, -sin_btf), None, None


class _RoPEPairs(torch.autograd.Function):
    """:func:`rope_formula` for constant angles, the pairs rotated as one complex product into one output tensor
    (the formula's stack / cat / repeat_interleave cost ~2x on CPU, strided pair-wise writes ~2.5x more than the
    complex product). Forward values are the formula's bit for bit (``(a + ib)(cos + i sin)`` is computed as the
    same two fp32 products and one sum per component, without FMA); the backward is the inverse rotation of the
    gradient (``-sin``)."""

    @staticmethod
    def forward(ctx, x_bhtc: torch.Tensor, cos_btf: torch.Tensor, sin_btf: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos_btf, sin_btf)
        return _rotate_pairs(x_bhtc, cos_btf, sin_btf, negate_sin=False)

    @staticmethod
    def backward(ctx, dy_bhtc: torch.Tensor):
        cos_btf, sin_btf = ctx.saved_tensors
        return _rotate_pairs(dy_bhtc, cos_btf, sin_btf, negate_sin=True), None, None


def _rotate_pairs(x_bhtc: torch.Tensor, cos_btf: torch.Tensor, sin_btf: torch.Tensor, negate_sin: bool) -> torch.Tensor:
    """``(a, b) -> (a cos - b sin, b cos + a sin)`` on the trailing pairs (``-sin`` if ``negate_sin``), in fp32:
    the pairs as complex numbers times ``cos + i sin``."""
    f = cos_btf.shape[-1]
    c0 = x_bhtc.shape[-1] - 2 * f
    y = torch.empty(x_bhtc.shape, dtype=x_bhtc.dtype, device=x_bhtc.device)
    if c0:
        y[..., :c0] = x_bhtc[..., :c0]
    acc = torch.promote_types(torch.float32, cos_btf.dtype)  # fp32 (fp64 angles: fp64), as the formula
    rot = x_bhtc[..., c0:].to(acc)
    if rot.storage_offset() % 2 or any(st % 2 for st in rot.stride()[:-1]):  # (odd widths: no complex view)
        rot = rot.contiguous()
    pairs_bhtf = torch.view_as_complex(rot.unflatten(-1, (f, 2)))
    sin = -sin_btf if negate_sin else sin_btf
    turn_b1tf = torch.view_as_complex(torch.stack((cos_btf.to(acc), sin.to(acc)), dim=-1)).unsqueeze(1)
    y[..., c0:] = torch.view_as_real(pairs_bhtf * turn_b1tf).flatten(-2)
    return y


# ----------------------------------------------------------------------------------------------- triton
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, y_ptr, H, T, C, F,
                 sx_b, sx_h, sx_t, sc_b, sc_t, ss_b, ss_t,
                 NEG_SIN: tl.constexpr, BLOCK_NOPE: tl.constexpr, BLOCK_F: tl.constexpr):
    """Program ``((b * H) + h) * T + t``: copy the ``C - 2F`` leading channels, rotate the pairs after them.
    ``y`` is contiguous ``[B, H, T, C]``; ``x``, ``cos``, ``sin`` are read through their strides (channel
    stride 1)."""
    pid = tl.program_id(0).to(tl.int64)
    t = pid % T
    bh = pid // T
    h = bh % H
    b = bh // H
    x_row = x_ptr + b * sx_b + h * sx_h + t * sx_t
    y_row = y_ptr + pid * C
    c0 = C - 2 * F
    if BLOCK_NOPE > 0:
        for start in range(0, c0, BLOCK_NOPE):
            offs = start + tl.arange(0, BLOCK_NOPE)
            m = offs < c0
            tl.store(y_row + offs, tl.load(x_row + offs, mask=m, other=0.0), mask=m)
    f = tl.arange(0, BLOCK_F)
    mf = f < F
    c = tl.load(cos_ptr + b * sc_b + t * sc_t + f, mask=mf, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + b * ss_b + t * ss_t + f, mask=mf, other=0.0).to(tl.float32)
    if NEG_SIN:
        s = -s
    xa = tl.load(x_row + c0 + 2 * f, mask=mf, other=0.0).to(tl.float32)
    xb = tl.load(x_row + c0 + 2 * f + 1, mask=mf, other=0.0).to(tl.float32)
    tl.store(y_row + c0 + 2 * f, (xa * c - xb * s).to(y_ptr.dtype.element_ty), mask=mf)
    tl.store(y_row + c0 + 2 * f + 1, (xb * c + xa * s).to(y_ptr.dtype.element_ty), mask=mf)


def _rope_launch(x_bhtc: torch.Tensor, cos_btf: torch.Tensor, sin_btf: torch.Tensor, neg_sin: bool) -> torch.Tensor:
    b, h, t, c = x_bhtc.shape
    f = cos_btf.shape[-1]
    if x_bhtc.stride(-1) != 1:
        x_bhtc = x_bhtc.contiguous()
    cos = cos_btf.expand(b, t, f)
    sin = sin_btf.expand(b, t, f)
    cos = cos if cos.stride(-1) == 1 else cos.contiguous()
    sin = sin if sin.stride(-1) == 1 else sin.contiguous()
    y = empty_output((b, h, t, c), x_bhtc.dtype, x_bhtc.device)
    nope = c - 2 * f
    triton_jit(_rope_kernel)[(b * h * t,)](
        x_bhtc, cos, sin, y, h, t, c, f,
        x_bhtc.stride(0), x_bhtc.stride(1), x_bhtc.stride(2), cos.stride(0), cos.stride(1),
        sin.stride(0), sin.stride(1),
        NEG_SIN=neg_sin, BLOCK_NOPE=min(next_pow2(nope), 1024) if nope > 0 else 0, BLOCK_F=next_pow2(f))
    return y


class _RoPETriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_bhtc: torch.Tensor, cos_btf: torch.Tensor, sin_btf: torch.Tensor):
        ctx.save_for_backward(cos_btf, sin_btf)
        return _rope_launch(x_bhtc, cos_btf, sin_btf, neg_sin=False)

    @staticmethod
    def backward(ctx, dy_bhtc):
        cos_btf, sin_btf = ctx.saved_tensors  # the transpose of a rotation is the rotation by -angle
        return _rope_launch(dy_bhtc, cos_btf, sin_btf, neg_sin=True), None, None


def _triton_ok(x_bhtc: torch.Tensor, cos_btf: torch.Tensor, sin_btf: torch.Tensor) -> bool:
    if x_bhtc.dim() != 4 or cos_btf.dim() != 3 or sin_btf.shape != cos_btf.shape or x_bhtc.numel() == 0:
        return False
    b, _, t, c = x_bhtc.shape
    f = cos_btf.shape[-1]
    if 2 * f > c or cos_btf.shape[1] != t or cos_btf.shape[0] not in (1, b):
        return False
    if cos_btf.requires_grad or sin_btf.requires_grad:
        return False
    return triton_dtypes(x_bhtc, cos_btf, sin_btf)


@register("rope", "triton", traced=rope_formula)  # (compiled: inductor fuses the definition)
def apply_rope_triton(x_bhtc: torch.Tensor, cos_btf: torch.Tensor, sin_btf: torch.Tensor) -> torch.Tensor:
    if not _triton_ok(x_bhtc, cos_btf, sin_btf):
        return apply_rope_reference(x_bhtc, cos_btf, sin_btf)
    return _RoPETriton.apply(x_bhtc, cos_btf, sin_btf)


# ----------------------------------------------------------------------------------------------- torch_npu
# UNTESTED HERE (no NPU / CANN in CI). ``torch_npu.npu_rotary_mul(x, r1, r2, rotary_mode="interleave")``
# computes ``x * r1 + rotate_interleaved(x) * r2`` with ``rotate_interleaved = stack((-x[1::2], x[0::2]))``:
# our formula with ``r1``/``r2`` the per-pair cos/sin repeated twice. Its interleave mode wants 4-d inputs
# in BNSD/BSND/SBND layout with ``cos``/``sin`` broadcast as ``11SD``/``1S1D``/``S11D`` only (no per-batch
# positions), ``B*N < 1000`` and ``D < 896``; so the rotated slice is laid out as SBND with ``S = B*T``,
# ``B = 1``, ``N = H`` and ``cos``/``sin`` as ``S11D`` (per-row positions of packed documents are kept).
# It needs a torch_npu recent enough to have ``rotary_mode``; otherwise (TypeError) the reference runs.
# The NPU op computes in the input dtype (bf16 rounding may differ slightly from the fp32 reference).
@register("rope", "torch_npu")
def apply_rope_torch_npu(x_bhtc: torch.Tensor, cos_btf: torch.Tensor, sin_btf: torch.Tensor) -> torch.Tensor:
    if x_bhtc.dim() != 4 or cos_btf.dim() != 3 or x_bhtc.shape[1] >= 1000 or 2 * cos_btf.shape[-1] >= 896 or \
            x_bhtc.numel() == 0 or x_bhtc.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return apply_rope_reference(x_bhtc, cos_btf, sin_btf)
    import torch_npu

    b, h, t, c = x_bhtc.shape
    f = cos_btf.shape[-1]

    r = 2 * f
    rope_sbnd = x_bhtc[..., c - r:].transpose(1, 2).reshape(b * t, 1, h, r).contiguous()
    cos4 = cos_btf.expand(b, t, f).repeat_interleave(2, dim=-1).reshape(b * t, 1, 1, r).to(x_bhtc.dtype)
    sin4 = sin_btf.expand(b, t, f).repeat_interleave(2, dim=-1).reshape(b * t, 1, 1, r).to(x_bhtc.dtype)
    try:
        out = torch_npu.npu_rotary_mul(rope_sbnd, cos4, sin4, rotary_mode="interleave")
    except TypeError:  # torch_npu without rotary_mode
        return apply_rope_reference(x_bhtc, cos_btf, sin_btf)
    out = out.reshape(b, t, h, r).transpose(1, 2)
    return torch.cat([x_bhtc[..., :c - r], out], dim=-1)


# ----------------------------------------------------------------------------------------------- public
def apply_rope(x_bhtc: torch.Tensor, cos_btf: torch.Tensor, sin_btf: torch.Tensor) -> torch.Tensor:
    """Rotate consecutive channel pairs of the trailing ``2F`` channels of ``x [B, H, T, C]`` by
    ``cos``/``sin [B, T, F]``; leading channels pass through."""
    return get("rope", x_bhtc.device.type)(x_bhtc, cos_btf, sin_btf)
