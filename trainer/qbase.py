"""A frozen base kept quantised in memory (QLoRA): the published checkpoint's FP8 block weights and MXFP4 experts
stay as codes + scales and are dequantised for each use, in the forward and again in the backward, one layer's
projection at a time; nothing dequantised lives from a forward to its backward.

- :class:`FrozenQuantLinear` stands in for a frozen ``nn.Linear`` (same ``in_features`` / ``out_features``; a
  LoRA adapter hooks it like a Linear);
- :class:`FrozenQuantExperts` holds an MoE layer's routed experts (``MoE.frozen_experts``): ``weights()`` gives
  the three zero-argument callables ``kernels.moe_experts_lora`` dequantises on demand.

The dequantisers are passed in (``dequant(codes, scale, dtype) -> [out, in]``: ``trainer.hub.quant``), so this
module imports nothing of the checkpoint code; ``trainer.hub.frozen_base`` builds a model with them. The codes are
non-persistent buffers: a checkpoint of an adapted model holds the adapters, the base is the init checkpoint.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

Dequant = Callable[[torch.Tensor, torch.Tensor, torch.dtype], torch.Tensor]


class _QuantLinearFn(torch.autograd.Function):
    """``x @ W.T`` with ``W = weight(dtype)`` produced in the forward and again in the backward (dx only)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: Callable[[torch.dtype], torch.Tensor]) -> torch.Tensor:
        ctx.weight = weight
        return F.linear(x, weight(x.dtype))

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        return dy @ ctx.weight(dy.dtype), None


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype


class FrozenQuantLinear(nn.Module):
    """A frozen Linear whose weight ``[out, in]`` is ``dequant(codes, scale)`` (no bias)."""

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, dequant: Dequant, in_features: int,
                 out_features: int):
        super().__init__()
        self.register_buffer("codes", codes, persistent=False)
        self.register_buffer("scale", scale, persistent=False)
        self.dequant, self.in_features, self.out_features = dequant, in_features, out_features

    def weight_as(self, dtype: torch.dtype) -> torch.Tensor:
        with torch.no_grad():
            return self.dequant(self.codes, self.scale, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dt = _compute_dtype(x)
        with torch.autocast(x.device.type, enabled=False):
            return _QuantLinearFn.apply(x.to(dt), self.weight_as)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, codes={self.codes.dtype}"


class FrozenQuantExperts(nn.Module):
    """One MoE layer's routed experts, quantised: per projection ``codes_<p> [E, out, in(/2)]`` and ``scale_<p>``
    in the checkpoint's per-expert ``[out, in]`` orientation; :meth:`weight` gives the native ``[E, D_in, D_out]``."""

    PROJECTIONS = ("gate", "up", "down")

    def __init__(self, codes: dict[str, torch.Tensor], scales: dict[str, torch.Tensor], dequant: Dequant,
                 dtype: torch.dtype = torch.float32):
        super().__init__()
        for p in self.PROJECTIONS:
            self.register_buffer(f"codes_{p}", codes[p], persistent=False)
            self.register_buffer(f"scale_{p}", scales[p], persistent=False)
        self.dequant, self.dtype = dequant, dtype

    def weight(self, p: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        codes, scale = getattr(self, f"codes_{p}"), getattr(self, f"scale_{p}")
        e, out = codes.shape[:2]
        with torch.no_grad():
            w = self.dequant(codes.reshape(e * out, -1), scale.reshape(e * out, -1), dtype or self.dtype)
        return w.view(e, out, -1).transpose(1, 2)  # [E, in, out]

    def weights(self, dtype: torch.dtype | None = None) -> tuple[Callable[[], torch.Tensor], ...]:
        return tuple((lambda p=p: self.weight(p, dtype)) for p in self.PROJECTIONS)


def frozen_bytes(model: nn.Module) -> dict[str, int]:
    """Resident bytes of the model: the quantised base's codes and scales, the other frozen tensors, the trained
    parameters (what a measured miniature compares with the checkpoint's size)."""
    quant = sum(b.numel() * b.element_size() for m in model.modules()
                if isinstance(m, (FrozenQuantLinear, FrozenQuantExperts)) for b in m.buffers(recurse=False))
    frozen = sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad and not p.is_meta)
    trained = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return {"quantised": quant, "frozen_dense": frozen, "trained": trained}
