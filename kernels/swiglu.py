"""Clamped SwiGLU of the MoE experts: ``silu(gate.clamp(max=limit)) * up.clamp(-limit, limit) [* prob]``.

``swiglu(gate_ni, up_ni, limit, prob_n=None)``: ``gate``/``up`` ``[..., I]`` (same shape; they may be
strided views, e.g. the two halves of a fused ``w13`` projection), ``limit`` ``None`` for no clamp,
``prob [...]`` an optional per-row factor (the router's combine weight, applied before the down projection,
which is linear, instead of after it).

Backends: ``reference`` (exactly the model's ``swiglu``, in the inputs' dtype), ``triton`` (fp32 math, one
rounding to the output dtype; backward recomputes ``silu`` from ``gate`` and writes ``dgate``, ``dup`` and a
deterministic per-block partial ``dprob`` summed by torch), ``torch_npu`` (``npu_swiglu`` when there is no
clamp and no ``prob``, else the reference; untested here).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from kernels.registry import cdiv, empty_output, get, register, triton_dtypes, triton_jit

tl: Any = None  # triton.language, bound by registry.triton_jit on first use

_BLOCK = 1024  # columns per program


# ----------------------------------------------------------------------------------------------- reference
@register("swiglu", "reference")
def swiglu_reference(gate_ni: torch.Tensor, up_ni: torch.Tensor, limit: float | None,
                     prob_n: torch.Tensor | None = None) -> torch.Tensor:
    if limit is not None:
        gate_ni, up_ni = gate_ni.clamp(max=limit), up_ni.clamp(min=-limit, max=limit)
    y = F.silu(gate_ni) * up_ni
    return y if prob_n is None else y * prob_n.unsqueeze(-1).to(y.dtype)


# ----------------------------------------------------------------------------------------------- triton
def _swiglu_fwd_kernel(g_ptr, u_ptr, p_ptr, y_ptr, n_cols, stride_g, stride_u, limit,
                       HAS_LIMIT: tl.constexpr, HAS_PROB: tl.constexpr, BLOCK: tl.constexpr):
    """Program (row, column block): ``y = silu(clamp(g)) * clamp(u) (* p[row])`` in fp32."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(g_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_LIMIT:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
    y = g * tl.sigmoid(g) * u
    if HAS_PROB:
        y = y * tl.load(p_ptr + row).to(tl.float32)
    tl.store(y_ptr + row * n_cols + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


def _swiglu_bwd_kernel(dy_ptr, g_ptr, u_ptr, p_ptr, dg_ptr, du_ptr, dp_part_ptr, n_cols, n_blocks,
                       stride_g, stride_u, limit,
                       HAS_LIMIT: tl.constexpr, HAS_PROB: tl.constexpr, BLOCK: tl.constexpr):
    """``dgate = dy p uc silu'(gc) [gate <= limit]``, ``dup = dy p silu(gc) [|up| <= limit]`` (torch's clamp
    gradient: it passes where the input is inside the closed range), ``dprob`` partial ``sum dy silu uc``."""
    row = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    cols = blk * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(g_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    gc, uc = g, u
    if HAS_LIMIT:
        gc = tl.minimum(g, limit)
        uc = tl.minimum(tl.maximum(u, -limit), limit)
    s = tl.sigmoid(gc)
    silu = gc * s
    if HAS_PROB:
        tl.store(dp_part_ptr + row * n_blocks + blk, tl.sum(dy * silu * uc, axis=0))
        dy = dy * tl.load(p_ptr + row).to(tl.float32)
    dg = dy * uc * (s * (1.0 + gc * (1.0 - s)))
    du = dy * silu
    if HAS_LIMIT:
        dg = tl.where(g <= limit, dg, 0.0)
        du = tl.where((u >= -limit) & (u <= limit), du, 0.0)
    tl.store(dg_ptr + row * n_cols + cols, dg.to(dg_ptr.dtype.element_ty), mask=mask)
    tl.store(du_ptr + row * n_cols + cols, du.to(du_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


class _SwiGLUTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate_ni: torch.Tensor, up_ni: torch.Tensor, limit: float | None, prob_n: torch.Tensor | None):
        shape, i = gate_ni.shape, gate_ni.shape[-1]
        g2, u2 = _rows(gate_ni), _rows(up_ni)
        n = g2.shape[0]
        p = prob_n.reshape(n).contiguous() if prob_n is not None else g2
        y2 = empty_output((n, i), gate_ni.dtype, gate_ni.device)
        grid = (n, cdiv(i, _BLOCK))
        triton_jit(_swiglu_fwd_kernel)[grid](
            g2, u2, p, y2, i, g2.stride(0), u2.stride(0), float(limit) if limit is not None else 0.0,
            HAS_LIMIT=limit is not None, HAS_PROB=prob_n is not None, BLOCK=_BLOCK)
        ctx.save_for_backward(g2, u2, prob_n.reshape(n) if prob_n is not None else None)
        ctx.limit, ctx.shape, ctx.up_dtype = limit, shape, up_ni.dtype
        return y2.view(shape)

    @staticmethod
    def backward(ctx, dy):
        g2, u2, p = ctx.saved_tensors
        limit, shape = ctx.limit, ctx.shape
        n, i = g2.shape
        n_blocks = cdiv(i, _BLOCK)
        dy2 = dy.reshape(n, i).contiguous()
        dg = empty_output((n, i), g2.dtype, g2.device)
        du = empty_output((n, i), ctx.up_dtype, g2.device)
        dp_part = empty_output((n, n_blocks), torch.float32, g2.device) if p is not None else dg
        triton_jit(_swiglu_bwd_kernel)[(n, n_blocks)](
            dy2, g2, u2, p.contiguous() if p is not None else g2, dg, du, dp_part, i, n_blocks,
            g2.stride(0), u2.stride(0), float(limit) if limit is not None else 0.0,
            HAS_LIMIT=limit is not None, HAS_PROB=p is not None, BLOCK=_BLOCK)
        dprob = dp_part.sum(-1).to(p.dtype).view(shape[:-1]) if p is not None else None
        return dg.view(shape), du.view(shape), None, dprob


def _triton_ok(*ts: torch.Tensor | None) -> bool:
    return all(t is None or t.numel() > 0 for t in ts) and triton_dtypes(*ts)


@register("swiglu", "triton", traced=swiglu_reference)  # (compiled: inductor fuses it)
def swiglu_triton(gate_ni: torch.Tensor, up_ni: torch.Tensor, limit: float | None,
                  prob_n: torch.Tensor | None = None) -> torch.Tensor:
    if gate_ni.shape != up_ni.shape or gate_ni.dtype != up_ni.dtype or not _triton_ok(gate_ni, up_ni, prob_n):
        return swiglu_reference(gate_ni, up_ni, limit, prob_n)
    return _SwiGLUTriton.apply(gate_ni, up_ni, limit, prob_n)


# ----------------------------------------------------------------------------------------------- torch_npu
# UNTESTED HERE (no NPU / CANN in CI). ``torch_npu.npu_swiglu(x, dim=-1)`` splits ``x`` in two halves A, B
# along ``dim`` and returns ``silu(A) * B`` (with autograd). It has no clamp and no row factor, so it only
# serves ``limit=None, prob=None``; the inputs are concatenated (one extra copy: worth it only when the
# caller cannot hand a fused ``[..., 2I]`` projection). Everything else runs the reference.
@register("swiglu", "torch_npu")
def swiglu_torch_npu(gate_ni: torch.Tensor, up_ni: torch.Tensor, limit: float | None,
                     prob_n: torch.Tensor | None = None) -> torch.Tensor:
    if limit is not None or prob_n is not None or gate_ni.shape != up_ni.shape or gate_ni.numel() == 0:
        return swiglu_reference(gate_ni, up_ni, limit, prob_n)
    import torch_npu

    return torch_npu.npu_swiglu(torch.cat((gate_ni, up_ni), dim=-1), dim=-1)


# ----------------------------------------------------------------------------------------------- public
def swiglu(gate_ni: torch.Tensor, up_ni: torch.Tensor, limit: float | None,
           prob_n: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)``, times ``prob[..., None]`` if given."""
    return get("swiglu", gate_ni.device.type)(gate_ni, up_ni, limit, prob_n)
