"""Routed experts with a low-rank adapter per expert (LoRA) over a frozen base.

``moe_experts_lora(x_nd, indices_nk, weights_nk, base, lora, scale, limit)`` is ``moe_experts`` with every
projection ``p`` of every expert ``e`` replaced by ``W_p[e] + scale * A_p[e] @ B_p[e]``, computed without ever
forming that sum: permute -> per projection ``grouped_mm(x, W) + scale * grouped_mm(grouped_mm(x, A), B)`` ->
SwiGLU(limit) -> the same for down -> weighted unpermute (the grouped GEMM, permute and unpermute of the
registry's backend for the device: the CPU loop, Triton, torch_npu).

- ``base``: ``(w_gate [E, D, I], w_up [E, D, I], w_down [E, I, D])``, each a tensor (frozen, or trained too) or a
  zero-argument callable returning it: a quantised base dequantised on demand, called in the forward and again
  in the backward, so that no dequantised copy lives from one to the other (QLoRA: only one layer's projection
  is ever dense, and only while its GEMM runs). A callable's weight gets no gradient.
- ``lora``: ``{"gate" | "up" | "down": (a_edr [E, D_in, r], b_erk [E, r, D_out])}``; a missing projection has
  no adapter.

``moe_experts_lora_reference``: the merged weights through ``moe_experts_loop`` (the spec the tests hold it to).
"""

from __future__ import annotations

from typing import Callable, Union

import torch

from kernels.grouped_gemm import grouped_mm, moe_experts_loop, swiglu_limit
from kernels.moe_permute import permute, unpermute

Weight = Union[torch.Tensor, Callable[[], torch.Tensor]]
PROJECTIONS = ("gate", "up", "down")


class _FrozenGroupedMM(torch.autograd.Function):
    """``grouped_mm(x, weight_fn())`` differentiable in ``x`` only; the weight is produced again for the backward."""

    @staticmethod
    def forward(ctx, x_md: torch.Tensor, weight_fn: Callable[[], torch.Tensor], counts_e: torch.Tensor):
        ctx.weight_fn = weight_fn
        ctx.save_for_backward(counts_e)
        with torch.no_grad():
            return grouped_mm(x_md, weight_fn().to(x_md.dtype), counts_e)

    @staticmethod
    def backward(ctx, dy_mk: torch.Tensor):
        (counts_e,) = ctx.saved_tensors
        with torch.no_grad():
            w_edk = ctx.weight_fn().to(dy_mk.dtype)
            dx_md = grouped_mm(dy_mk, w_edk.transpose(1, 2), counts_e)
        return dx_md, None, None


def _base_mm(x_md: torch.Tensor, w: Weight, counts_e: torch.Tensor) -> torch.Tensor:
    if callable(w) and not isinstance(w, torch.Tensor):
        return _FrozenGroupedMM.apply(x_md, w, counts_e)
    return grouped_mm(x_md, w.to(x_md.dtype), counts_e)


def _projection(x_md, w: Weight, adapter, scale: float, counts_e):
    y = _base_mm(x_md, w, counts_e)
    if adapter is None:
        return y
    a_edr, b_erk = adapter
    low_mr = grouped_mm(x_md, a_edr.to(x_md.dtype), counts_e)
    return y + scale * grouped_mm(low_mr, b_erk.to(x_md.dtype), counts_e)


def _check(lora: dict, n_experts: int) -> None:
    unknown = set(lora) - set(PROJECTIONS)
    if unknown:
        raise ValueError(f"moe_experts_lora: unknown projections {sorted(unknown)} (known: {PROJECTIONS})")
    for name, (a, b) in lora.items():
        if a.dim() != 3 or b.dim() != 3 or a.shape[0] != n_experts or b.shape[0] != n_experts or a.shape[2] != b.shape[1]:
            raise ValueError(f"moe_experts_lora: {name} adapter must be A [E, D_in, r], B [E, r, D_out] with "
                             f"E={n_experts}; got {tuple(a.shape)}, {tuple(b.shape)}")


def _weight(w: Weight) -> torch.Tensor:
    return w() if callable(w) and not isinstance(w, torch.Tensor) else w


def moe_experts_lora(x_nd: torch.Tensor, indices_nk: torch.Tensor, weights_nk: torch.Tensor,
                     base: tuple[Weight, Weight, Weight], lora: dict[str, tuple[torch.Tensor, torch.Tensor]],
                     scale: float, limit: float) -> torch.Tensor:
    """Routed-expert output with per-expert adapters (see the module docstring); under ``torch.autocast`` the
    GEMMs run in the autocast dtype, as ``moe_experts``'s do."""
    w_gate, w_up, w_down = base
    n_experts = lora[next(iter(lora))][0].shape[0] if lora else _weight(w_gate).shape[0]
    _check(lora, n_experts)
    dev = x_nd.device.type
    if torch.is_autocast_enabled(dev):
        with torch.autocast(dev, enabled=False):
            return moe_experts_lora(x_nd.to(torch.get_autocast_dtype(dev)), indices_nk, weights_nk, base, lora,
                                    scale, limit)
    x_sorted_md, counts_e, order_m = permute(x_nd, indices_nk, n_experts)
    gate = _projection(x_sorted_md, w_gate, lora.get("gate"), scale, counts_e)
    up = _projection(x_sorted_md, w_up, lora.get("up"), scale, counts_e)
    h_mi = swiglu_limit(gate, up, limit)
    y_md = _projection(h_mi, w_down, lora.get("down"), scale, counts_e)
    return unpermute(y_md, order_m, weights_nk, x_nd.shape[0])


def merged_expert_weights(base: tuple[Weight, Weight, Weight], lora: dict, scale: float) -> list[torch.Tensor]:
    """``W_p + scale * A_p @ B_p`` per expert (float32 products): what a merge writes, and the reference's weights."""
    out = []
    for name, w in zip(PROJECTIONS, base):
        w = _weight(w)
        if name in lora:
            a, b = lora[name]
            w = (w.float() + scale * torch.bmm(a.float(), b.float())).to(w.dtype)
        out.append(w)
    return out


def moe_experts_lora_reference(x_nd, indices_nk, weights_nk, base, lora, scale, limit) -> torch.Tensor:
    """The merged weights through the model's per-expert loop (differentiable in the adapters through the merge)."""
    w_gate, w_up, w_down = merged_expert_weights(base, lora, scale)
    return moe_experts_loop(x_nd, indices_nk, weights_nk, w_gate, w_up, w_down, limit)
