"""Vocabulary-parallel LM head + cross-entropy: each tp rank holds ``V / tp`` rows of the LM head.

Per chunk of tokens (the ``[tokens, V/tp]`` logit block is the only large buffer, never ``[N, V]``):
``lse = m + log sum_ranks sum_v exp(logit - m)`` with ``m`` the all-reduced max, and the target logit from the
rank that holds the label (all-reduced sum). Backward recomputes each block:
``dlogits = softmax - onehot``; ``dW_local = dlogits^T h`` stays local; ``dh = dlogits W_local`` is a partial sum
all-reduced over tp (``h`` is replicated there). Three small all-reduces per chunk forward, one per step
backward. Equals ``fused_linear_cross_entropy`` with the full head (tested through the TP layouts).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_nd, w_vd, labels_n, vocab_start: int, group, ignore_index: int, chunk: int):
        rows = (labels_n != ignore_index).nonzero().squeeze(1)
        h_cd, labels_c = h_nd.index_select(0, rows), labels_n.index_select(0, rows)
        v_local = w_vd.shape[0]
        local_c = labels_c - vocab_start
        mine = (local_c >= 0) & (local_c < v_local)
        lse = torch.empty(h_cd.shape[0], dtype=torch.float32, device=h_nd.device)
        total = torch.zeros((), dtype=torch.float32, device=h_nd.device)
        with torch.no_grad():
            for t0 in range(0, h_cd.shape[0], chunk):
                logits = (h_cd[t0:t0 + chunk] @ w_vd.t()).float()
                m = logits.max(dim=1).values
                dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
                se = (logits - m[:, None]).exp().sum(1)
                dist.all_reduce(se, group=group)
                sel, idx = mine[t0:t0 + chunk], local_c[t0:t0 + chunk].clamp(0, max(0, v_local - 1))
                target = logits.gather(1, idx[:, None]).squeeze(1).masked_fill(~sel, 0.0)
                dist.all_reduce(target, group=group)
                lse[t0:t0 + chunk] = m + se.log()
                total += (lse[t0:t0 + chunk] - target).sum()
        ctx.save_for_backward(h_nd, w_vd, rows, lse, local_c, mine)
        ctx.group, ctx.chunk = group, chunk
        return total

    @staticmethod
    def backward(ctx, g):
        h_nd, w_vd, rows, lse, local_c, mine = ctx.saved_tensors
        h_cd = h_nd.index_select(0, rows)
        dh_cd = torch.zeros(h_cd.shape, dtype=torch.float32, device=h_nd.device)
        dw = torch.zeros(w_vd.shape, dtype=torch.float32, device=w_vd.device)
        for t0 in range(0, h_cd.shape[0], ctx.chunk):
            h = h_cd[t0:t0 + ctx.chunk]
            p = ((h @ w_vd.t()).float() - lse[t0:t0 + ctx.chunk, None]).exp()
            sel = mine[t0:t0 + ctx.chunk].nonzero().squeeze(1)
            p[sel, local_c[t0:t0 + ctx.chunk][sel]] -= 1.0
            p = p * g
            dh_cd[t0:t0 + ctx.chunk] = p @ w_vd.float()
            dw.addmm_(p.t(), h.float())
        dist.all_reduce(dh_cd, group=ctx.group)
        dh = torch.zeros(h_nd.shape, dtype=h_nd.dtype, device=h_nd.device)
        dh.index_copy_(0, rows, dh_cd.to(h_nd.dtype))
        return dh, dw.to(w_vd.dtype), None, None, None, None, None


def vocab_parallel_cross_entropy(h_nd: torch.Tensor, w_local_vd: torch.Tensor, labels_n: torch.Tensor,
                                 vocab_start: int, group, ignore_index: int = -100, chunk: int = 512) -> torch.Tensor:
    """Summed cross-entropy of ``h @ W^T`` with ``W``'s rows split over ``group`` (this rank: ``w_local``,
    rows ``vocab_start ...``); ``h_nd`` and ``labels_n`` are the same on every rank of the group."""
    return _VocabParallelCE.apply(h_nd, w_local_vd, labels_n, vocab_start, group, ignore_index, chunk)
