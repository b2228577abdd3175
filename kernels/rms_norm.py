"""RMSNorm: ``y = x / sqrt(mean(x^2) + eps) * weight``, computed in (at least) fp32 and cast back.

Ops:

- ``rms_norm(x_nd, weight_d | None, eps)``: ``weight=None`` is the model's ``unweighted_rms_norm``
  (``x * rsqrt(mean(x^2) + eps).to(x.dtype)``: the factor is rounded to ``x``'s dtype before the product);
- ``add_rms_norm(x_nd, residual_nd, weight_d | None, eps) -> (normed_nd, new_residual_nd)``: the residual
  add fused in front of the norm (``new_residual = x + residual``, ``normed = rms_norm(new_residual)``).

Backends: ``reference`` (torch), ``triton`` (one row per program forward, fp32 accumulation, in/out in the
tensors' dtype; backward loops over a block of rows per program and writes fp32 partial weight gradients
that torch sums), ``torch_npu`` (``torch_npu.npu_rms_norm``; untested here, no NPU in CI).
"""

from __future__ import annotations

from typing import Any

import torch

from kernels.registry import (cdiv, empty_output, get, next_pow2, num_programs, register,
                              triton_dtypes, triton_jit)

tl: Any = None  # triton.language, bound by registry.triton_jit on first use (never imported at import time)

_MAX_BLOCK = 65536  # widest row one program holds in registers; wider rows use the reference


# ----------------------------------------------------------------------------------------------- reference
def rms_norm_formula(x_nd: torch.Tensor, weight_d: torch.Tensor | None, eps: float) -> torch.Tensor:
    """The definition (autograd through every step)."""
    acc = torch.promote_types(x_nd.dtype, torch.float32)  # at least fp32 (fp64 stays fp64)
    xf = x_nd.to(acc)
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight_d is None:  # exactly the model's unweighted_rms_norm
        return x_nd * rstd.to(x_nd.dtype)
    return (xf * rstd * weight_d.to(acc)).to(x_nd.dtype)


@register("rms_norm", "reference", traced=rms_norm_formula)  # (compiled: inductor fuses the definition)
def rms_norm_reference(x_nd: torch.Tensor, weight_d: torch.Tensor | None, eps: float) -> torch.Tensor:
    """:func:`rms_norm_formula` as an autograd Function with the analytic backward (``r = rstd``, ``k`` the
    row width, ``u = g * w`` or ``g``)::

        dx = r * u - x * r^3 / k * sum_row(u * x)        dw = sum_rows(g * x * r)

    It saves ``x`` and ``r`` only; autograd through the formula saves and re-reads the squares and runs
    ~3x the passes over ``x`` (forward + backward of a per-head query norm, fp32, 2 CPU threads: 25 vs 11 ms).
    Forward values are the formula's up to the order of the sum of squares. Unweighted bf16 / fp16 ``x`` (the
    queries under autocast) stays in its dtype: the row sums accumulate in fp32 inside ``vecdot`` and are
    rounded once (the formula converts ``x`` to fp32 and back; 3x slower, same error against fp64 to within an
    ulp). Weighted bf16 / fp16 takes the formula (one rounding of ``x * r * w``)."""
    if x_nd.dtype not in (torch.float32, torch.float64) and weight_d is not None:
        return rms_norm_formula(x_nd, weight_d, eps)
    return _RMSNorm.apply(x_nd, weight_d, eps)


class _RMSNorm(torch.autograd.Function):
    """fp32 / fp64 ``x`` (weighted or not), or unweighted low-precision ``x`` (element-wise work in its dtype,
    row sums in fp32)."""

    @staticmethod
    def forward(ctx, x_nd: torch.Tensor, weight_d: torch.Tensor | None, eps: float) -> torch.Tensor:
        acc = torch.promote_types(x_nd.dtype, torch.float32)
        rstd = torch.rsqrt(torch.linalg.vecdot(x_nd, x_nd).to(acc).unsqueeze(-1).div_(x_nd.shape[-1]).add_(eps))
        if weight_d is None:
            y = x_nd * rstd.to(x_nd.dtype)
        else:
            y = (x_nd * rstd).mul_(weight_d.to(acc))
        ctx.save_for_backward(x_nd, weight_d, rstd)
        return y

    @staticmethod
    def backward(ctx, g_nd: torch.Tensor):
        x_nd, weight_d, rstd = ctx.saved_tensors
        g = g_nd.to(x_nd.dtype)
        u = g if weight_d is None else g * weight_d.to(x_nd.dtype)
        coef = torch.linalg.vecdot(u, x_nd).to(rstd.dtype).unsqueeze(-1).mul_(rstd.pow(3)).div_(-x_nd.shape[-1])
        dx = (u * rstd.to(x_nd.dtype)).addcmul_(x_nd, coef.to(x_nd.dtype)) if ctx.needs_input_grad[0] else None
        dw = None
        if weight_d is not None and ctx.needs_input_grad[1]:
            dw = (g * x_nd * rstd).reshape(-1, x_nd.shape[-1]).sum(0).to(weight_d.dtype)
        return dx, dw, None


@register("add_rms_norm", "reference")
def add_rms_norm_reference(x_nd: torch.Tensor, residual_nd: torch.Tensor, weight_d: torch.Tensor | None,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    h_nd = x_nd + residual_nd
    return rms_norm_reference(h_nd, weight_d, eps), h_nd


# ----------------------------------------------------------------------------------------------- triton
def _rms_norm_fwd_kernel(x_ptr, res_ptr, w_ptr, y_ptr, h_ptr, rstd_ptr, n_cols, stride_x, stride_res, eps,
                         HAS_RES: tl.constexpr, HAS_W: tl.constexpr, BLOCK: tl.constexpr):
    """One row per program: ``h = x (+ res)``, ``rstd = rsqrt(mean(h^2) + eps)``, ``y = h * rstd (* w)``."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    h = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        h = h + tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0).to(tl.float32)
        h_out = h.to(h_ptr.dtype.element_ty)
        tl.store(h_ptr + row * n_cols + cols, h_out, mask=mask)
        h = h_out.to(tl.float32)  # normalise the stored (rounded) sum, as the reference does
    rstd = tl.rsqrt(tl.sum(h * h, axis=0) / n_cols + eps)
    tl.store(rstd_ptr + row, rstd)
    if HAS_W:
        y = h * rstd * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    else:  # the model's unweighted norm rounds the factor to the output dtype first
        y = h * rstd.to(y_ptr.dtype.element_ty).to(tl.float32)
    tl.store(y_ptr + row * n_cols + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


def _rms_norm_bwd_kernel(dy_ptr, h_ptr, w_ptr, rstd_ptr, dres_ptr, dx_ptr, dw_part_ptr, n_rows, n_cols,
                         stride_h, rows_per_program,
                         HAS_DRES: tl.constexpr, HAS_W: tl.constexpr, BLOCK: tl.constexpr):
    """A block of rows per program: ``dx = rstd * (g*w - xhat * mean(g*w*xhat)) (+ d new_residual)``;
    ``sum over the block of g * xhat`` goes to this program's row of the fp32 partial ``dw``."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    col_mask = cols < n_cols
    if HAS_W:
        w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK,), dtype=tl.float32)
    first = pid.to(tl.int64) * rows_per_program
    for i in range(0, rows_per_program):
        row = first + i
        mask = cols < tl.where(row < n_rows, n_cols, 0)  # (a scalar & vector bool mask trips the interpreter)
        h = tl.load(h_ptr + row * stride_h + cols, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(dy_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + row, mask=row < n_rows, other=0.0)
        xhat = h * rstd
        if HAS_W:
            gw = g * w
        else:
            gw = g
        dx = rstd * (gw - xhat * (tl.sum(gw * xhat, axis=0) / n_cols))
        if HAS_DRES:
            dx = dx + tl.load(dres_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(dx_ptr + row * n_cols + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        if HAS_W:
            dw += g * xhat
    if HAS_W:
        tl.store(dw_part_ptr + pid * n_cols + cols, dw, mask=col_mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``[..., D]`` as a ``[N, D]`` view with unit column stride (copies only if it must)."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


class _RMSNormTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_nd: torch.Tensor, res_nd: torch.Tensor | None, weight_d: torch.Tensor | None, eps: float):
        shape, d = x_nd.shape, x_nd.shape[-1]
        x2 = _rows(x_nd)
        n = x2.shape[0]
        block = next_pow2(d)
        warps = min(max(block // 256, 1), 16)
        if res_nd is not None:
            out_dtype = torch.result_type(x_nd, res_nd)
            res2 = _rows(res_nd)
            h2 = empty_output((n, d), out_dtype, x_nd.device)
        else:
            out_dtype, res2, h2 = x_nd.dtype, x2, x2
        y2 = empty_output((n, d), out_dtype, x_nd.device)
        rstd = empty_output(n, torch.float32, x_nd.device)
        w = weight_d.contiguous() if weight_d is not None else x2
        triton_jit(_rms_norm_fwd_kernel)[(n,)](
            x2, res2, w, y2, h2, rstd, d, x2.stride(0), res2.stride(0), eps,
            HAS_RES=res_nd is not None, HAS_W=weight_d is not None, BLOCK=block, num_warps=warps)
        ctx.save_for_backward(h2, weight_d, rstd)
        ctx.has_res, ctx.shape, ctx.x_dtype = res_nd is not None, shape, x_nd.dtype
        ctx.res_dtype = res_nd.dtype if res_nd is not None else None
        if res_nd is not None:
            return y2.view(shape), h2.view(shape)
        return y2.view(shape)

    @staticmethod
    def backward(ctx, dy, dh=None):
        h2, weight_d, rstd = ctx.saved_tensors
        n, d = h2.shape
        block = next_pow2(d)
        warps = min(max(block // 256, 1), 16)
        progs = max(1, min(n, num_programs(h2.device)))
        rows_per = cdiv(n, progs)
        progs = cdiv(n, rows_per)
        dy2 = dy.reshape(n, d).contiguous()
        dres = dh.reshape(n, d).contiguous() if (ctx.has_res and dh is not None) else dy2
        dx2 = empty_output((n, d), h2.dtype, h2.device)
        dw_part = empty_output((progs, d), torch.float32, h2.device) if weight_d is not None else rstd
        triton_jit(_rms_norm_bwd_kernel)[(progs,)](
            dy2, h2, weight_d if weight_d is not None else h2, rstd, dres, dx2, dw_part, n, d, h2.stride(0),
            rows_per, HAS_DRES=ctx.has_res and dh is not None, HAS_W=weight_d is not None, BLOCK=block,
            num_warps=warps)
        dw = dw_part.sum(0).to(weight_d.dtype) if weight_d is not None else None
        dx = dx2.view(ctx.shape)
        if ctx.has_res:  # d x = d residual = d h (x + residual was the only use of either)
            return dx.to(ctx.x_dtype), dx.to(ctx.res_dtype), dw, None
        return dx, None, dw, None


def _triton_ok(x_nd: torch.Tensor, *others: torch.Tensor | None) -> bool:
    """Non-empty rows of at most ``_MAX_BLOCK`` channels, every tensor in a dtype the kernels take."""
    return x_nd.numel() > 0 and triton_dtypes(x_nd, *others) and next_pow2(x_nd.shape[-1]) <= _MAX_BLOCK


@register("rms_norm", "triton", traced=rms_norm_formula)  # (compiled: inductor fuses the definition)
def rms_norm_triton(x_nd: torch.Tensor, weight_d: torch.Tensor | None, eps: float) -> torch.Tensor:
    if not _triton_ok(x_nd, weight_d):
        return rms_norm_reference(x_nd, weight_d, eps)
    return _RMSNormTriton.apply(x_nd, None, weight_d, eps)


@register("add_rms_norm", "triton", traced=add_rms_norm_reference)
def add_rms_norm_triton(x_nd: torch.Tensor, residual_nd: torch.Tensor, weight_d: torch.Tensor | None,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    if residual_nd.shape != x_nd.shape or not _triton_ok(x_nd, residual_nd, weight_d):
        return add_rms_norm_reference(x_nd, residual_nd, weight_d, eps)
    return _RMSNormTriton.apply(x_nd, residual_nd, weight_d, eps)


# ----------------------------------------------------------------------------------------------- torch_npu
# UNTESTED HERE (no NPU / CANN in CI). ``torch_npu.npu_rms_norm(x, gamma, epsilon) -> (y, rstd)`` computes
# ``x * rsqrt(mean(x^2) + eps) * gamma`` with fp32 rstd and has an autograd backward (RmsNormGrad); gamma
# must have x's dtype. ``npu_add_rms_norm`` exists but is inference-oriented (no autograd we can rely on),
# so the fused-add variant is the torch add followed by the fused norm. Unweighted: gamma = ones (the
# model's rounding of the factor to x's dtype is not reproduced; differences are within bf16 rounding).
@register("rms_norm", "torch_npu")
def rms_norm_torch_npu(x_nd: torch.Tensor, weight_d: torch.Tensor | None, eps: float) -> torch.Tensor:
    import torch_npu

    if x_nd.dtype not in (torch.float16, torch.bfloat16, torch.float32) or x_nd.numel() == 0:
        return rms_norm_reference(x_nd, weight_d, eps)
    gamma = torch.ones(x_nd.shape[-1], dtype=x_nd.dtype, device=x_nd.device) if weight_d is None \
        else weight_d.to(x_nd.dtype)
    return torch_npu.npu_rms_norm(x_nd, gamma, epsilon=eps)[0]


@register("add_rms_norm", "torch_npu")
def add_rms_norm_torch_npu(x_nd: torch.Tensor, residual_nd: torch.Tensor, weight_d: torch.Tensor | None,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    h_nd = x_nd + residual_nd
    return rms_norm_torch_npu(h_nd, weight_d, eps), h_nd


# ----------------------------------------------------------------------------------------------- public
def rms_norm(x_nd: torch.Tensor, weight_d: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of ``x [..., D]``; ``weight [D]`` or ``None`` (unweighted)."""
    return get("rms_norm", x_nd.device.type)(x_nd, weight_d, eps)


def add_rms_norm(x_nd: torch.Tensor, residual_nd: torch.Tensor, weight_d: torch.Tensor | None,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual), x + residual)``: the residual add fused in front of the norm."""
    return get("add_rms_norm", x_nd.device.type)(x_nd, residual_nd, weight_d, eps)
