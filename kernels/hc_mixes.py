"""mHC mixing weights: the ``N`` residual streams, RMS-normalised together, times the ``fn`` projection.

``hc_mixes(x_bk, fn_mk, eps) -> mixes_bm`` (fp32; fp64 for fp64 inputs) is ``HyperConnection``'s (and ``HyperHead``'s)
``F.linear(unweighted_rms_norm(x.float(), eps), fn.float())`` on ``x [..., K]`` (the ``N`` streams of width
``D`` flattened, ``K = N * D``) and ``fn [M, K]`` (``M = (2 + N) * N`` pre / post / comb weights, or ``N`` for
the head). Always fp32, also under autocast: the weights feed a sigmoid and a Sinkhorn projection.

Backend ``reference``: the per-row factor ``r = rsqrt(mean(x^2) + eps)`` commutes with the projection, so it
computes ``(x @ fn^T) * r`` and never writes the normalised copy of ``x`` (a tensor as large as the residual
streams); the backward is analytic, from ``x`` and the ``[.., M]`` outputs only::

    g_s   = g * r                                    # [.., M]
    dx    = g_s @ fn - x * r^2 / K * sum_m(g * mixes) # one GEMM + one fused multiply-add over x
    dfn   = g_s^T @ x

(autograd through the formula needs ~3x the passes over ``x`` on a CPU). Values agree with the formula to fp32
rounding (the product and the scaling are done in the other order). :func:`hc_mixes_formula` is the definition.
No Triton / torch_npu kernel: the GEMM dominates and is already one call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.registry import get, register
from kernels.rms_norm import rms_norm_formula


def hc_mixes_formula(x_bk: torch.Tensor, fn_mk: torch.Tensor, eps: float) -> torch.Tensor:
    """The definition (autograd through every step), in fp32 whatever the autocast state."""
    with torch.autocast(x_bk.device.type, enabled=False):
        acc = _acc(x_bk)
        return F.linear(rms_norm_formula(x_bk.to(acc), None, eps), fn_mk.to(acc))


def hc_mixes_commuted(x_bk: torch.Tensor, fn_mk: torch.Tensor, eps: float) -> torch.Tensor:
    """What compiled code traces: ``(x @ fn^T) * rsqrt(mean(x^2) + eps)``, the reference's order, with autograd.
    Traced, the formula writes the normalised copy of ``x`` for the external GEMM (and its backward passes over
    it); here inductor fuses the row statistics into one pass over ``x`` and the backward into one more (one
    mHC block of bench_20m, forward + backward, compiled: 22.7 vs 25.2 ms)."""
    with torch.autocast(x_bk.device.type, enabled=False):
        acc = _acc(x_bk)
        x = x_bk.to(acc)
        rstd = torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)
        return F.linear(x, fn_mk.to(acc)) * rstd


@register("hc_mixes", "reference", traced=hc_mixes_commuted)  # (compiled: inductor fuses the commuted form)
def hc_mixes_reference(x_bk: torch.Tensor, fn_mk: torch.Tensor, eps: float) -> torch.Tensor:
    return _HcMixes.apply(x_bk, fn_mk, eps)


def _acc(x: torch.Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)  # at least fp32 (fp64 stays fp64)


class _HcMixes(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_bk: torch.Tensor, fn_mk: torch.Tensor, eps: float) -> torch.Tensor:
        lead, k = x_bk.shape[:-1], x_bk.shape[-1]
        with torch.autocast(x_bk.device.type, enabled=False):
            acc = _acc(x_bk)
            x_nk = x_bk.reshape(-1, k).to(acc)
            fn = fn_mk.to(acc)
            rstd_n1 = torch.rsqrt(torch.linalg.vector_norm(x_nk, dim=-1, keepdim=True).square_().div_(k).add_(eps))
            mixes_bm = torch.empty(*lead, fn_mk.shape[0], dtype=acc, device=x_bk.device)  # a base, not a view
            mixes_nm = mixes_bm.view(-1, fn_mk.shape[0])
            torch.mm(x_nk, fn.t(), out=mixes_nm).mul_(rstd_n1)
        ctx.save_for_backward(x_bk, fn_mk, rstd_n1, mixes_bm)
        return mixes_bm

    @staticmethod
    def backward(ctx, g_bm: torch.Tensor):
        x_bk, fn_mk, rstd_n1, mixes_bm = ctx.saved_tensors
        mixes_nm = mixes_bm.reshape(-1, mixes_bm.shape[-1])
        k = x_bk.shape[-1]
        dx = dfn = None
        with torch.autocast(x_bk.device.type, enabled=False):
            acc = _acc(x_bk)
            x_nk = x_bk.reshape(-1, k).to(acc)
            g_nm = g_bm.reshape(-1, g_bm.shape[-1]).to(acc)
            gs_nm = g_nm * rstd_n1
            if ctx.needs_input_grad[0]:
                coef_n1 = (g_nm * mixes_nm).sum(-1, keepdim=True).mul_(rstd_n1.square()).div_(-k)
                dx = torch.empty(x_bk.shape, dtype=acc, device=x_bk.device)  # a base tensor (see hc_expand)
                torch.mul(x_nk, coef_n1, out=dx.view(-1, k)).addmm_(gs_nm, fn_mk.to(acc))
                dx = dx.to(x_bk.dtype)
            if ctx.needs_input_grad[1]:
                dfn = (gs_nm.t() @ x_nk).to(fn_mk.dtype)
        return dx, dfn, None


def hc_mixes(x_bk: torch.Tensor, fn_mk: torch.Tensor, eps: float) -> torch.Tensor:
    """``rms_norm(x) @ fn^T`` in fp32 (``[..., K] x [M, K] -> [..., M]``): the mHC pre / post / comb weights."""
    return get("hc_mixes", x_bk.device.type)(x_bk, fn_mk, eps)
