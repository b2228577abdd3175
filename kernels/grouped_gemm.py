"""Grouped GEMM over expert-sorted rows, and the routed-expert MoE computation built on it.

``grouped_mm(x_sorted_md, w_edk, counts_e)``: rows ``[start_e, start_e + counts_e[e])`` of ``x`` (experts in
order, zero counts allowed) are multiplied by ``w[e]``; differentiable in ``x`` and ``w`` (experts without
tokens get a zero weight gradient).

Backends:

* ``reference`` -- a ``torch.autograd.Function`` looping over the non-empty experts with preallocated outputs
  (``torch.mm(..., out=slice)``) forward and backward. This is also the fast CPU path: the per-expert
  Python loop of the model is slow in *autograd* (each ``x[s:e]`` / ``w[e]`` slice back-propagates a full
  size zero tensor), not in the GEMMs. ``torch._grouped_mm`` runs on CPU in torch 2.13 (fp32, and bf16
  with 16-byte aligned strides) but is no faster there (it loops the same way) and its CPU backward rejects
  expanded gradients, so it is not used.
* ``triton`` -- forward/dx kernel over a device-built tile schedule (no host sync), dw kernel per expert.
* ``torch_npu`` -- ``npu_grouped_matmul`` (untested here).

``moe_experts`` (op ``moe_experts``) is the model's routed-expert computation: ``reference`` fuses it per expert
(gather, GEMMs, SwiGLU, weighted scatter-add: the fast CPU path, see ``_MoEExpertsLoop``); ``triton`` and
``torch_npu`` compose permute -> grouped GEMM (gate, up) -> SwiGLU(limit) -> grouped GEMM (down) -> weighted
unpermute from their kernels (``moe_experts_composed``). ``moe_experts_loop`` is the model's own per-expert
autograd loop, kept as the spec and the benchmark baseline.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from kernels import moe_chunk_math as chunk_math
from kernels.moe_permute import permute, unpermute
from kernels.registry import cdiv, empty_output, get, register, triton_interpret, triton_dtypes, triton_jit

tl: Any = None  # triton.language, bound by registry.triton_jit on first use (never imported at import time)


def _check(x_md: torch.Tensor, w_edk: torch.Tensor, counts_e: torch.Tensor) -> None:
    if x_md.dim() != 2 or w_edk.dim() != 3 or x_md.shape[1] != w_edk.shape[1]:
        raise ValueError(f"grouped_mm expects x [M, D] and w [E, D, K]; got {tuple(x_md.shape)}, {tuple(w_edk.shape)}")
    if counts_e.shape != (w_edk.shape[0],):
        raise ValueError(f"counts_e must have shape ({w_edk.shape[0]},), got {tuple(counts_e.shape)}")


# ------------------------------------------------------------------------------------------- reference
class _GroupedMMLoop(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_md: torch.Tensor, w_edk: torch.Tensor, counts_e: torch.Tensor) -> torch.Tensor:
        sizes = counts_e.tolist()
        if sum(sizes) != x_md.shape[0]:
            raise ValueError(f"counts_e sums to {sum(sizes)} but x has {x_md.shape[0]} rows")
        y_mk = empty_output((x_md.shape[0], w_edk.shape[2]), x_md.dtype, x_md.device)
        start = 0
        for e, n in enumerate(sizes):
            if n:
                torch.mm(x_md[start:start + n], w_edk[e], out=y_mk[start:start + n])
                start += n
        ctx.save_for_backward(x_md, w_edk)
        ctx.sizes = sizes
        return y_mk

    @staticmethod
    def backward(ctx, dy_mk: torch.Tensor):
        x_md, w_edk = ctx.saved_tensors
        dx_md = dw_edk = None
        if ctx.needs_input_grad[0]:
            dx_md = empty_output(tuple(x_md.shape), x_md.dtype, x_md.device)
        if ctx.needs_input_grad[1]:
            dw_edk = empty_output(tuple(w_edk.shape), w_edk.dtype, w_edk.device)
        start = 0
        for e, n in enumerate(ctx.sizes):
            rows = slice(start, start + n)
            if dx_md is not None and n:
                torch.mm(dy_mk[rows], w_edk[e].t(), out=dx_md[rows])
            if dw_edk is not None:
                if n:
                    torch.mm(x_md[rows].t(), dy_mk[rows], out=dw_edk[e])
                else:
                    dw_edk[e].zero_()
            start += n
        return dx_md, dw_edk, None


@register("grouped_mm", "reference")
def grouped_mm_reference(x_md: torch.Tensor, w_edk: torch.Tensor, counts_e: torch.Tensor) -> torch.Tensor:
    _check(x_md, w_edk, counts_e)
    return _GroupedMMLoop.apply(x_md, w_edk, counts_e)


# ---------------------------------------------------------------------------------------------- triton
def _gmm_kernel(a_ptr, b_ptr, c_ptr, tile_e_ptr, tile_r0_ptr, tile_r1_ptr, N, K,
                s_am, s_ak, s_be, s_bk, s_bn, s_cm, s_cn,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr):
    """C[r0:r1, n-tile] = A[r0:r1, :] @ B[e]  for row tile t = (e, r0, r1); empty tiles store nothing."""
    t = tl.program_id(0)
    e = tl.load(tile_e_ptr + t).to(tl.int64)
    r0 = tl.load(tile_r0_ptr + t).to(tl.int64)
    r1 = tl.load(tile_r1_ptr + t).to(tl.int64)
    rm = r0 + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m, mask_n = rm < r1, rn < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        mask_k = rk < K
        a = tl.load(a_ptr + rm[:, None] * s_am + rk[None, :] * s_ak, mask=mask_m[:, None] & mask_k[None, :],
                    other=0.0)
        b = tl.load(b_ptr + e * s_be + rk[:, None] * s_bk + rn[None, :] * s_bn,
                    mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        if UPCAST:
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision="ieee")
    tl.store(c_ptr + rm[:, None] * s_cm + rn[None, :] * s_cn, acc.to(c_ptr.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])


def _gmm_dw_kernel(x_ptr, dy_ptr, dw_ptr, start_ptr, count_ptr, D, N,
                   s_xm, s_xd, s_ym, s_yn, s_we, s_wd, s_wn,
                   BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr):
    """dW[e, d-tile, n-tile] = X[rows_e, d-tile]^T @ dY[rows_e, n-tile] (zeros when expert e is empty)."""
    e = tl.program_id(0).to(tl.int64)
    r0 = tl.load(start_ptr + e).to(tl.int64)
    r1 = r0 + tl.load(count_ptr + e).to(tl.int64)
    rd = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    rn = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_d, mask_n = rd < D, rn < N
    acc = tl.zeros([BLOCK_D, BLOCK_N], dtype=tl.float32)
    for m0 in range(r0, r1, BLOCK_M):
        rm = m0 + tl.arange(0, BLOCK_M)
        mask_m = rm < r1
        xt = tl.load(x_ptr + rm[None, :] * s_xm + rd[:, None] * s_xd, mask=mask_d[:, None] & mask_m[None, :],
                     other=0.0)
        g = tl.load(dy_ptr + rm[:, None] * s_ym + rn[None, :] * s_yn, mask=mask_m[:, None] & mask_n[None, :],
                    other=0.0)
        if UPCAST:
            xt, g = xt.to(tl.float32), g.to(tl.float32)
        acc = tl.dot(xt, g, acc, input_precision="ieee")
    tl.store(dw_ptr + e * s_we + rd[:, None] * s_wd + rn[None, :] * s_wn, acc.to(dw_ptr.dtype.element_ty),
             mask=mask_d[:, None] & mask_n[None, :])


def _upcast_dot(dtype: torch.dtype) -> bool:
    """Upcast 16-bit dot operands to fp32 under ``TRITON_INTERPRET=1``: triton 3.9's interpreter computes
    bf16 ``tl.dot`` wrongly (numpy has no bf16). Compiled kernels feed bf16 to the tensor cores as is."""
    return dtype != torch.float32 and triton_interpret()


def tile_schedule(counts_e: torch.Tensor, n_rows: int, block_m: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Row tiles of ``block_m`` rows that never straddle two experts, built on device without a host sync.

    Returns (expert, first row, end row) per tile for ``cdiv(n_rows, block_m) + E`` tiles -- an upper bound
    on the real count; the surplus tiles get ``end == first`` and store nothing.
    """
    n_experts = counts_e.shape[0]
    counts = counts_e.long()
    starts_e = torch.cumsum(counts, 0) - counts
    tiles_e = (counts + block_m - 1) // block_m
    tile_end_e = torch.cumsum(tiles_e, 0)
    t = torch.arange((n_rows + block_m - 1) // block_m + n_experts, device=counts.device)
    expert_t = torch.searchsorted(tile_end_e, t, right=True)
    valid_t = expert_t < n_experts
    expert_t = expert_t.clamp(max=max(n_experts - 1, 0))
    r0_t = starts_e[expert_t] + (t - (tile_end_e - tiles_e)[expert_t]) * block_m
    r1_t = torch.where(valid_t, starts_e[expert_t] + counts[expert_t], r0_t)
    return expert_t, r0_t, r1_t


def _gmm_launch(a_mk: torch.Tensor, b_ekn: torch.Tensor, out_mn: torch.Tensor, schedule, blocks, warps) -> None:
    expert_t, r0_t, r1_t = schedule
    bm, bn, bk = blocks
    n, k = b_ekn.shape[2], b_ekn.shape[1]
    if out_mn.numel() == 0:
        return
    triton_jit(_gmm_kernel)[(expert_t.numel(), cdiv(n, bn))](
        a_mk, b_ekn, out_mn, expert_t, r0_t, r1_t, n, k, a_mk.stride(0), a_mk.stride(1), b_ekn.stride(0),
        b_ekn.stride(1), b_ekn.stride(2), out_mn.stride(0), out_mn.stride(1), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        UPCAST=_upcast_dot(a_mk.dtype), num_warps=warps[0], num_stages=warps[1])


def default_blocks(dtype: torch.dtype) -> tuple[tuple[int, int, int], tuple[int, int]]:
    """((BLOCK_M, BLOCK_N, BLOCK_K), (num_warps, num_stages)) for compiled kernels: large tensor-core tiles
    for 16-bit inputs (swept on an H200 with ``bench/grouped_gemm_sweep.py``), small ones for fp32 (IEEE
    fp32 dots) and for the interpreter, where tile size only costs time."""
    if triton_interpret() or dtype == torch.float32:
        return (64, 64, 32), (4, 2)
    return (64, 128, 64), (4, 3)


class _GroupedMMTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_md: torch.Tensor, w_edk: torch.Tensor, counts_e: torch.Tensor, blocks: tuple[int, int, int],
                warps: tuple[int, int]):
        schedule = tile_schedule(counts_e, x_md.shape[0], blocks[0])
        y_mk = empty_output((x_md.shape[0], w_edk.shape[2]), x_md.dtype, x_md.device)
        _gmm_launch(x_md, w_edk, y_mk, schedule, blocks, warps)
        ctx.save_for_backward(x_md, w_edk, counts_e, *schedule)
        ctx.blocks, ctx.warps = blocks, warps
        return y_mk

    @staticmethod
    def backward(ctx, dy_mk: torch.Tensor):
        x_md, w_edk, counts_e, *schedule = ctx.saved_tensors
        bm, bn, bk = ctx.blocks
        dx_md = dw_edk = None
        if ctx.needs_input_grad[0]:
            dx_md = empty_output(tuple(x_md.shape), x_md.dtype, x_md.device)
            _gmm_launch(dy_mk, w_edk.transpose(1, 2), dx_md, schedule, ctx.blocks, ctx.warps)
        if ctx.needs_input_grad[1]:
            e, d, n = w_edk.shape
            dw_edk = empty_output((e, d, n), w_edk.dtype, w_edk.device)
            counts = counts_e.long()
            starts = torch.cumsum(counts, 0) - counts
            if dw_edk.numel():
                triton_jit(_gmm_dw_kernel)[(e, cdiv(d, bk), cdiv(n, bn))](
                    x_md, dy_mk, dw_edk, starts, counts, d, n, x_md.stride(0), x_md.stride(1), dy_mk.stride(0),
                    dy_mk.stride(1), dw_edk.stride(0), dw_edk.stride(1), dw_edk.stride(2),
                    BLOCK_M=bm, BLOCK_D=bk, BLOCK_N=bn, UPCAST=_upcast_dot(x_md.dtype),
                    num_warps=ctx.warps[0], num_stages=ctx.warps[1])
        return dx_md, dw_edk, None, None, None


@register("grouped_mm", "triton", eager=True)  # (compiled: called eagerly)
def grouped_mm_triton(x_md: torch.Tensor, w_edk: torch.Tensor, counts_e: torch.Tensor,
                      blocks: tuple[int, int, int] | None = None, warps: tuple[int, int] | None = None
                      ) -> torch.Tensor:
    """Triton grouped GEMM, fp32 accumulation; ``blocks`` = (BLOCK_M, BLOCK_N, BLOCK_K), each >= 16, and
    ``warps`` = (num_warps, num_stages); defaults from :func:`default_blocks`."""
    _check(x_md, w_edk, counts_e)
    if not triton_dtypes(x_md) or x_md.dtype != w_edk.dtype:
        return grouped_mm_reference(x_md, w_edk, counts_e)
    d_blocks, d_warps = default_blocks(x_md.dtype)
    return _GroupedMMTriton.apply(x_md, w_edk, counts_e, blocks or d_blocks, warps or d_warps)


# ------------------------------------------------------------------------------------------- torch_npu
class _GroupedMMNpu(torch.autograd.Function):
    """``npu_grouped_matmul`` forward, dx (``group_type=0``) and dw (``group_type=2``: split along M)."""

    @staticmethod
    def forward(ctx, x_md: torch.Tensor, w_edk: torch.Tensor, counts_e: torch.Tensor) -> torch.Tensor:
        import torch_npu  # noqa: PLC0415

        group_list = counts_e.to(torch.int64)
        ctx.save_for_backward(x_md, w_edk, group_list)
        return torch_npu.npu_grouped_matmul([x_md], [w_edk], group_list=group_list, split_item=2, group_type=0,
                                            group_list_type=1)[0]

    @staticmethod
    def backward(ctx, dy_mk: torch.Tensor):
        import torch_npu  # noqa: PLC0415

        x_md, w_edk, group_list = ctx.saved_tensors
        dy_mk = dy_mk.contiguous()
        dx_md = dw_edk = None
        if ctx.needs_input_grad[0]:
            dx_md = torch_npu.npu_grouped_matmul([dy_mk], [w_edk.transpose(1, 2)], group_list=group_list,
                                                 split_item=2, group_type=0, group_list_type=1)[0]
        if ctx.needs_input_grad[1]:
            dw_edk = torch_npu.npu_grouped_matmul([x_md.t()], [dy_mk], group_list=group_list, split_item=3,
                                                  group_type=2, group_list_type=1)[0]
            # experts without tokens: zero, whatever the op leaves there
            dw_edk = dw_edk.masked_fill((group_list == 0)[:, None, None], 0)
        return dx_md, dw_edk, None


@register("grouped_mm", "torch_npu")
def grouped_mm_npu(x_md: torch.Tensor, w_edk: torch.Tensor, counts_e: torch.Tensor) -> torch.Tensor:
    """UNTESTED here (no torch_npu)."""
    _check(x_md, w_edk, counts_e)
    return _GroupedMMNpu.apply(x_md, w_edk, counts_e)


def grouped_mm(x_sorted_md: torch.Tensor, w_edk: torch.Tensor, counts_e: torch.Tensor) -> torch.Tensor:
    """``y[rows of e] = x_sorted[rows of e] @ w_edk[e]``, rows grouped by expert in order (``counts_e``)."""
    return get("grouped_mm", x_sorted_md.device.type)(x_sorted_md, w_edk, counts_e)


# --------------------------------------------------------------------------------------------- experts
def _swiglu_bwd(dout: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, limit: float
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(d gate, d up) of ``silu(min(gate, limit)) * clamp(up, -limit, limit)`` in fp32; like ``torch.clamp``,
    the gradient passes where the bound holds (inclusive)."""
    g = gate.float().clamp(max=limit)
    u = up.float().clamp(min=-limit, max=limit)
    s = torch.sigmoid(g)
    d = dout.float()
    dgate = (d * u).mul_(s * (1 + g * (1 - s))).masked_fill_(gate > limit, 0)
    dup = (d * g).mul_(s).masked_fill_((up < -limit) | (up > limit), 0)
    return dgate, dup


class _SwiGLULimit(torch.autograd.Function):
    """``silu(min(gate, limit)) * clamp(up, -limit, limit)``: the model's exact forward ops; saves only
    gate and up, backward recomputes in fp32."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        ctx.limit = limit
        return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        gate, up = ctx.saved_tensors
        dgate, dup = _swiglu_bwd(dout, gate, up, ctx.limit)
        return dgate.to(gate.dtype), dup.to(up.dtype), None


def swiglu_limit(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """The model's clamped SwiGLU (local helper; ``kernels.swiglu`` is a separate op)."""
    return _SwiGLULimit.apply(gate, up, limit)


_CHUNK_ROWS = 2048  # expert-sorted rows per elementwise batch of the CPU experts path (cache-sized)


# 16-bit CPU GEMMs run on oneDNN, which builds (JITs) a kernel for every new shape: an expert's row count changes
# with every batch, and a [M, 512] x [512, 512] bf16 product of a new M took ~2.5 ms where a cached shape takes
# 0.2 (AMX Xeon, 2 threads). Each expert's rows are therefore padded to a multiple of this (of M/16 for large M:
# ``_padded``), so the shapes recur.
_ROW_ALIGN_16BIT_CPU = 64


def _row_align(x: torch.Tensor) -> int:
    """Rows per expert are padded to a multiple of this (1: no padding; fp32 CPU GEMMs go to a BLAS without
    per-shape kernels)."""
    return _ROW_ALIGN_16BIT_CPU if x.is_cpu and x.dtype in (torch.bfloat16, torch.float16) else 1


def _padded(n: int, align: int) -> int:
    """``n`` rounded up to a multiple of ``align``, or of 1/16 of its power of two if that is larger: at most 16
    row counts per doubling (the primitive cache stays bounded whatever the batch), at most 1/16 more rows."""
    a = max(align, (1 << max(n.bit_length() - 1, 0)) // 16) if align > 1 else 1
    return -(-n // a) * a


def _aligned_rows(token_m: torch.Tensor, w_m: torch.Tensor, sizes: list[int], align: int):
    """The expert-sorted rows laid out with each expert's block padded to a multiple of ``align`` rows:
    ``(token_p, w_p, rows_m, padded_sizes)``. Padding rows read token 0 and carry routing weight 0, so they add
    nothing to the output nor to any gradient (the weight multiplies the activation gradient and the weight
    gradient's operand); ``rows_m``: where each sorted row went."""
    padded = [_padded(n, align) for n in sizes]
    if padded == sizes:
        return token_m, w_m, None, sizes
    dev = token_m.device
    n_e, p_e = torch.tensor(sizes, device=dev), torch.tensor(padded, device=dev)
    shift_e = (p_e.cumsum(0) - p_e) - (n_e.cumsum(0) - n_e)  # how far each expert's block moves
    m = token_m.numel()
    rows_m = torch.repeat_interleave(shift_e, n_e, output_size=m) + torch.arange(m, device=dev)
    total = sum(padded)
    token_p = token_m.new_zeros(total).index_copy_(0, rows_m, token_m)
    w_p = w_m.new_zeros(total).index_copy_(0, rows_m, w_m)
    return token_p, w_p, rows_m, padded


def _row_of_choice(order_m: torch.Tensor, rows_m: torch.Tensor | None) -> torch.Tensor:
    """For every routing choice ``q = t * k + j`` (flattened ``[N, k]``), the row of the expert-sorted (and
    padded) layout that holds it: the inverse of ``order_m``, through ``rows_m`` when rows were padded."""
    inv = torch.empty_like(order_m).index_copy_(0, order_m, torch.arange(order_m.numel(), device=order_m.device))
    return inv if rows_m is None else rows_m[inv]


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """16-bit expert outputs are summed per token in fp32 (one rounding at the end)."""
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


def _fp32_widened(bound: float, inward: float) -> float:
    """The fp32 neighbour of ``bound`` away from ``inward``: ``x < widened`` iff ``x <= bound`` for fp32 ``x``
    (and ``>`` / ``>=`` for a lower bound)."""
    b = torch.tensor(bound, dtype=torch.float32)
    return float(torch.nextafter(b, torch.tensor(-inward, dtype=torch.float32)))


def _expert_chunks(sizes: list[int], chunk_rows: int) -> list[tuple[int, int, list[tuple[int, int, int]]]]:
    """Consecutive non-empty experts grouped into chunks of about ``chunk_rows`` sorted rows:
    ``[(r0, r1, [(expert, s0, s1), ...])]`` with the experts' row ranges local to the chunk."""
    chunks: list[tuple[int, int, list[tuple[int, int, int]]]] = []
    r0 = r1 = 0
    members: list[tuple[int, int, int]] = []
    for e, n in enumerate(sizes):
        if not n:
            continue
        members.append((e, r1 - r0, r1 - r0 + n))
        r1 += n
        if r1 - r0 >= chunk_rows:
            chunks.append((r0, r1, members))
            r0, members = r1, []
    if members:
        chunks.append((r0, r1, members))
    return chunks


class _MoEExpertsLoop(torch.autograd.Function):
    """Routed experts fused per expert (the CPU path): gather the tokens of a chunk of consecutive experts
    (about ``_CHUNK_ROWS`` rows), gate/up GEMMs per expert, SwiGLU over the chunk, down GEMM per expert into
    one ``[N*k, D]`` buffer, then each token's ``k`` rows gathered and summed with their routing weights
    (``moe_chunk_math.combine``, in fp32 for 16-bit inputs: one pass, where a weighted ``index_add`` per chunk
    into an fp32 accumulator cost a zero fill, a widening copy and a multiply per chunk and a narrowing copy);
    the backward walks the chunks the same way and sums each token's input-gradient rows the same way.

    A chunk's operands stay cache-resident between its GEMMs, the elementwise work runs once per chunk (not
    once per expert: fewer, larger ops), scratch buffers are reused (``out=``) and nothing goes through autograd
    per slice. Saves the ``gate``/``up`` pre-activations ([N*k, I] each) and the gathered rows ([N*k, D], the
    gate / up weight gradients' operand: the backward does not gather them again). Router-weight gradient:
    ``<dy_t, y_e> = <dy_t W_d^T, a>`` (no expert output is kept). The forward
    runs the model's ops on the same values (same rounding), unless the chunk math is compiled
    (``moe_chunk_math.fuse``: 16-bit activations then round once instead of per op). 16-bit CPU inputs pad each
    expert's rows to a multiple of ``_ROW_ALIGN_16BIT_CPU`` (weightless rows, :func:`_aligned_rows`): oneDNN
    builds a kernel for every new GEMM shape, and unpadded row counts change with every batch (eager bf16
    bench_20m step 1.13x faster padded).
    """

    @staticmethod
    def forward(ctx, x_nd, indices_nk, weights_nk, w_gate, w_up, w_down, limit):
        k, (n_exp, d, i) = indices_nk.shape[1], w_gate.shape
        flat_m = indices_nk.reshape(-1)
        order_m = torch.argsort(flat_m, stable=True)
        sizes = torch.bincount(flat_m, minlength=n_exp).tolist()
        if len(sizes) != n_exp:
            raise IndexError(f"expert indices must be in [0, {n_exp})")
        dtype, dev = x_nd.dtype, x_nd.device
        acc = _accumulation_dtype(dtype)
        token_m, w_m, rows_m, sizes = _aligned_rows(order_m // k, weights_nk.reshape(-1)[order_m].to(acc), sizes,
                                                    _row_align(x_nd))  # w_m: the backward's (padding rows: 0)
        m = token_m.numel()
        gate_mi, up_mi = empty_output((m, i), dtype, dev), empty_output((m, i), dtype, dev)
        x_md = empty_output((m, d), dtype, dev)  # the gathered rows, kept for the weight gradients
        y_md = empty_output((m, d), dtype, dev)  # every row's (unweighted) expert output
        chunks = _expert_chunks(sizes, _CHUNK_ROWS)
        cap = max((r1 - r0 for r0, r1, _ in chunks), default=0)
        a_buf, c_buf = (torch.empty(cap, i, dtype=dtype, device=dev) for _ in range(2))
        for r0, r1, experts in chunks:
            n, tok = r1 - r0, token_m[r0:r1]
            x_c, g, u, a, c, y_c = x_md[r0:r1], gate_mi[r0:r1], up_mi[r0:r1], a_buf[:n], c_buf[:n], y_md[r0:r1]
            torch.index_select(x_nd, 0, tok, out=x_c)
            for e, s0, s1 in experts:
                torch.mm(x_c[s0:s1], w_gate[e], out=g[s0:s1])
                torch.mm(x_c[s0:s1], w_up[e], out=u[s0:s1])
            a = chunk_math.act(g, u, limit, a, c)  # the model's swiglu (eager: in place into a)
            for e, s0, s1 in experts:
                torch.mm(a[s0:s1], w_down[e], out=y_c[s0:s1])
        pos_nk = _row_of_choice(order_m, rows_m).view(indices_nk.shape)
        ctx.save_for_backward(x_md, weights_nk, w_m, w_gate, w_up, w_down, gate_mi, up_mi, order_m, token_m, rows_m,
                              pos_nk)
        ctx.sizes, ctx.chunks, ctx.limit, ctx.k = sizes, chunks, limit, k
        return chunk_math.combine(y_md, pos_nk, weights_nk)  # sum_j w[t, j] * y[row of (t, j)], in fp32

    @staticmethod
    def backward(ctx, dy_nd):
        (x_md, weights_nk, w_m, w_gate, w_up, w_down, gate_mi, up_mi, order_m, token_m, rows_m,
         pos_nk) = ctx.saved_tensors
        lim, dtype, dev = ctx.limit, x_md.dtype, x_md.device
        (_, d, i), need = w_gate.shape, ctx.needs_input_grad
        lo, hi = _fp32_widened(-lim, math.inf), _fp32_widened(lim, -math.inf)
        w_m = w_m.float()
        dy_nd = dy_nd.contiguous()
        dx_md = empty_output(x_md.shape, dtype, dev) if need[0] else None  # per row; summed per token at the end
        dw_m = empty_output((token_m.numel(),), torch.float32, dev) if need[2] else None
        dws = [empty_output(tuple(w.shape), w.dtype, w.device) if need[j] else None
               for j, w in zip((3, 4, 5), (w_gate, w_up, w_down))]
        for e, n in enumerate(ctx.sizes):
            for dw in dws:
                if dw is not None and not n:
                    dw[e].zero_()
        cap = max((r1 - r0 for r0, r1, _ in ctx.chunks), default=0)
        dy_buf = torch.empty(cap, d, dtype=dtype, device=dev)
        da_buf = torch.empty(cap, i, dtype=dtype, device=dev)
        for r0, r1, experts in ctx.chunks:
            n, tok, w_r = r1 - r0, token_m[r0:r1], w_m[r0:r1, None]
            dy_c, da_c = torch.index_select(dy_nd, 0, tok, out=dy_buf[:n]), da_buf[:n]
            for e, s0, s1 in experts:  # d (unweighted expert output) / d a
                torch.mm(dy_c[s0:s1], w_down[e].t(), out=da_c[s0:s1])
            # like torch.clamp, the gradient passes where the bound holds (inclusive); hardtanh_backward passes
            # strictly inside (lo, hi), so the bounds are widened by one fp32 ulp (and it is ~4x cheaper than a
            # comparison and a multiply by its mask)
            dw_c, a_w, du, dg = chunk_math.act_grad(gate_mi[r0:r1], up_mi[r0:r1], da_c, w_r, lim, lo, hi,
                                                    dw_m is not None, dws[2] is not None)
            if dw_m is not None:
                dw_m[r0:r1] = dw_c
            if dws[2] is not None:
                for e, s0, s1 in experts:
                    torch.mm(a_w[s0:s1].t(), dy_c[s0:s1], out=dws[2][e])
            if dws[0] is not None or dws[1] is not None:
                x_c = x_md[r0:r1]
                for e, s0, s1 in experts:
                    if dws[0] is not None:
                        torch.mm(x_c[s0:s1].t(), dg[s0:s1], out=dws[0][e])
                    if dws[1] is not None:
                        torch.mm(x_c[s0:s1].t(), du[s0:s1], out=dws[1][e])
            if dx_md is not None:
                dx_c = dx_md[r0:r1]
                for e, s0, s1 in experts:
                    torch.mm(dg[s0:s1], w_gate[e].t(), out=dx_c[s0:s1]).addmm_(du[s0:s1], w_up[e].t())
        dx_nd = None if dx_md is None else chunk_math.combine(dx_md, pos_nk, None)
        dw_nk = None
        if dw_m is not None:
            dw_m = dw_m if rows_m is None else dw_m[rows_m]
            dw_nk = torch.empty_like(dw_m).index_copy_(0, order_m, dw_m).view_as(weights_nk).to(weights_nk.dtype)
        return dx_nd, None, dw_nk, *dws, None


@register("moe_experts", "reference", eager=True)  # host-synced expert counts drive the loop
def moe_experts_reference(x_nd: torch.Tensor, indices_nk: torch.Tensor, weights_nk: torch.Tensor,
                          w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, limit: float
                          ) -> torch.Tensor:
    """Plain torch, any device (host sync on the counts); per-expert fused loop, see ``_MoEExpertsLoop``."""
    return _MoEExpertsLoop.apply(x_nd, indices_nk, weights_nk, w_gate, w_up, w_down, limit)


def moe_experts_composed(x_nd: torch.Tensor, indices_nk: torch.Tensor, weights_nk: torch.Tensor,
                         w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, limit: float,
                         permute_fn=permute, grouped_mm_fn=grouped_mm, unpermute_fn=unpermute,
                         swiglu_fn=swiglu_limit) -> torch.Tensor:
    """permute -> grouped GEMM (gate, up) -> SwiGLU(limit) -> grouped GEMM (down) -> weighted unpermute,
    each step by the given implementations (default: the registry's choice per op; the torch SwiGLU)."""
    x_sorted_md, counts_e, order_m = permute_fn(x_nd, indices_nk, w_gate.shape[0])
    h_mi = swiglu_fn(grouped_mm_fn(x_sorted_md, w_gate, counts_e), grouped_mm_fn(x_sorted_md, w_up, counts_e),
                     limit)
    return unpermute_fn(grouped_mm_fn(h_mi, w_down, counts_e), order_m, weights_nk, x_nd.shape[0])


@register("moe_experts", "triton", eager=True)
def moe_experts_triton(x_nd, indices_nk, weights_nk, w_gate, w_up, w_down, limit) -> torch.Tensor:
    """The composition on the Triton permute / grouped GEMM / SwiGLU / unpermute kernels (no host sync; the
    SwiGLU in one pass each way: the torch one made ~10 elementwise passes over the [M, I] activations)."""
    from kernels.moe_permute import permute_triton, unpermute_triton
    from kernels.swiglu import swiglu_triton

    return moe_experts_composed(x_nd, indices_nk, weights_nk, w_gate, w_up, w_down, limit,
                                permute_triton, grouped_mm_triton, unpermute_triton, swiglu_triton)


@register("moe_experts", "torch_npu")
def moe_experts_npu(x_nd, indices_nk, weights_nk, w_gate, w_up, w_down, limit) -> torch.Tensor:
    """The composition on ``npu_moe_init_routing_v2`` / ``npu_grouped_matmul`` / ``npu_moe_finalize_routing``
    (UNTESTED here: no torch_npu)."""
    from kernels.moe_permute import permute_npu, unpermute_npu

    return moe_experts_composed(x_nd, indices_nk, weights_nk, w_gate, w_up, w_down, limit,
                                permute_npu, grouped_mm_npu, unpermute_npu)


def moe_experts(x_nd: torch.Tensor, indices_nk: torch.Tensor, weights_nk: torch.Tensor, w_gate: torch.Tensor,
                w_up: torch.Tensor, w_down: torch.Tensor, limit: float) -> torch.Tensor:
    """Routed-expert output ``y_nd[t] = sum_j weights[t, j] * FFN_{indices[t, j]}(x[t])`` (the model's MoE
    without the shared expert); ``w_gate``/``w_up``: [E, D, I], ``w_down``: [E, I, D]; the FFN is the model's
    SwiGLU clamped at ``limit``. Backends: ``reference`` (fused per-expert loop), ``triton``, ``torch_npu``
    (compositions of this package's permute / grouped GEMM / unpermute kernels).

    Under ``torch.autocast`` the expert GEMMs run in the autocast dtype like any ``nn.Linear`` would (inputs and
    expert weights are cast, gradients flow back to the fp32 weights); the routing weights stay as given."""
    dev = x_nd.device.type
    if torch.is_autocast_enabled(dev):
        dt = torch.get_autocast_dtype(dev)
        x_nd, w_gate, w_up, w_down = (t.to(dt) for t in (x_nd, w_gate, w_up, w_down))
        with torch.autocast(dev, enabled=False):
            return get("moe_experts", dev)(x_nd, indices_nk, weights_nk, w_gate, w_up, w_down, limit)
    return get("moe_experts", dev)(x_nd, indices_nk, weights_nk, w_gate, w_up, w_down, limit)


def moe_experts_loop(x_nd: torch.Tensor, indices_nk: torch.Tensor, weights_nk: torch.Tensor, w_gate: torch.Tensor,
                     w_up: torch.Tensor, w_down: torch.Tensor, limit: float) -> torch.Tensor:
    """The model's per-expert Python loop (``MoE.forward``), op for op: the spec and the benchmark baseline."""
    k = indices_nk.shape[1]
    flat = indices_nk.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=w_gate.shape[0])
    token_of = order // k
    x_sorted = x_nd[token_of]
    outs, start = [], 0
    for e, n in enumerate(counts.tolist()):
        if n:
            xe = x_sorted[start:start + n]
            gate, up = xe @ w_gate[e], xe @ w_up[e]
            outs.append((F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)) @ w_down[e])
            start += n
    out_sorted = torch.cat(outs) if outs else x_sorted
    weighted = out_sorted * weights_nk.reshape(-1)[order, None].to(out_sorted.dtype)
    return torch.zeros_like(x_nd).index_add_(0, token_of, weighted.to(x_nd.dtype))
