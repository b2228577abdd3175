"""Linear + cross-entropy without materialising the [N, V] logits.

``fused_linear_cross_entropy(h_nd, weight_vd, labels_n)`` equals
``F.cross_entropy((h_nd @ weight_vd.T).float(), labels_n, ignore_index=..., reduction=...)`` (the trainer's
loss: logits in the input dtype, softmax in fp32), optionally plus a z-loss ``z_loss * logsumexp(logits)^2``
per counted token.

Algorithm (the ``reference`` backend, plain torch on any device -- the optimised CPU path):

* tokens whose label is ``ignore_index`` are dropped up front (no FLOPs are spent on prompt tokens of
  assistant-only masks; they get zero loss and zero gradient);
* forward: for each chunk of ``chunk_tokens`` tokens, sweep the vocabulary in chunks of ``chunk_vocab`` rows
  of ``W`` with an online (running max) logsumexp and pick the target logit; only ``lse`` [N] is saved;
* backward (a custom ``autograd.Function``): recompute each [chunk_tokens, chunk_vocab] logit block,
  ``dlogits = (softmax - onehot) * g`` (``softmax * (1 + 2 z lse)`` with a z-loss), and accumulate
  ``dh += dlogits @ W_v`` and ``dW_v += dlogits^T @ h`` in fp32.

Peak extra memory is O(chunk_tokens * chunk_vocab + V * D) (the fp32 dW accumulator) instead of the
several O(N * V) fp32 buffers of the naive loss; the price is one extra logits GEMM (4 instead of 3).

The ``triton`` backend (CUDA; Ascend through triton-ascend) trades that extra GEMM for a gradient computed in
the forward pass, as Liger-Kernel does: per chunk of ``chunk_tokens`` counted tokens one GEMM makes the
full-vocabulary logits ``[chunk, V]`` in the input dtype; one Triton program per row takes two passes over
them (online max / sum-exp -> ``lse`` and the loss; then ``softmax (1 + 2 z lse) - onehot`` written over the
logits in place); two GEMMs turn that block into ``dh`` and into the fp32 ``dW`` accumulator. The backward
only scales the saved ``dh`` / ``dW`` by the (scalar) output gradient. 3 GEMMs instead of 4, no vocabulary
loop, no fp32 logits block; extra memory O(chunk_tokens * V + N * D + V * D). ``reduction="none"`` (a
per-token output gradient, unknown in the forward) runs the reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from typing import Any

from kernels.registry import empty_output, get, next_pow2, register, triton_dtypes, triton_jit

tl: Any = None  # triton.language, bound by registry.triton_jit on first use

REDUCTIONS = ("sum", "mean", "none")


def _logits(h_td: torch.Tensor, w_vd: torch.Tensor) -> torch.Tensor:
    """A logits block in fp32 from a GEMM in the inputs' dtype (as ``(h @ W.T).float()``)."""
    return (h_td @ w_vd.t()).float()


_OUT_DTYPE_ADDMM: dict[str, bool] = {}  # device type -> whether addmm(..., out_dtype=float32) works there


def _accumulate(acc_f32: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b`` into an fp32 accumulator: in place for fp32 operands; for 16-bit ones one GEMM with an
    fp32 output (``addmm(out_dtype=float32)``, cuBLAS on CUDA) where torch supports it, else a 16-bit product
    added in fp32 (a [rows, cols] temporary)."""
    if a.dtype == torch.float32:
        acc_f32.addmm_(a, b)
        return
    dev = acc_f32.device.type
    if _OUT_DTYPE_ADDMM.get(dev, dev == "cuda"):
        try:
            torch.addmm(acc_f32, a, b, out_dtype=torch.float32, out=acc_f32)
            _OUT_DTYPE_ADDMM[dev] = True
            return
        except (TypeError, RuntimeError, NotImplementedError):
            _OUT_DTYPE_ADDMM[dev] = False
    acc_f32 += (a @ b).float()


def _counted_tokens(h_nd: torch.Tensor, labels_n: torch.Tensor, ignore_index: int, v: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rows [Nc], labels [Nc], hidden states [Nc, D]) of the tokens whose label counts; labels checked."""
    rows_c = (labels_n != ignore_index).nonzero().squeeze(1)
    labels_c = labels_n.index_select(0, rows_c)
    if labels_c.numel() and (int(labels_c.min()) < 0 or int(labels_c.max()) >= v):
        raise IndexError(f"labels must be in [0, {v}) or equal ignore_index={ignore_index}")
    return rows_c, labels_c, h_nd.index_select(0, rows_c)


class _FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_nd: torch.Tensor, weight_vd: torch.Tensor, labels_n: torch.Tensor, ignore_index: int,
                reduction: str, chunk_tokens: int, chunk_vocab: int, z_loss: float) -> torch.Tensor:
        n, v = h_nd.shape[0], weight_vd.shape[0]
        rows_c, labels_c, h_cd = _counted_tokens(h_nd, labels_n, ignore_index, v)
        nc = h_cd.shape[0]
        lse_c = empty_output((nc,), torch.float32, h_nd.device)
        target_c = empty_output((nc,), torch.float32, h_nd.device)
        with torch.no_grad():
            for t0 in range(0, nc, chunk_tokens):
                h_td = h_cd[t0:t0 + chunk_tokens]
                lab_t = labels_c[t0:t0 + chunk_tokens]
                run_max = torch.full((h_td.shape[0],), float("-inf"), device=h_nd.device)
                run_sum = torch.zeros(h_td.shape[0], device=h_nd.device)
                tgt = torch.zeros(h_td.shape[0], device=h_nd.device)
                for v0 in range(0, v, chunk_vocab):
                    logits_tv = _logits(h_td, weight_vd[v0:v0 + chunk_vocab])
                    width = logits_tv.shape[1]
                    in_chunk = (lab_t >= v0) & (lab_t < v0 + width)
                    local = (lab_t - v0).clamp(0, width - 1).unsqueeze(1)
                    tgt = torch.where(in_chunk, logits_tv.gather(1, local).squeeze(1), tgt)
                    new_max = torch.maximum(run_max, logits_tv.amax(dim=1))
                    run_sum = run_sum * torch.exp(run_max - new_max) + logits_tv.sub_(new_max[:, None]).exp_().sum(1)
                    run_max = new_max
                    del logits_tv  # free the block before the next one is allocated
                lse_c[t0:t0 + chunk_tokens] = run_max + run_sum.log()
                target_c[t0:t0 + chunk_tokens] = tgt
        loss_c = lse_c - target_c
        if z_loss:
            loss_c = loss_c + z_loss * lse_c.square()
        ctx.save_for_backward(h_nd, weight_vd, rows_c, labels_c, lse_c)
        ctx.cfg = (reduction, chunk_tokens, chunk_vocab, z_loss)
        if reduction == "sum":
            return loss_c.sum()
        if reduction == "mean":
            return loss_c.sum() / nc  # NaN when no token counts, like F.cross_entropy
        return torch.zeros(n, dtype=torch.float32, device=h_nd.device).index_copy_(0, rows_c, loss_c)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        h_nd, weight_vd, rows_c, labels_c, lse_c = ctx.saved_tensors
        reduction, chunk_tokens, chunk_vocab, z_loss = ctx.cfg
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        v, d = weight_vd.shape
        nc = rows_c.numel()
        if reduction == "none":
            g_c = grad_out.float().index_select(0, rows_c)
        else:
            g = grad_out.float() / (nc if reduction == "mean" else 1)
            g_c = g.expand(nc)
        h_cd = h_nd.index_select(0, rows_c)
        dh_cd = empty_output((nc, d), h_nd.dtype, h_nd.device) if need_h else None
        dw_vd = torch.zeros(v, d, dtype=torch.float32, device=h_nd.device) if need_w else None
        for t0 in range(0, nc, chunk_tokens):
            h_td = h_cd[t0:t0 + chunk_tokens]
            lab_t, lse_t, g_t = (x[t0:t0 + chunk_tokens] for x in (labels_c, lse_c, g_c))
            scale_t = g_t * (1 + 2 * z_loss * lse_t) if z_loss else g_t
            dh_td = torch.zeros(h_td.shape[0], d, device=h_nd.device) if need_h else None
            for v0 in range(0, v, chunk_vocab):
                w_vd = weight_vd[v0:v0 + chunk_vocab]
                dlogits_tv = _logits(h_td, w_vd).sub_(lse_t[:, None]).exp_().mul_(scale_t[:, None])
                width = dlogits_tv.shape[1]
                in_chunk = ((lab_t >= v0) & (lab_t < v0 + width)).float()
                local = (lab_t - v0).clamp(0, width - 1).unsqueeze(1)
                dlogits_tv.scatter_add_(1, local, (-g_t * in_chunk).unsqueeze(1))
                dlogits_tv = dlogits_tv.to(h_nd.dtype)
                if need_h:
                    _accumulate(dh_td, dlogits_tv, w_vd)
                if need_w:
                    _accumulate(dw_vd[v0:v0 + width], dlogits_tv.t(), h_td)
                del dlogits_tv  # free the block before the next one is allocated
            if need_h:
                dh_cd[t0:t0 + chunk_tokens] = dh_td
        dh_nd = None
        if need_h:
            dh_nd = torch.zeros_like(h_nd).index_copy_(0, rows_c, dh_cd)
        dw = dw_vd.to(weight_vd.dtype) if need_w else None
        return dh_nd, dw, None, None, None, None, None, None


@register("fused_linear_cross_entropy", "reference")
def fused_linear_cross_entropy_chunked(h_nd: torch.Tensor, weight_vd: torch.Tensor, labels_n: torch.Tensor,
                                       ignore_index: int = -100, reduction: str = "sum", chunk_tokens: int = 1024,
                                       chunk_vocab: int = 8192, z_loss: float = 0.0) -> torch.Tensor:
    """Chunked, online-logsumexp linear cross-entropy (plain torch; see the module docstring)."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if h_nd.dim() != 2 or weight_vd.dim() != 2 or h_nd.shape[1] != weight_vd.shape[1]:
        raise ValueError(f"expected h [N, D] and weight [V, D]; got {tuple(h_nd.shape)}, {tuple(weight_vd.shape)}")
    if labels_n.shape != h_nd.shape[:1]:
        raise ValueError(f"labels must have shape ({h_nd.shape[0]},), got {tuple(labels_n.shape)}")
    if chunk_tokens < 1 or chunk_vocab < 1:
        raise ValueError("chunk_tokens and chunk_vocab must be positive")
    return _FusedLinearCrossEntropy.apply(h_nd, weight_vd, labels_n, ignore_index, reduction, chunk_tokens,
                                          chunk_vocab, float(z_loss))


# ----------------------------------------------------------------------------------------------- triton
def _ce_grad_kernel(x_ptr, lab_ptr, loss_ptr, V, stride_x, z_loss,
                    HAS_Z: tl.constexpr, BLOCK: tl.constexpr):
    """Row r of logits x [rows, V]: loss[r] = lse - x[label] (+ z lse^2); x[r] <- d loss / d x (in place)."""
    r = tl.program_id(0).to(tl.int64)
    row = x_ptr + r * stride_x
    cols = tl.arange(0, BLOCK)
    # masked lanes hold a finite -1e30 (not -inf: no -inf - -inf); their terms vanish against the row max
    m = tl.full([BLOCK], -1e30, tl.float32)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for v0 in range(0, V, BLOCK):
        x = tl.load(row + v0 + cols, mask=v0 + cols < V, other=-1e30).to(tl.float32)
        new_m = tl.maximum(m, x)
        acc = acc * tl.exp(m - new_m) + tl.exp(x - new_m)
        m = new_m
    row_max = tl.max(m, axis=0)
    total = tl.sum(acc * tl.exp(m - row_max), axis=0)
    lse = row_max + tl.log(total)
    label = tl.load(lab_ptr + r)
    target = tl.load(row + label).to(tl.float32)
    loss = lse - target
    scale = 1.0
    if HAS_Z:
        loss += z_loss * lse * lse
        scale = 1.0 + 2.0 * z_loss * lse
    tl.store(loss_ptr + r, loss)
    for v0 in range(0, V, BLOCK):
        mask = v0 + cols < V
        x = tl.load(row + v0 + cols, mask=mask, other=0.0).to(tl.float32)
        g = tl.exp(x - lse) * scale - tl.where(v0 + cols == label, 1.0, 0.0)
        tl.store(row + v0 + cols, g.to(x_ptr.dtype.element_ty), mask=mask)


class _FusedLinearCrossEntropyTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_nd: torch.Tensor, weight_vd: torch.Tensor, labels_n: torch.Tensor, ignore_index: int,
                reduction: str, chunk_tokens: int, z_loss: float, need_h: bool, need_w: bool) -> torch.Tensor:
        v, d = weight_vd.shape
        rows_c, labels_c, h_cd = _counted_tokens(h_nd, labels_n, ignore_index, v)
        nc = h_cd.shape[0]
        loss_c = empty_output((nc,), torch.float32, h_nd.device)
        dh_cd = empty_output((nc, d), h_nd.dtype, h_nd.device) if need_h else None
        dw_vd = torch.zeros(v, d, dtype=torch.float32, device=h_nd.device) if need_w else None
        block = min(next_pow2(v), 4096)
        for t0 in range(0, nc, chunk_tokens):
            h_td = h_cd[t0:t0 + chunk_tokens]
            logits_tv = h_td @ weight_vd.t()  # becomes d loss / d logits in place
            triton_jit(_ce_grad_kernel)[(h_td.shape[0],)](
                logits_tv, labels_c[t0:t0 + chunk_tokens], loss_c[t0:t0 + chunk_tokens], v, logits_tv.stride(0),
                float(z_loss), HAS_Z=bool(z_loss), BLOCK=block, num_warps=8 if block >= 2048 else 4)
            if need_h:
                torch.mm(logits_tv, weight_vd, out=dh_cd[t0:t0 + chunk_tokens])
            if need_w:
                _accumulate(dw_vd, logits_tv.t(), h_td)
            del logits_tv
        dh_nd = torch.zeros_like(h_nd).index_copy_(0, rows_c, dh_cd) if need_h else None
        ctx.save_for_backward(dh_nd, dw_vd)
        ctx.cfg = (reduction, nc, weight_vd.dtype)
        total = loss_c.sum()
        return total if reduction == "sum" else total / nc  # mean: NaN when nothing counts, as F.cross_entropy

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        dh_nd, dw_vd = ctx.saved_tensors
        reduction, nc, w_dtype = ctx.cfg
        g = grad_out.float() / (nc if reduction == "mean" and nc else 1)  # nothing counted: zero gradients
        dh = (dh_nd * g).to(dh_nd.dtype) if dh_nd is not None else None
        dw = (dw_vd * g).to(w_dtype) if dw_vd is not None else None
        return dh, dw, None, None, None, None, None, None, None


@register("fused_linear_cross_entropy", "triton", eager=True)  # (compiled: called eagerly)
def fused_linear_cross_entropy_triton(h_nd: torch.Tensor, weight_vd: torch.Tensor, labels_n: torch.Tensor,
                                      ignore_index: int = -100, reduction: str = "sum", chunk_tokens: int = 1024,
                                      chunk_vocab: int = 8192, z_loss: float = 0.0) -> torch.Tensor:
    """Linear cross-entropy with the gradient computed in the forward pass (see the module docstring);
    ``chunk_vocab`` is unused (whole-vocabulary rows). ``reduction="none"``, 64-bit or mixed dtypes and empty
    inputs run the reference."""
    ok = (reduction != "none" and h_nd.dtype == weight_vd.dtype and h_nd.numel() > 0 and weight_vd.numel() > 0
          and triton_dtypes(h_nd) and h_nd.dim() == 2 and weight_vd.dim() == 2
          and labels_n.shape == h_nd.shape[:1] and h_nd.shape[1] == weight_vd.shape[1] and chunk_tokens >= 1)
    if not ok:
        return fused_linear_cross_entropy_chunked(h_nd, weight_vd, labels_n, ignore_index, reduction, chunk_tokens,
                                                  chunk_vocab, z_loss)
    grad = torch.is_grad_enabled()
    return _FusedLinearCrossEntropyTriton.apply(h_nd, weight_vd, labels_n, ignore_index, reduction, chunk_tokens,
                                                float(z_loss), grad and h_nd.requires_grad,
                                                grad and weight_vd.requires_grad)


def linear_cross_entropy_naive(h_nd: torch.Tensor, weight_vd: torch.Tensor, labels_n: torch.Tensor,
                               ignore_index: int = -100, reduction: str = "sum", z_loss: float = 0.0
                               ) -> torch.Tensor:
    """The spec: full fp32 logits and ``F.cross_entropy`` (plus the z-loss over counted tokens)."""
    logits_nv = (h_nd @ weight_vd.t()).float()
    loss = F.cross_entropy(logits_nv, labels_n, ignore_index=ignore_index, reduction=reduction)
    if z_loss:
        counted_n = labels_n != ignore_index
        z_n = z_loss * torch.logsumexp(logits_nv, dim=-1).square() * counted_n
        loss = loss + {"sum": z_n.sum(), "mean": z_n.sum() / counted_n.sum(), "none": z_n}[reduction]
    return loss


def fused_linear_cross_entropy(h_nd: torch.Tensor, weight_vd: torch.Tensor, labels_n: torch.Tensor,
                               ignore_index: int = -100, reduction: str = "sum", chunk_tokens: int = 1024,
                               chunk_vocab: int = 8192, z_loss: float = 0.0) -> torch.Tensor:
    """Cross-entropy of ``h_nd @ weight_vd.T`` against ``labels_n`` (fp32 result), chunked over tokens and
    vocabulary; ``reduction`` ``"sum"`` (the trainer's), ``"mean"`` over counted tokens, or ``"none"`` ([N],
    zero at ignored tokens); ``z_loss`` adds ``z_loss * logsumexp^2`` per counted token.

    Under autocast both operands are cast to autocast's dtype here: the backends' backward passes run outside
    autocast and would otherwise multiply a 16-bit hidden state with an fp32 weight (e.g. the MTP head's)."""
    dev = h_nd.device.type
    if torch.is_autocast_enabled(dev):
        dtype = torch.get_autocast_dtype(dev)
        h_nd, weight_vd = h_nd.to(dtype), weight_vd.to(dtype)
    return get("fused_linear_cross_entropy", dev)(
        h_nd, weight_vd, labels_n, ignore_index, reduction, chunk_tokens, chunk_vocab, z_loss)
