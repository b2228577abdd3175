"""MoE router: scores, (group-limited) top-k selection steered by the expert bias, combine weights.

Semantics (those of ``trainer.models.deepseek_v4.model.MoE.route``):

* ``scores = score(logits)`` with ``sigmoid``, ``softmax`` or ``sqrtsoftplus`` (``sqrt(softplus(x))``), computed
  in the logits' dtype (pass fp32 logits for fp32 routing);
* selection: ``topk(scores + bias, k)`` -- the aux-loss-free balancing bias only steers *which* experts are
  picked; with ``n_groups > 1`` the experts are split into ``n_groups`` equal groups, each group is scored by
  the sum of its two best biased scores (its best one when a group holds one expert), the ``topk_groups``
  best groups are kept and the rest masked to ``-inf`` before the top-k (DeepSeek-V3 ``noaux_tc``);
* weights: the *unbiased* scores of the chosen experts, renormalised to sum to one when ``norm_topk``
  (``w / (sum w + 1e-20)``), times ``routed_scaling_factor``;
* hash routing: pass ``indices_nk`` (``tid2eid[token_ids]``) and only the weights are computed.

Gradients flow from the weights (and the returned scores) to the logits (selection is not differentiable).

Backends: ``reference`` (the model's ops), ``triton`` (one kernel for scores + biased top-k + weights, one for
the backward; ``n_groups == 1`` -- DeepSeek-V4 routes without groups -- and hash routing; group-limited
routing runs the reference), ``torch_npu`` (``npu_moe_gating_top_k`` for the selection).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.nn.functional as F

from kernels.registry import cdiv, empty_output, get, next_pow2, register, triton_dtypes, triton_jit

tl: Any = None  # triton.language, bound by registry.triton_jit on first use

SCORINGS = ("sigmoid", "softmax", "sqrtsoftplus")
NORM_EPS = 1e-20


def score(logits_ne: torch.Tensor, scoring: str) -> torch.Tensor:
    """Router scores from gate logits, op for op as the model computes them."""
    if scoring == "sigmoid":
        return logits_ne.sigmoid()
    if scoring == "softmax":
        return logits_ne.softmax(dim=-1)
    if scoring == "sqrtsoftplus":
        return F.softplus(logits_ne).sqrt()
    raise ValueError(f"scoring must be one of {SCORINGS}, got {scoring!r}")


def _check(n_experts: int, k: int, scoring: str, n_groups: int, topk_groups: int) -> None:
    if scoring not in SCORINGS:
        raise ValueError(f"scoring must be one of {SCORINGS}, got {scoring!r}")
    if n_groups < 1 or n_experts % n_groups:
        raise ValueError(f"n_groups={n_groups} must divide n_experts={n_experts}")
    if not 1 <= topk_groups <= n_groups:
        raise ValueError(f"topk_groups={topk_groups} must be in [1, n_groups={n_groups}]")
    if not 1 <= k <= n_experts // n_groups * topk_groups:
        raise ValueError(f"k={k} must be in [1, {n_experts // n_groups * topk_groups}] "
                         f"(experts per group x topk_groups)")


@torch.no_grad()
def select_experts(biased_ne: torch.Tensor, k: int, n_groups: int = 1, topk_groups: int = 1) -> torch.Tensor:
    """Indices [N, k] of the top-k biased scores, restricted to the ``topk_groups`` best expert groups."""
    if n_groups > 1:
        n, e = biased_ne.shape
        grouped_ngj = biased_ne.view(n, n_groups, e // n_groups)
        if e // n_groups >= 2:
            group_score_ng = grouped_ngj.topk(2, dim=-1).values.sum(dim=-1)
        else:
            group_score_ng = grouped_ngj.amax(dim=-1)
        keep_ng = group_score_ng.topk(topk_groups, dim=-1).indices
        mask_ng = torch.zeros_like(group_score_ng, dtype=torch.bool).scatter_(1, keep_ng, True)
        biased_ne = grouped_ngj.masked_fill(~mask_ng.unsqueeze(-1), float("-inf")).view(n, e)
    return torch.topk(biased_ne, k, dim=-1, sorted=False).indices


def combine_weights(scores_ne: torch.Tensor, indices_nk: torch.Tensor, routed_scaling_factor: float,
                    norm_topk: bool = True) -> torch.Tensor:
    """The chosen experts' unbiased scores, renormalised (``norm_topk``) and scaled."""
    w_nk = scores_ne.gather(1, indices_nk)
    if norm_topk:
        w_nk = w_nk / (w_nk.sum(dim=-1, keepdim=True) + NORM_EPS)
    return w_nk * routed_scaling_factor


@register("router", "reference")
def route_reference(logits_ne: torch.Tensor, bias_e: torch.Tensor | None, k: int, scoring: str,
                    routed_scaling_factor: float, norm_topk: bool = True, n_groups: int = 1,
                    topk_groups: int = 1, indices_nk: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weights [N, k], expert indices [N, k] int64, scores [N, E]) -- plain torch, any device."""
    _check(logits_ne.shape[-1], k, scoring, n_groups, topk_groups)
    scores_ne = score(logits_ne, scoring)
    if indices_nk is None:
        biased_ne = scores_ne if bias_e is None else scores_ne + bias_e
        indices_nk = select_experts(biased_ne, k, n_groups, topk_groups)
    else:
        indices_nk = indices_nk.long()
    return combine_weights(scores_ne, indices_nk, routed_scaling_factor, norm_topk), indices_nk, scores_ne


# ----------------------------------------------------------------------------------------------- triton
_SCORING_ID = {"sigmoid": 0, "softmax": 1, "sqrtsoftplus": 2}


def _router_scores(x, SCORING: tl.constexpr):
    """fp32 scores of fp32 logits ``x`` [BN, EP] (padding lanes hold -inf)."""
    if SCORING == 0:
        s = tl.sigmoid(x)
    elif SCORING == 1:
        e = tl.exp(x - tl.max(x, axis=1)[:, None])
        s = e / tl.sum(e, axis=1)[:, None]
    else:
        sp = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))  # softplus, torch's threshold
        s = tl.sqrt(sp)
    return s


def _router_logits(x_ptr, N, E, BN: tl.constexpr, EP: tl.constexpr):
    """The program's rows of fp32 logits [BN, EP] (padding experts -inf; rows past N zeros, never stored),
    with the row and column masks."""
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    cols = tl.arange(0, EP)
    rmask, cmask = rows < N, cols < E
    mask = rmask[:, None] & cmask[None, :]
    x = tl.load(x_ptr + rows[:, None] * E + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    return tl.where(cmask[None, :], x, float("-inf")), rows, cols, rmask, cmask, mask


def _router_fwd_kernel(x_ptr, b_ptr, s_ptr, idx_ptr, w_ptr, N, E, scale,
                       SCORING: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_IDX: tl.constexpr, NORM: tl.constexpr,
                       K: tl.constexpr, BN: tl.constexpr, EP: tl.constexpr):
    x, rows, cols, rmask, cmask, mask = _router_logits(x_ptr, N, E, BN, EP)
    # scores rounded to the logits' dtype, as the reference computes them in that dtype
    s = _router_scores(x, SCORING).to(s_ptr.dtype.element_ty)
    tl.store(s_ptr + rows[:, None] * E + cols[None, :], s, mask=mask)
    s = s.to(tl.float32)
    biased = s
    if HAS_BIAS:
        biased = s + tl.load(b_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    biased = tl.where(cmask[None, :], biased, float("-inf"))
    total = tl.zeros([BN], dtype=tl.float32)
    for j in tl.static_range(K):
        if HAS_IDX:
            pick = tl.load(idx_ptr + rows * K + j, mask=rmask, other=0).to(tl.int32)
        else:
            pick = tl.argmax(biased, axis=1).to(tl.int32)  # first of equal maxima, as torch.topk on ties
            tl.store(idx_ptr + rows * K + j, pick.to(tl.int64), mask=rmask)
            biased = tl.where(cols[None, :] == pick[:, None], float("-inf"), biased)
        sj = tl.sum(tl.where(cols[None, :] == pick[:, None], s, 0.0), axis=1)
        tl.store(w_ptr + rows * K + j, sj, mask=rmask)  # unnormalised, rescaled below
        total += sj
    denom = total + 1e-20
    for j in tl.static_range(K):
        sj = tl.load(w_ptr + rows * K + j, mask=rmask, other=0.0).to(tl.float32)
        wj = sj / denom * scale if NORM else sj * scale
        tl.store(w_ptr + rows * K + j, wj.to(w_ptr.dtype.element_ty), mask=rmask)


def _router_bwd_kernel(x_ptr, idx_ptr, dw_ptr, ds_ptr, dx_ptr, N, E, scale,
                       SCORING: tl.constexpr, HAS_DS: tl.constexpr, NORM: tl.constexpr,
                       K: tl.constexpr, BN: tl.constexpr, EP: tl.constexpr):
    x, rows, cols, rmask, cmask, mask = _router_logits(x_ptr, N, E, BN, EP)
    s = tl.where(mask, _router_scores(x, SCORING), 0.0)
    total = tl.zeros([BN], dtype=tl.float32)
    gs = tl.zeros([BN], dtype=tl.float32)  # sum_j g_j s_j
    for j in tl.static_range(K):
        pick = tl.load(idx_ptr + rows * K + j, mask=rmask, other=0).to(tl.int32)
        sj = tl.sum(tl.where(cols[None, :] == pick[:, None], s, 0.0), axis=1)
        gj = tl.load(dw_ptr + rows * K + j, mask=rmask, other=0.0).to(tl.float32)
        total += sj
        gs += gj * sj
    denom = total + 1e-20
    ds = tl.zeros([BN, EP], dtype=tl.float32)
    if HAS_DS:
        ds = tl.load(ds_ptr + rows[:, None] * E + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    for j in tl.static_range(K):
        pick = tl.load(idx_ptr + rows * K + j, mask=rmask, other=0).to(tl.int32)
        gj = tl.load(dw_ptr + rows * K + j, mask=rmask, other=0.0).to(tl.float32)
        if NORM:
            d_sj = scale * (gj / denom - gs / (denom * denom))
        else:
            d_sj = scale * gj
        ds += tl.where(cols[None, :] == pick[:, None], d_sj[:, None], 0.0)
    if SCORING == 0:
        dx = ds * s * (1.0 - s)
    elif SCORING == 1:
        dx = s * (ds - tl.sum(ds * s, axis=1)[:, None])
    else:  # d sqrt(softplus(x)) = sigmoid(x) / (2 sqrt(softplus(x)))
        dx = ds * tl.sigmoid(x) / (2.0 * tl.maximum(s, 1e-30))
    tl.store(dx_ptr + rows[:, None] * E + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)


_HELPERS = (_router_scores, _router_logits)  # the plain functions the kernels call (JITted with them)


def _router_grid(n: int, e: int) -> tuple[int, int, tuple[int]]:
    ep = next_pow2(e)
    bn = max(1, min(64, 4096 // ep))
    return bn, ep, (cdiv(n, bn),)


class _RouteTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_ne, bias_e, indices_nk, k, scoring, scale, norm_topk):
        n, e = logits_ne.shape
        x = logits_ne.contiguous()
        scores = empty_output((n, e), x.dtype, x.device)
        has_idx = indices_nk is not None
        idx = indices_nk.long().contiguous() if has_idx else torch.empty(n, k, dtype=torch.long, device=x.device)
        w = empty_output((n, k), x.dtype, x.device)
        bn, ep, grid = _router_grid(n, e)
        if n:
            triton_jit(_router_fwd_kernel, _HELPERS)[grid](
                x, bias_e if bias_e is not None else x, scores, idx, w, n, e, float(scale),
                SCORING=_SCORING_ID[scoring], HAS_BIAS=bias_e is not None, HAS_IDX=has_idx, NORM=norm_topk,
                K=k, BN=bn, EP=ep)
        ctx.save_for_backward(x, idx)
        ctx.cfg = (scoring, float(scale), norm_topk)
        ctx.mark_non_differentiable(idx)
        return w, idx, scores

    @staticmethod
    def backward(ctx, dw, _didx, dscores):
        x, idx = ctx.saved_tensors
        scoring, scale, norm_topk = ctx.cfg
        n, e = x.shape
        dx = empty_output((n, e), x.dtype, x.device)
        bn, ep, grid = _router_grid(n, e)
        if n:
            triton_jit(_router_bwd_kernel, _HELPERS)[grid](
                x, idx, dw.contiguous(), dscores.contiguous() if dscores is not None else x, dx, n, e, scale,
                SCORING=_SCORING_ID[scoring], HAS_DS=dscores is not None, NORM=norm_topk,
                K=idx.shape[1], BN=bn, EP=ep)
        return dx, None, None, None, None, None, None


@register("router", "triton", traced=route_reference)  # (compiled: inductor fuses it)
def route_triton(logits_ne: torch.Tensor, bias_e: torch.Tensor | None, k: int, scoring: str,
                 routed_scaling_factor: float, norm_topk: bool = True, n_groups: int = 1, topk_groups: int = 1,
                 indices_nk: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused scores -> biased top-k -> weights (and their backward) in Triton; indices come out ordered by
    biased score. Group-limited routing, 64-bit or empty logits and more than 1024 experts run the reference."""
    _check(logits_ne.shape[-1], k, scoring, n_groups, topk_groups)
    if (n_groups > 1 or logits_ne.dim() != 2 or logits_ne.shape[1] > 1024
            or not triton_dtypes(logits_ne)):
        return route_reference(logits_ne, bias_e, k, scoring, routed_scaling_factor, norm_topk, n_groups,
                               topk_groups, indices_nk)
    bias = None if bias_e is None else bias_e.detach().float().contiguous()
    return _RouteTriton.apply(logits_ne, bias, indices_nk, k, scoring, routed_scaling_factor, norm_topk)


_NPU_WARNED = False


@register("router", "torch_npu")
def route_npu(logits_ne: torch.Tensor, bias_e: torch.Tensor | None, k: int, scoring: str,
              routed_scaling_factor: float, norm_topk: bool = True, n_groups: int = 1, topk_groups: int = 1,
              indices_nk: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Selection by ``torch_npu.npu_moe_gating_top_k``; weights in torch (UNTESTED here: no torch_npu).

    Semantics matched: ``norm_type`` 1 (sigmoid) / 0 (softmax), bias added for selection,
    ``group_select_mode=1`` (group score = sum of its top-2), ``k_group=topk_groups``,
    ``group_count=n_groups``. Only the op's expert indices are used: its weight output is not
    differentiable and older CANN releases document it as taken from the *biased* scores, so the
    weights are gathered from the unbiased scores in torch (differentiable, identical to the reference).
    Logits and bias go in as fp32 (the op needs them in one dtype), so near-ties may pick differently
    from bf16 reference routing. ``sqrtsoftplus``, hash routing, and configurations the installed CANN
    rejects (A2/A3 releases document only E=256, k_group=4) fall back to the reference, warning once.
    """
    global _NPU_WARNED
    if indices_nk is not None or scoring not in ("sigmoid", "softmax"):
        return route_reference(logits_ne, bias_e, k, scoring, routed_scaling_factor, norm_topk, n_groups,
                               topk_groups, indices_nk)
    _check(logits_ne.shape[-1], k, scoring, n_groups, topk_groups)
    import torch_npu  # noqa: PLC0415  (lazy: only on Ascend)

    try:
        with torch.no_grad():
            bias = None if bias_e is None else bias_e.detach().float()
            _, idx_nk, _ = torch_npu.npu_moe_gating_top_k(
                logits_ne.detach().float(), k, bias=bias, k_group=topk_groups, group_count=n_groups,
                group_select_mode=1, renorm=0, norm_type=1 if scoring == "sigmoid" else 0, out_flag=False,
                routed_scaling_factor=1.0, eps=NORM_EPS)
    except (RuntimeError, TypeError, ValueError) as exc:
        if not _NPU_WARNED:
            warnings.warn(f"npu_moe_gating_top_k unavailable for this configuration ({exc}); using the "
                          f"reference router", stacklevel=2)
            _NPU_WARNED = True
        idx_nk = None
    return route_reference(logits_ne, bias_e, k, scoring, routed_scaling_factor, norm_topk, n_groups,
                           topk_groups, None if idx_nk is None else idx_nk.long())


def route(logits_ne: torch.Tensor, bias_e: torch.Tensor | None, k: int, scoring: str,
          routed_scaling_factor: float, norm_topk: bool = True, n_groups: int = 1, topk_groups: int = 1,
          indices_nk: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Route tokens to experts: ``(weights_nk, indices_nk, scores_ne)``; see the module docstring."""
    return get("router", logits_ne.device.type)(logits_ne, bias_e, k, scoring, routed_scaling_factor, norm_topk,
                                                n_groups, topk_groups, indices_nk)
