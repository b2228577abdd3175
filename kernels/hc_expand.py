"""mHC expansion: a block's output written back into the ``N`` residual streams, which ``comb`` mixes.

``hc_expand(post_btn, comb_btnn, y_btd, x_btnd) -> [B, T, N, D]``::

    out[..., n, :] = post[..., n] * y[..., :] + sum_m comb[..., m, n] * x[..., m, :]

i.e. ``post.unsqueeze(-1) * y.unsqueeze(-2) + comb^T @ x`` (``Block.forward``). Math in ``x``'s dtype
(``post`` / ``comb`` / ``y`` cast to it), also under autocast: the residual streams are not rounded to bf16
by a mixing product.

Backend ``reference``: forward into one output (the outer product ``post y^T``, then ``comb^T x`` accumulated
in place, one multiply-add per source stream: no ``[B, T, N, D]`` temporary), backward with one broadcast
product per output::

    dy = sum_n post_n g_n,   dpost_n = <g_n, y>,   dcomb_mn = <x_m, g_n>,   dx_m = sum_n comb_mn g_n

Element-wise over the ``N`` (2-4) streams, not batched ``N x N`` matrix products: a CPU's batched GEMM runs
these shapes at 1-6 GFLOP/s (``[R, 2, 1] x [R, 1, D]`` took 3.3 ms where the broadcast product takes 0.2 ms,
2 vCPUs of an AMD EPYC), ~4 % of the tiny model's training step. (Autograd through the broadcast formula
would reduce over broadcast dimensions and keep ``[B, T, N, N, D]`` temporaries.)
:func:`hc_expand_formula` is the definition.
"""

from __future__ import annotations

from typing import Any

import torch

from kernels.registry import empty_output, get, next_pow2, register, triton_dtypes, triton_jit

tl: Any = None  # triton.language, bound by registry.triton_jit on first use

_ELEMS = 4096  # stream elements a program holds per chunk (NP * BLOCK_D)


def hc_expand_formula(post_btn: torch.Tensor, comb_btnn: torch.Tensor, y_btd: torch.Tensor,
                      x_btnd: torch.Tensor) -> torch.Tensor:
    """The definition (autograd through it), in ``x``'s dtype whatever the autocast state. ``comb^T x`` is a
    broadcast product summed over the source stream, not a ``matmul``: compiled code runs this function, and
    inductor fuses the sum into one loop where a batched product of ``N x N`` matrices stays an external ``bmm``
    (4 GFLOP/s on a CPU for N = 2: ~4 % of a compiled bench_20m step, forward and backward)."""
    dtype = x_btnd.dtype
    with torch.autocast(x_btnd.device.type, enabled=False):
        mixed_btnd = (comb_btnn.to(dtype).unsqueeze(-1) * x_btnd.unsqueeze(-2)).sum(-3)  # sum_m comb[m, n] x[m]
        return post_btn.to(dtype).unsqueeze(-1) * y_btd.to(dtype).unsqueeze(-2) + mixed_btnd


@register("hc_expand", "reference", traced=hc_expand_formula)  # (compiled: inductor fuses the definition)
def hc_expand_reference(post_btn: torch.Tensor, comb_btnn: torch.Tensor, y_btd: torch.Tensor,
                        x_btnd: torch.Tensor) -> torch.Tensor:
    return _HcExpand.apply(post_btn, comb_btnn, y_btd, x_btnd)


class _HcExpand(torch.autograd.Function):
    @staticmethod
    def forward(ctx, post_btn, comb_btnn, y_btd, x_btnd):
        n, dtype = x_btnd.shape[-2], x_btnd.dtype
        with torch.autocast(x_btnd.device.type, enabled=False):
            post_btn1 = post_btn.to(dtype).unsqueeze(-1)
            comb_btnn = comb_btnn.to(dtype)
            y_bt1d = y_btd.to(dtype).unsqueeze(-2)
            out_btnd = post_btn1 * y_bt1d  # (a base tensor, not a view: pipelining detaches it)
            for m in range(n):  # += comb[m, n] * x[m] for every target stream n
                out_btnd.addcmul_(comb_btnn[..., m, :].unsqueeze(-1), x_btnd[..., m:m + 1, :])
        ctx.save_for_backward(post_btn1, comb_btnn, y_btd, x_btnd)
        ctx.dtypes = (post_btn.dtype, comb_btnn.dtype, y_btd.dtype)
        return out_btnd

    @staticmethod
    def backward(ctx, g_btnd: torch.Tensor):
        post_btn1, comb_btnn, y_btd, x_btnd = ctx.saved_tensors
        n = x_btnd.shape[-2]
        need = ctx.needs_input_grad
        dpost = dcomb = dy = dx = None
        with torch.autocast(g_btnd.device.type, enabled=False):
            g_btnd = g_btnd.to(x_btnd.dtype)
            if need[0]:
                dpost = (g_btnd * y_btd.to(x_btnd.dtype).unsqueeze(-2)).sum(-1).to(ctx.dtypes[0])
            if need[1]:  # dcomb[m, n] = <x_m, g_n>
                dcomb = torch.stack([(g_btnd * x_btnd[..., m:m + 1, :]).sum(-1) for m in range(n)], dim=-2)
                dcomb = dcomb.to(ctx.dtypes[1])
            if need[2]:
                dy = (g_btnd * post_btn1).sum(-2).to(ctx.dtypes[2])
            if need[3]:  # dx[m] = sum_n comb[m, n] g_n (a base tensor: autograd can add into it in place)
                dx = comb_btnn[..., 0:1] * g_btnd[..., 0:1, :]
                for j in range(1, n):
                    dx.addcmul_(comb_btnn[..., j:j + 1], g_btnd[..., j:j + 1, :])
        return dpost, dcomb, dy, dx


# ----------------------------------------------------------------------------------------------- triton
def _hc_expand_fwd_kernel(post_ptr, comb_ptr, y_ptr, x_ptr, out_ptr, N, D,
                          NP: tl.constexpr, BLOCK_D: tl.constexpr):
    """One row (token) per program: ``out[n, :] = post[n] y + sum_m comb[m, n] x[m, :]``, fp32 math, the ``N``
    streams padded to ``NP`` and ``D`` walked in chunks of ``BLOCK_D``: x read once, out written once."""
    r = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, NP)
    post = tl.load(post_ptr + r * N + i, mask=i < N, other=0.0).to(tl.float32)  # [NP]
    cmask = (i < N)[:, None] & (i < N)[None, :]
    comb = tl.load(comb_ptr + r * N * N + i[:, None] * N + i[None, :], mask=cmask, other=0.0).to(tl.float32)
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        xmask = (i < N)[:, None] & (d < D)[None, :]
        y = tl.load(y_ptr + r * D + d, mask=d < D, other=0.0).to(tl.float32)  # [BLOCK_D]
        x = tl.load(x_ptr + r * N * D + i[:, None] * D + d[None, :], mask=xmask, other=0.0).to(tl.float32)
        mixed = tl.sum(comb[:, :, None] * x[:, None, :], axis=0)  # [NP(n), BLOCK_D]: sum over the source m
        out = post[:, None] * y[None, :] + mixed
        tl.store(out_ptr + r * N * D + i[:, None] * D + d[None, :], out.to(out_ptr.dtype.element_ty), mask=xmask)


def _hc_expand_bwd_kernel(post_ptr, comb_ptr, y_ptr, x_ptr, g_ptr, dpost_ptr, dcomb_ptr, dy_ptr, dx_ptr, N, D,
                          NP: tl.constexpr, BLOCK_D: tl.constexpr):
    """One row per program: ``dy = sum_n post_n g_n``, ``dx_m = sum_n comb_mn g_n`` per chunk; ``dpost_n = <g_n,
    y>`` and ``dcomb_mn = <x_m, g_n>`` accumulated in fp32 over the chunks."""
    r = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, NP)
    post = tl.load(post_ptr + r * N + i, mask=i < N, other=0.0).to(tl.float32)
    cmask = (i < N)[:, None] & (i < N)[None, :]
    comb = tl.load(comb_ptr + r * N * N + i[:, None] * N + i[None, :], mask=cmask, other=0.0).to(tl.float32)
    dpost = tl.zeros([NP], dtype=tl.float32)
    dcomb = tl.zeros([NP, NP], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        xmask = (i < N)[:, None] & (d < D)[None, :]
        offs = r * N * D + i[:, None] * D + d[None, :]
        y = tl.load(y_ptr + r * D + d, mask=d < D, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + offs, mask=xmask, other=0.0).to(tl.float32)  # [NP(m), BLOCK_D]
        g = tl.load(g_ptr + offs, mask=xmask, other=0.0).to(tl.float32)  # [NP(n), BLOCK_D]
        tl.store(dy_ptr + r * D + d, tl.sum(post[:, None] * g, axis=0).to(dy_ptr.dtype.element_ty), mask=d < D)
        dx = tl.sum(comb[:, :, None] * g[None, :, :], axis=1)  # [NP(m), BLOCK_D]: sum over the target n
        tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=xmask)
        dpost += tl.sum(g * y[None, :], axis=1)
        dcomb += tl.sum(x[:, None, :] * g[None, :, :], axis=2)
    tl.store(dpost_ptr + r * N + i, dpost.to(dpost_ptr.dtype.element_ty), mask=i < N)
    tl.store(dcomb_ptr + r * N * N + i[:, None] * N + i[None, :], dcomb.to(dcomb_ptr.dtype.element_ty), mask=cmask)


def _blocks(n: int, d: int) -> tuple[int, int]:
    np_ = next_pow2(n)
    return np_, max(16, min(next_pow2(d), _ELEMS // (np_ * np_)))  # (the [NP, NP, BLOCK_D] product)


class _HcExpandTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, post_btn, comb_btnn, y_btd, x_btnd):
        n, d = x_btnd.shape[-2:]
        post, comb = post_btn.reshape(-1, n).contiguous(), comb_btnn.reshape(-1, n, n).contiguous()
        y, x = y_btd.reshape(-1, d).contiguous(), x_btnd.reshape(-1, n, d).contiguous()
        out = empty_output(tuple(x_btnd.shape), x.dtype, x.device)  # (a base tensor, not a view: pipelining
        np_, block_d = _blocks(n, d)                                   # detaches it in place)
        triton_jit(_hc_expand_fwd_kernel)[(x.shape[0],)](post, comb, y, x, out, n, d, NP=np_, BLOCK_D=block_d)
        ctx.save_for_backward(post, comb, y, x)
        ctx.shapes = (post_btn.shape, comb_btnn.shape, y_btd.shape, x_btnd.shape)
        return out

    @staticmethod
    def backward(ctx, g_btnd):
        post, comb, y, x = ctx.saved_tensors
        n, d = x.shape[-2:]
        g = g_btnd.reshape(-1, n, d).contiguous()
        # the gradients as base tensors of the inputs' shapes (autograd accumulates into the streams' in place)
        dpost, dcomb, dy, dx = (empty_output(tuple(shape), t.dtype, t.device)
                                for shape, t in zip(ctx.shapes, (post, comb, y, x)))
        np_, block_d = _blocks(n, d)
        triton_jit(_hc_expand_bwd_kernel)[(x.shape[0],)](post, comb, y, x, g, dpost, dcomb, dy, dx, n, d,
                                                         NP=np_, BLOCK_D=block_d)
        return dpost, dcomb, dy, dx


@register("hc_expand", "triton", traced=hc_expand_formula)  # (compiled: inductor fuses the definition)
def hc_expand_triton(post_btn: torch.Tensor, comb_btnn: torch.Tensor, y_btd: torch.Tensor,
                     x_btnd: torch.Tensor) -> torch.Tensor:
    """One pass over the streams forward, one backward (the reference makes ``N + 1`` and ~``3N``): fp32 math,
    stored in each input's dtype (``x``'s for the output). Rounds once where the reference rounds per step in a
    16-bit ``x`` dtype (within one ulp)."""
    if x_btnd.numel() == 0 or not triton_dtypes(post_btn, comb_btnn, y_btd, x_btnd):
        return hc_expand_reference(post_btn, comb_btnn, y_btd, x_btnd)
    return _HcExpandTriton.apply(post_btn, comb_btnn, y_btd, x_btnd)


# ----------------------------------------------------------------------------------------------- public
def hc_expand(post_btn: torch.Tensor, comb_btnn: torch.Tensor, y_btd: torch.Tensor,
              x_btnd: torch.Tensor) -> torch.Tensor:
    """``post ⊗ y + comb^T @ x`` over the ``N`` streams (``[B, T, N]``, ``[B, T, N, N]``, ``[B, T, D]``,
    ``[B, T, N, D]`` -> ``[B, T, N, D]``)."""
    return get("hc_expand", x_btnd.device.type)(post_btn, comb_btnn, y_btd, x_btnd)
