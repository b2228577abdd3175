"""Sinkhorn projection of the mHC ``comb`` logits onto (nearly) doubly-stochastic matrices.

``sinkhorn(logits_btnn, iters, eps)`` is exactly ``HyperConnection.forward``'s normalisation of its
pre-softmax logits ``[..., N, N]`` (``comb_w * s_comb + comb_b``)::

    P = softmax(logits, -1) + eps
    P = P / (P.sum(-2) + eps)                  # columns
    repeat iters - 1 times:
        P = P / (P.sum(-1) + eps)              # rows
        P = P / (P.sum(-2) + eps)              # columns

i.e. ``S = 2 * iters - 1`` normalisation steps (step ``k`` normalises columns when ``k`` is even, rows when
odd). Math in (at least) fp32, result cast back to the logits' dtype.

Backends: ``reference`` (torch, autograd, on an ``[N, N, matrices]`` layout; :func:`sinkhorn_formula` is
the definition on the model's layout) and ``triton``: each program holds ``BLOCK_M`` whole ``N x N`` matrices
in registers. The forward runs the ``S`` steps in-kernel. The backward stores nothing but the
logits: to back-propagate through step ``k`` it needs the matrix before that step, which it recomputes from
the softmax (``k`` steps), so it costs ``O(S^2)`` normalisations of ``N^2`` values per matrix (~800 for
``iters = 20``: negligible next to the GEMMs around it) and no extra memory (storing every step's state
would cost ``S * N^2`` floats per token and layer). Through a normalisation ``Y = X / d`` with
``d = sum_axis(X) + eps``: ``dX = (dY - sum_axis(dY * Y)) / d``; through the softmax ``p``:
``dL = p * (dP - sum_j(dP * p))`` (the ``+ eps`` has no gradient). No torch_npu op exists for this.
"""

from __future__ import annotations

from typing import Any

import torch

from kernels.registry import cdiv, empty_output, get, next_pow2, register, triton_dtypes, triton_jit

tl: Any = None  # triton.language, bound by registry.triton_jit on first use

_ELEMS = 2048  # matrix elements a program holds (BLOCK_M * NP * NP)


# ----------------------------------------------------------------------------------------------- reference
def sinkhorn_formula(logits_btnn: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """The definition, on the ``[..., N, N]`` layout (autograd through it)."""
    acc = torch.promote_types(logits_btnn.dtype, torch.float32)
    comb = torch.softmax(logits_btnn.to(acc), dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb.to(logits_btnn.dtype)


@register("sinkhorn", "reference")  # (compiled: traced as it is)
def sinkhorn_reference(logits_btnn: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """:func:`sinkhorn_formula` on the matrices laid out ``[N, N, M]`` (``M`` matrices innermost): every
    sum and division then runs over contiguous rows of ``M`` values instead of ``N``-element inner loops
    (N = 2-4), faster on a CPU; the same operations in the same order per element. Compiled code traces it
    too: inductor then vectorises each step over the matrices (on the formula's layout it vectorised the
    size-``N`` dimension, 2 of 16 lanes busy; fwd + bwd of ``[8, 512, 2, 2]``: 1.9 vs 4.4 ms)."""
    n = logits_btnn.shape[-1]
    acc = torch.promote_types(logits_btnn.dtype, torch.float32)
    l_nnm = logits_btnn.reshape(-1, n, n).permute(1, 2, 0).to(acc).contiguous()  # [row i, column j, matrix]
    comb = torch.softmax(l_nnm, dim=1) + eps
    comb = comb / (comb.sum(dim=0, keepdim=True) + eps)  # columns
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=1, keepdim=True) + eps)  # rows
        comb = comb / (comb.sum(dim=0, keepdim=True) + eps)  # columns
    return comb.permute(2, 0, 1).reshape(logits_btnn.shape).to(logits_btnn.dtype).contiguous()


# ----------------------------------------------------------------------------------------------- triton
def _sinkhorn_fwd_kernel(l_ptr, out_ptr, M, N, iters, eps, BLOCK_M: tl.constexpr, NP: tl.constexpr):
    """``BLOCK_M`` matrices per program, padded to ``NP x NP`` (padding stays 0 through the steps)."""
    m = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    i = tl.arange(0, NP)
    offs = m[:, None, None] * (N * N) + i[None, :, None] * N + i[None, None, :]
    mask = (m < M)[:, None, None] & (i < N)[None, :, None] & (i < N)[None, None, :]
    lg = tl.load(l_ptr + offs, mask=mask, other=-1e30).to(tl.float32)
    e = tl.where(mask, tl.exp(lg - tl.max(lg, axis=2)[:, :, None]), 0.0)
    s = tl.sum(e, axis=2)[:, :, None]
    p = e / tl.where(s > 0.0, s, 1.0)  # row softmax (padding rows/columns: 0)
    x0 = tl.where(mask, p + eps, 0.0)
    x = x0 / (tl.sum(x0, axis=1)[:, None, :] + eps)
    for _ in range(1, iters):
        x = x / (tl.sum(x, axis=2)[:, :, None] + eps)
        x = x / (tl.sum(x, axis=1)[:, None, :] + eps)
    tl.store(out_ptr + offs, x.to(out_ptr.dtype.element_ty), mask=mask)


def _sinkhorn_bwd_kernel(l_ptr, dy_ptr, dl_ptr, M, N, iters, eps, BLOCK_M: tl.constexpr, NP: tl.constexpr):
    """Reverse sweep over the steps, recomputing each step's input from the softmax (see module doc)."""
    m = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    i = tl.arange(0, NP)
    offs = m[:, None, None] * (N * N) + i[None, :, None] * N + i[None, None, :]
    mask = (m < M)[:, None, None] & (i < N)[None, :, None] & (i < N)[None, None, :]
    lg = tl.load(l_ptr + offs, mask=mask, other=-1e30).to(tl.float32)
    e = tl.where(mask, tl.exp(lg - tl.max(lg, axis=2)[:, :, None]), 0.0)
    s = tl.sum(e, axis=2)[:, :, None]
    p = e / tl.where(s > 0.0, s, 1.0)  # row softmax (padding rows/columns: 0)
    x0 = tl.where(mask, p + eps, 0.0)
    g = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    n_steps = 2 * iters - 1
    for kk in range(0, n_steps):
        k = n_steps - 1 - kk
        x = x0
        for j in range(0, k):  # recompute the state before step k
            if j % 2 == 0:
                x = x / (tl.sum(x, axis=1)[:, None, :] + eps)
            else:
                x = x / (tl.sum(x, axis=2)[:, :, None] + eps)
        if k % 2 == 0:  # columns (branch-local names: the two sums have different shapes)
            d_col = tl.sum(x, axis=1)[:, None, :] + eps
            g = (g - tl.sum(g * (x / d_col), axis=1)[:, None, :]) / d_col
        else:  # rows
            d_row = tl.sum(x, axis=2)[:, :, None] + eps
            g = (g - tl.sum(g * (x / d_row), axis=2)[:, :, None]) / d_row
    dl = p * (g - tl.sum(g * p, axis=2)[:, :, None])
    tl.store(dl_ptr + offs, dl.to(dl_ptr.dtype.element_ty), mask=mask)


def _grid(m: int, n: int) -> tuple[int, int, tuple[int]]:
    np_ = next_pow2(n)
    block_m = max(1, min(_ELEMS // (np_ * np_), next_pow2(m)))
    return np_, block_m, (cdiv(m, block_m),)


class _SinkhornTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_btnn: torch.Tensor, iters: int, eps: float):
        n = logits_btnn.shape[-1]
        l2 = logits_btnn.reshape(-1, n, n).contiguous()
        m = l2.shape[0]
        out = empty_output(l2.shape, l2.dtype, l2.device)
        np_, block_m, grid = _grid(m, n)
        triton_jit(_sinkhorn_fwd_kernel)[grid](l2, out, m, n, iters, eps, BLOCK_M=block_m, NP=np_)
        ctx.save_for_backward(l2)
        ctx.iters, ctx.eps, ctx.shape = iters, eps, logits_btnn.shape
        return out.view(logits_btnn.shape)

    @staticmethod
    def backward(ctx, dy_btnn):
        (l2,) = ctx.saved_tensors
        m, n, _ = l2.shape
        dy = dy_btnn.reshape(m, n, n).contiguous()
        dl = empty_output(l2.shape, l2.dtype, l2.device)
        np_, block_m, grid = _grid(m, n)
        triton_jit(_sinkhorn_bwd_kernel)[grid](l2, dy, dl, m, n, ctx.iters, ctx.eps, BLOCK_M=block_m, NP=np_)
        return dl.view(ctx.shape), None, None


@register("sinkhorn", "triton", traced=sinkhorn_formula)  # (compiled: inductor fuses it)
def sinkhorn_triton(logits_btnn: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    n = logits_btnn.shape[-1]
    if (logits_btnn.dim() < 2 or logits_btnn.shape[-2] != n or logits_btnn.numel() == 0 or iters < 1
            or next_pow2(n) ** 2 > _ELEMS or not triton_dtypes(logits_btnn)):
        return sinkhorn_reference(logits_btnn, iters, eps)
    return _SinkhornTriton.apply(logits_btnn, int(iters), float(eps))


# ----------------------------------------------------------------------------------------------- public
def sinkhorn(logits_btnn: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """The doubly-stochastic ``comb [..., N, N]`` from its pre-softmax logits, as ``HyperConnection``."""
    return get("sinkhorn", logits_btnn.device.type)(logits_btnn, iters, eps)
