"""RMSNorm: ``y = x / sqrt(mean(x^2) + eps) * weight``, computed in (at least) fp32 and cast back."""

from __future__ import annotations

import torch

from kernels.registry import get, register


@register("rms_norm", "reference")
def rms_norm_reference(x_nd: torch.Tensor, weight_d: torch.Tensor, eps: float) -> torch.Tensor:
    acc = torch.promote_types(x_nd.dtype, torch.float32)  # at least fp32 (fp64 stays fp64)
    xf = x_nd.to(acc)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight_d.to(acc)).to(x_nd.dtype)


def rms_norm(x_nd: torch.Tensor, weight_d: torch.Tensor, eps: float) -> torch.Tensor:
    return get("rms_norm", x_nd.device.type)(x_nd, weight_d, eps)
