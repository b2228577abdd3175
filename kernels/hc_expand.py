"""mHC expansion: a block's output written back into the ``N`` residual streams, which ``comb`` mixes.

``hc_expand(post_btn, comb_btnn, y_btd, x_btnd) -> [B, T, N, D]``::

    out[..., n, :] = post[..., n] * y[..., :] + sum_m comb[..., m, n] * x[..., m, :]

i.e. ``post.unsqueeze(-1) * y.unsqueeze(-2) + comb^T @ x`` (``Block.forward``). Math in ``x``'s dtype
(``post`` / ``comb`` / ``y`` cast to it), also under autocast: the residual streams are not rounded to bf16
by a mixing product.

Backend ``reference``: forward as two batched products into one output (the outer product ``post y^T``,
then ``comb^T x`` accumulated in place: no ``[B, T, N, D]`` temporary), backward as four batched products on
contiguous operands::

    dy = post^T @ g,   dpost = g @ y,   dcomb = (g @ x^T)^T,   dx = comb @ g

(autograd through the broadcast formula reduces over broadcast dimensions and hits a per-matrix fallback of
``bmm`` for the transposed ``comb``, ~3x slower on a CPU). :func:`hc_expand_formula` is the definition.
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
        n, d, dtype = x_btnd.shape[-2], x_btnd.shape[-1], x_btnd.dtype
        with torch.autocast(x_btnd.device.type, enabled=False):
            post_rn1 = post_btn.reshape(-1, n, 1).to(dtype)
            comb_rmn = comb_btnn.reshape(-1, n, n).to(dtype)
            y_r1d = y_btd.reshape(-1, 1, d).to(dtype)
            x_rmd = x_btnd.reshape(-1, n, d)
            out_btnd = torch.empty(x_btnd.shape, dtype=dtype, device=x_btnd.device)  # (returned as a base, not
            out_rnd = out_btnd.view(-1, n, d)                                          # a view: pipelining detaches it)
            torch.bmm(post_rn1, y_r1d, out=out_rnd).baddbmm_(comb_rmn.transpose(1, 2).contiguous(), x_rmd)
        ctx.save_for_backward(post_rn1, comb_rmn, y_btd, x_rmd)
        ctx.dtypes = (post_btn.dtype, comb_btnn.dtype, y_btd.dtype)
        return out_btnd

    @staticmethod
    def backward(ctx, g_btnd: torch.Tensor):
        post_rn1, comb_rmn, y_btd, x_rmd = ctx.saved_tensors
        lead = g_btnd.shape[:-2]
        n, d = x_rmd.shape[-2:]
        need = ctx.needs_input_grad
        dpost = dcomb = dy = dx = None
        with torch.autocast(g_btnd.device.type, enabled=False):
            g_rnd = g_btnd.reshape(-1, n, d).to(x_rmd.dtype).contiguous()
            if need[0]:
                y_r1d = y_btd.reshape(-1, 1, d).to(x_rmd.dtype)
                dpost = torch.bmm(g_rnd, y_r1d.transpose(1, 2)).view(*lead, n).to(ctx.dtypes[0])
            if need[1]:
                dcomb = torch.bmm(x_rmd, g_rnd.transpose(1, 2)).view(*lead, n, n).to(ctx.dtypes[1])
            if need[2]:
                dy = torch.bmm(post_rn1.transpose(1, 2), g_rnd).view(*lead, d).to(ctx.dtypes[2])
            if need[3]:  # a base tensor: autograd can add the streams' other gradients into it in place
                dx = torch.empty((*lead, n, d), dtype=x_rmd.dtype, device=x_rmd.device)
                torch.bmm(comb_rmn, g_rnd, out=dx.view(-1, n, d))
        return dpost, dcomb, dy, dx


def hc_expand(post_btn: torch.Tensor, comb_btnn: torch.Tensor, y_btd: torch.Tensor,
              x_btnd: torch.Tensor) -> torch.Tensor:
    """``post ⊗ y + comb^T @ x`` over the ``N`` streams (``[B, T, N]``, ``[B, T, N, N]``, ``[B, T, D]``,
    ``[B, T, N, D]`` -> ``[B, T, N, D]``)."""
    return get("hc_expand", x_btnd.device.type)(post_btn, comb_btnn, y_btd, x_btnd)
