"""RMSNorm: ``y = x / sqrt(mean(x^2) + eps) * weight``, computed in fp32 and cast back."""

from __future__ import annotations

import torch

from kernels.registry import get, register


@register("rms_norm", "reference")
def rms_norm_reference(x_nd: torch.Tensor, weight_d: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x_nd.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight_d.float()).to(x_nd.dtype)


def rms_norm(x_nd: torch.Tensor, weight_d: torch.Tensor, eps: float) -> torch.Tensor:
    return get("rms_norm", x_nd.device.type)(x_nd, weight_d, eps)
