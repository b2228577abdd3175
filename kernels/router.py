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

Gradients flow from the weights to the logits (selection is not differentiable).
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from kernels.registry import get, register

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
