"""The element-wise work of the CPU routed-expert path (``grouped_gemm._MoEExpertsLoop``), one chunk of
expert-sorted rows at a time: the clamped SwiGLU forward, and backward its gradient, the router-weight gradient
and the weighted activations the down projection's weight gradient needs; and the per-token sum of the expert
rows (:func:`combine`, forward and backward).

Two forms with the same mathematics:

- eager (the default): torch ops into the caller's scratch buffers, in place where possible -- the model's own
  ops, so the forward rounds exactly as the model's ``swiglu`` does;
- fused (:func:`fuse`): pure functions compiled by ``torch.compile`` (``dynamic=True``: a chunk's row count
  varies), one or two C++ loops where eager runs ~17 passes over ``[rows, I]``. Inductor computes 16-bit inputs
  in fp32 and rounds once, so the forward's 16-bit output can differ from eager by one rounding. Measured on the
  2-core Xeon (bf16, 2,048 rows x I 512): backward 1.0 ms vs 3.8 ms eager per chunk. The training engines turn it
  on with the model's own compilation (``train.<stage>.compile``); a first compile costs ~5-10 s (cached on disk
  afterwards).
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F

hardtanh_bwd = torch.ops.aten.hardtanh_backward  # (grad, x, lo, hi): grad where lo < x < hi, else 0

_FUSED: dict[str, Callable] = {}  # "act" / "act_grad" -> compiled pure function, while fused


def fuse(backend: Callable | str | None = "inductor") -> None:
    """Run the chunk math through ``torch.compile(backend=backend, dynamic=True)`` from now on in this process;
    ``None``: back to the eager ops. (Compilation happens on the first chunk of each dtype.)"""
    _FUSED.clear()
    if backend is not None:
        _FUSED["act"] = torch.compile(_act_pure, backend=backend, dynamic=True)
        _FUSED["act_grad"] = torch.compile(_act_grad_pure, backend=backend, dynamic=True)
        _FUSED["combine"] = torch.compile(combine_rows, backend=backend, dynamic=True)


def fused() -> bool:
    return bool(_FUSED)


# --------------------------------------------------------------------------------------------- forward
def act(g_mi: torch.Tensor, u_mi: torch.Tensor, limit: float, a_buf: torch.Tensor, c_buf: torch.Tensor
        ) -> torch.Tensor:
    """``silu(min(g, limit)) * clamp(u, -limit, limit)`` (``[rows, I]``); eager: into ``a_buf`` (``c_buf`` is
    scratch), the model's ops in place."""
    if _FUSED:
        return _FUSED["act"](g_mi, u_mi, limit)
    return act_eager(g_mi, u_mi, limit, a_buf, c_buf)


def act_eager(g_mi: torch.Tensor, u_mi: torch.Tensor, limit: float, a_buf: torch.Tensor, c_buf: torch.Tensor
              ) -> torch.Tensor:
    F.silu(torch.clamp(g_mi, max=limit, out=a_buf), inplace=True)
    return a_buf.mul_(torch.clamp(u_mi, min=-limit, max=limit, out=c_buf))


def _act_pure(g_mi: torch.Tensor, u_mi: torch.Tensor, limit: float) -> torch.Tensor:
    return F.silu(g_mi.clamp(max=limit)) * u_mi.clamp(min=-limit, max=limit)


# -------------------------------------------------------------------------------------------- backward
def act_grad(g_mi: torch.Tensor, u_mi: torch.Tensor, da_mi: torch.Tensor, w_m1: torch.Tensor, limit: float,
             lo: float, hi: float, need_dw: bool, need_aw: bool):
    """From the saved pre-activations ``g``/``u`` (``[rows, I]``, the expert dtype), the gradient ``da`` of the
    (unweighted) activation and the rows' routing weights ``w_m1`` (fp32 ``[rows, 1]``): ``(dw_m, a_w, du, dg)``
    -- the router-weight gradient ``<da, a>`` (fp32, if ``need_dw``), the weighted activations ``a * w`` (if
    ``need_aw``), and the gradients of ``u`` and ``g`` (expert dtype), computed in fp32. The clamps pass the
    gradient where their bound holds, inclusive like ``torch.clamp``: ``lo``/``hi`` are the bounds widened by
    one fp32 ulp, for ``hardtanh_backward``'s strict inequalities."""
    if _FUSED:
        return _FUSED["act_grad"](g_mi, u_mi, da_mi, w_m1, limit, lo, hi, need_dw, need_aw)
    return act_grad_eager(g_mi, u_mi, da_mi, w_m1, limit, lo, hi, need_dw, need_aw)


def act_grad_eager(g_mi, u_mi, da_mi, w_m1, limit: float, lo: float, hi: float, need_dw: bool, need_aw: bool):
    dtype = g_mi.dtype
    g, u = g_mi.float(), u_mi.float()  # fp32 element-wise (a copy for 16-bit)
    gc, uc = g.clamp(max=limit), u.clamp(min=-limit, max=limit)
    silu = F.silu(gc)
    a, da = silu * uc, da_mi.float()
    dw_m = torch.linalg.vecdot(da, a) if need_dw else None
    a_w = a.mul_(w_m1).to(dtype) if need_aw else None
    da.mul_(w_m1)
    du = hardtanh_bwd(da * silu, u, lo, hi).to(dtype)
    dg = hardtanh_bwd(torch.ops.aten.silu_backward(da.mul_(uc), gc), g, -math.inf, hi).to(dtype)
    return dw_m, a_w, du, dg


def _act_grad_pure(g_mi, u_mi, da_mi, w_m1, limit: float, lo: float, hi: float, need_dw: bool, need_aw: bool):
    dtype = g_mi.dtype
    g, u = g_mi.float(), u_mi.float()
    gc, uc = g.clamp(max=limit), u.clamp(min=-limit, max=limit)
    silu = F.silu(gc)
    a, da = silu * uc, da_mi.float()
    dw_m = (da * a).sum(-1) if need_dw else None
    a_w = (a * w_m1).to(dtype) if need_aw else None
    da = da * w_m1
    du = hardtanh_bwd(da * silu, u, lo, hi).to(dtype)
    dg = hardtanh_bwd(torch.ops.aten.silu_backward(da * uc, gc), g, -math.inf, hi).to(dtype)
    return dw_m, a_w, du, dg


# ---------------------------------------------------------------------------------------------- combine
def combine(rows_md: torch.Tensor, pos_nk: torch.Tensor, w_nk: torch.Tensor | None) -> torch.Tensor:
    """``out[t] = sum_j w[t, j] * rows[pos[t, j]]`` (``w`` None: weights 1), summed in fp32 for 16-bit rows
    and returned in the rows' dtype: each token's ``k`` expert rows of the sorted layout. For ``k <= 2`` the
    values equal accumulating the rows into a zeroed fp32 tensor in any order (``0 + a + b = a + b``)."""
    if _FUSED:
        return _FUSED["combine"](rows_md, pos_nk, w_nk)
    return combine_rows(rows_md, pos_nk, w_nk)


def combine_rows(rows_md: torch.Tensor, pos_nk: torch.Tensor, w_nk: torch.Tensor | None) -> torch.Tensor:
    """:func:`combine` one choice at a time (a row gather per ``j``), eagerly or as inductor compiles it (one
    vectorised loop): compiled 0.48 ms for bench_20m's 4096 x 2 bf16 rows of 512, eagerly 3.2 ms; a gather of
    ``[N, k, D]`` and a sum over ``k`` compiled to 47 ms (the reduction innermost, scalar)."""
    acc = torch.promote_types(rows_md.dtype, torch.float32)
    out = None
    for j in range(pos_nk.shape[1]):
        picked = rows_md[pos_nk[:, j]].to(acc)
        if w_nk is not None:
            picked = picked * w_nk[:, j:j + 1].to(acc)
        out = picked if out is None else out + picked
    return out.to(rows_md.dtype)
