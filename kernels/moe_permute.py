"""MoE token permutation: sort token copies by expert, and scatter expert outputs back, weighted.

``permute(x_nd, indices_nk, n_experts)`` -> ``(x_sorted_md, counts_e, order_m)`` with ``M = N * k``:
``order_m`` is the stable argsort of the flattened ``indices_nk`` (row ``m`` of ``x_sorted`` is token
``order[m] // k``'s ``order[m] % k``-th choice), ``counts_e`` the tokens per expert (zeros allowed).

``unpermute(y_sorted_md, order_m, weights_nk, n)`` -> ``y_nd[t] = sum_j weights[t, j] * y_sorted[pos(t, j)]``.

Both are differentiable (x, y_sorted, weights). Backends: ``reference`` (argsort, gather, ``index_add``;
the model's own code), ``triton`` (deterministic gather-reduce kernels, no atomics; the sort stays in torch),
``torch_npu`` (``npu_moe_init_routing_v2`` / ``npu_moe_finalize_routing``; untested here).
"""

from __future__ import annotations

from typing import Any

import torch

from kernels.registry import cdiv, empty_output, get, register, triton_dtypes, triton_jit

tl: Any = None  # triton.language, bound by registry.triton_jit on first use (never imported at import time)


def _n_experts(indices_nk: torch.Tensor, n_experts: int | None) -> int:
    if n_experts is not None:
        return n_experts
    return int(indices_nk.max()) + 1 if indices_nk.numel() else 0


def inverse_order(order_m: torch.Tensor) -> torch.Tensor:
    """``pos[i]``: the sorted row holding flat choice ``i`` (the inverse permutation of ``order``)."""
    pos = torch.empty_like(order_m)
    pos[order_m] = torch.arange(order_m.numel(), device=order_m.device, dtype=order_m.dtype)
    return pos


# ------------------------------------------------------------------------------------------- reference
@register("moe_permute", "reference")
def permute_reference(x_nd: torch.Tensor, indices_nk: torch.Tensor, n_experts: int | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    k = indices_nk.shape[1]
    flat_m = indices_nk.reshape(-1)
    order_m = torch.argsort(flat_m, stable=True)
    counts_e = torch.bincount(flat_m, minlength=_n_experts(indices_nk, n_experts))
    return x_nd[order_m // k], counts_e, order_m


@register("moe_unpermute", "reference")
def unpermute_reference(y_sorted_md: torch.Tensor, order_m: torch.Tensor, weights_nk: torch.Tensor,
                        n: int) -> torch.Tensor:
    k = weights_nk.shape[1]
    weighted_md = y_sorted_md * weights_nk.reshape(-1)[order_m, None].to(y_sorted_md.dtype)
    y_nd = torch.zeros(n, y_sorted_md.shape[1], dtype=y_sorted_md.dtype, device=y_sorted_md.device)
    return y_nd.index_add_(0, order_m // k, weighted_md)


# ---------------------------------------------------------------------------------------------- triton
def _gather_reduce_kernel(src_ptr, pos_ptr, w_ptr, out_ptr, K, D, stride_s, stride_o,
                          HAS_W: tl.constexpr, BLOCK_D: tl.constexpr):
    """out[t, :] = sum_j w[t, j] * src[pos[t * K + j], :]   (fp32 accumulation, no atomics)."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = cols < D
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for j in range(0, K):
        row = tl.load(pos_ptr + t * K + j).to(tl.int64)
        v = tl.load(src_ptr + row * stride_s + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_W:
            v = v * tl.load(w_ptr + t * K + j).to(tl.float32)
        acc += v
    tl.store(out_ptr + t * stride_o + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _unpermute_bwd_kernel(dy_ptr, ys_ptr, order_ptr, w_ptr, dys_ptr, dw_ptr, K, D, stride_dy, stride_ys,
                          stride_dys, BLOCK_D: tl.constexpr):
    """Per sorted row m (choice i = order[m], token t = i // K):
    d_ys[m] = w[i] * dy[t];  dw[i] = <dy[t], ys[m]>   (unique writes, no atomics)."""
    m = tl.program_id(0).to(tl.int64)
    i = tl.load(order_ptr + m).to(tl.int64)
    t = i // K
    w = tl.load(w_ptr + i).to(tl.float32)
    dot = tl.zeros([BLOCK_D], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        mask = cols < D
        g = tl.load(dy_ptr + t * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
        y = tl.load(ys_ptr + m * stride_ys + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(dys_ptr + m * stride_dys + cols, (w * g).to(dys_ptr.dtype.element_ty), mask=mask)
        dot += g * y
    tl.store(dw_ptr + i, tl.sum(dot, axis=0).to(dw_ptr.dtype.element_ty))


def _gather_reduce(src_md: torch.Tensor, pos_m: torch.Tensor, w_nk: torch.Tensor | None, n: int, k: int,
                   block_d: int) -> torch.Tensor:
    src_md = src_md.contiguous()
    d = src_md.shape[1]
    out_nd = empty_output((n, d), src_md.dtype, src_md.device)
    if n and d:
        w = w_nk.contiguous() if w_nk is not None else pos_m  # dummy pointer when HAS_W is False
        triton_jit(_gather_reduce_kernel)[(n, cdiv(d, block_d))](
            src_md, pos_m, w, out_nd, k, d, src_md.stride(0), out_nd.stride(0), HAS_W=w_nk is not None,
            BLOCK_D=block_d)
    return out_nd


class _PermuteTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_nd: torch.Tensor, order_m: torch.Tensor, pos_m: torch.Tensor, k: int, block_d: int):
        ctx.save_for_backward(pos_m)
        ctx.n, ctx.k, ctx.block_d = x_nd.shape[0], k, block_d
        return x_nd[order_m // k]

    @staticmethod
    def backward(ctx, dxs_md: torch.Tensor):
        (pos_m,) = ctx.saved_tensors
        return _gather_reduce(dxs_md, pos_m, None, ctx.n, ctx.k, ctx.block_d), None, None, None, None


class _UnpermuteTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_sorted_md: torch.Tensor, order_m: torch.Tensor, weights_nk: torch.Tensor, n: int,
                block_d: int):
        y_sorted_md = y_sorted_md.contiguous()
        weights_nk = weights_nk.contiguous()
        ctx.save_for_backward(y_sorted_md, order_m, weights_nk)
        ctx.block_d = block_d
        return _gather_reduce(y_sorted_md, inverse_order(order_m), weights_nk, n, weights_nk.shape[1], block_d)

    @staticmethod
    def backward(ctx, dy_nd: torch.Tensor):
        y_sorted_md, order_m, weights_nk = ctx.saved_tensors
        dy_nd = dy_nd.contiguous()
        m, d = y_sorted_md.shape
        dys_md = empty_output((m, d), y_sorted_md.dtype, y_sorted_md.device)
        dw_nk = empty_output(tuple(weights_nk.shape), weights_nk.dtype, weights_nk.device)
        if m:
            triton_jit(_unpermute_bwd_kernel)[(m,)](
                dy_nd, y_sorted_md, order_m, weights_nk, dys_md, dw_nk, weights_nk.shape[1], d, dy_nd.stride(0),
                y_sorted_md.stride(0), dys_md.stride(0), BLOCK_D=ctx.block_d)
        return dys_md, None, dw_nk, None, None


def _triton_ok(t: torch.Tensor) -> bool:
    return triton_dtypes(t)


@register("moe_permute", "triton", eager=True)  # (compiled: called eagerly)
def permute_triton(x_nd: torch.Tensor, indices_nk: torch.Tensor, n_experts: int | None = None,
                   block_d: int = 256) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort in torch; the backward (sum of a token's k gradients) is a deterministic Triton gather-reduce."""
    if not _triton_ok(x_nd):
        return permute_reference(x_nd, indices_nk, n_experts)
    k = indices_nk.shape[1]
    flat_m = indices_nk.reshape(-1)
    order_m = torch.argsort(flat_m, stable=True)
    counts_e = torch.bincount(flat_m, minlength=_n_experts(indices_nk, n_experts))
    return _PermuteTriton.apply(x_nd, order_m, inverse_order(order_m), k, block_d), counts_e, order_m


@register("moe_unpermute", "triton", eager=True)
def unpermute_triton(y_sorted_md: torch.Tensor, order_m: torch.Tensor, weights_nk: torch.Tensor, n: int,
                     block_d: int = 256) -> torch.Tensor:
    """Weighted gather-reduce (fp32 accumulation) and a fused backward for d_y_sorted and d_weights."""
    if not (_triton_ok(y_sorted_md) and _triton_ok(weights_nk)):
        return unpermute_reference(y_sorted_md, order_m, weights_nk, n)
    return _UnpermuteTriton.apply(y_sorted_md, order_m, weights_nk, n, block_d)


# ------------------------------------------------------------------------------------------- torch_npu
class _PermuteNpu(torch.autograd.Function):
    """Forward: ``npu_moe_init_routing_v2`` (dropless, token-major ``row_idx_type=0``); backward in torch."""

    @staticmethod
    def forward(ctx, x_nd: torch.Tensor, indices_nk: torch.Tensor, n_experts: int):
        import torch_npu  # noqa: PLC0415

        n, k = indices_nk.shape
        x_sorted_md, expanded_row_idx, counts_e, _ = torch_npu.npu_moe_init_routing_v2(
            x_nd, indices_nk.to(torch.int32), active_num=n * k, expert_num=n_experts, drop_pad_mode=0,
            expert_tokens_num_type=1, expert_tokens_num_flag=True, active_expert_range=[0, n_experts],
            quant_mode=-1, row_idx_type=0)
        pos_m = expanded_row_idx.long()  # flat choice n*k+j -> its sorted row
        order_m = inverse_order(pos_m)
        counts_e = counts_e.long()
        ctx.save_for_backward(order_m)
        ctx.n, ctx.k = n, k
        ctx.mark_non_differentiable(counts_e, order_m)
        return x_sorted_md, counts_e, order_m

    @staticmethod
    def backward(ctx, dxs_md, _dcounts, _dorder):
        (order_m,) = ctx.saved_tensors
        dx_nd = torch.zeros(ctx.n, dxs_md.shape[1], dtype=dxs_md.dtype, device=dxs_md.device)
        return dx_nd.index_add_(0, order_m // ctx.k, dxs_md), None, None


class _UnpermuteNpu(torch.autograd.Function):
    """Forward: ``npu_moe_finalize_routing`` (``drop_pad_mode=2``: token-major row map); backward in torch."""

    @staticmethod
    def forward(ctx, y_sorted_md: torch.Tensor, order_m: torch.Tensor, weights_nk: torch.Tensor, n: int):
        import torch_npu  # noqa: PLC0415

        pos_m = inverse_order(order_m)
        ctx.save_for_backward(y_sorted_md, order_m, pos_m, weights_nk)
        return torch_npu.npu_moe_finalize_routing(
            y_sorted_md, skip1=None, skip2=None, bias=None, scales=weights_nk.to(y_sorted_md.dtype),
            expanded_src_to_dst_row=pos_m.to(torch.int32), export_for_source_row=None, drop_pad_mode=2)

    @staticmethod
    def backward(ctx, dy_nd: torch.Tensor):
        y_sorted_md, order_m, pos_m, weights_nk = ctx.saved_tensors
        k = weights_nk.shape[1]
        dy_rows_md = dy_nd[order_m // k]
        dys_md = dy_rows_md * weights_nk.reshape(-1)[order_m, None].to(dy_nd.dtype)
        dw_m = (dy_rows_md.float() * y_sorted_md.float()).sum(-1)  # per sorted row
        return dys_md, None, dw_m[pos_m].view_as(weights_nk).to(weights_nk.dtype), None


@register("moe_permute", "torch_npu")
def permute_npu(x_nd: torch.Tensor, indices_nk: torch.Tensor, n_experts: int | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """UNTESTED here (no torch_npu). Order within an expert is whatever the op's sort yields; ``order``
    is derived from the op's own row map, so ``unpermute`` stays consistent either way."""
    return _PermuteNpu.apply(x_nd, indices_nk, _n_experts(indices_nk, n_experts))


@register("moe_unpermute", "torch_npu")
def unpermute_npu(y_sorted_md: torch.Tensor, order_m: torch.Tensor, weights_nk: torch.Tensor, n: int
                  ) -> torch.Tensor:
    """UNTESTED here (no torch_npu)."""
    return _UnpermuteNpu.apply(y_sorted_md, order_m, weights_nk, n)


# -------------------------------------------------------------------------------------------------- API
def permute(x_nd: torch.Tensor, indices_nk: torch.Tensor, n_experts: int | None = None
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x_sorted_md, counts_e, order_m)``; pass ``n_experts`` so trailing empty experts get a count."""
    return get("moe_permute", x_nd.device.type)(x_nd, indices_nk, n_experts)


def unpermute(y_sorted_md: torch.Tensor, order_m: torch.Tensor, weights_nk: torch.Tensor, n: int) -> torch.Tensor:
    """``y_nd[t] = sum_j weights_nk[t, j] * y_sorted_md[row of (t, j)]`` for ``t < n``."""
    return get("moe_unpermute", y_sorted_md.device.type)(y_sorted_md, order_m, weights_nk, n)
