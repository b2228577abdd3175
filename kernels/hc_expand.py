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

import torch

from kernels.registry import get, register


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


def hc_expand(post_btn: torch.Tensor, comb_btnn: torch.Tensor, y_btd: torch.Tensor,
              x_btnd: torch.Tensor) -> torch.Tensor:
    """``post ⊗ y + comb^T @ x`` over the ``N`` streams (``[B, T, N]``, ``[B, T, N, N]``, ``[B, T, D]``,
    ``[B, T, N, D]`` -> ``[B, T, N, D]``)."""
    return get("hc_expand", x_btnd.device.type)(post_btn, comb_btnn, y_btd, x_btnd)
