"""Building blocks shared by the DeepSeek-V4 modules: RMSNorm (the ``rms_norm`` kernel), the local shard of a
parameter, and partial interleaved RoPE (YaRN for the compressed branches).

Shapes as in ``model.py``.
"""

from __future__ import annotations

import math
import sys

import torch
from torch import nn

from kernels import apply_rope as _rope_op
from kernels import rms_norm


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def shard_of(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a parameter that ``parallelize.py`` turned into a DTensor (else the tensor itself):
    the model's math runs on shards; the parallel regions around it live in ``trainer/parallel``. (An
    ``isinstance`` test, not ``hasattr(t, "to_local")``: under torch.compile the latter came out False for the
    DTensor parameters of tensor parallelism, and their global shapes met the local activations. The DTensor
    module is looked up, not imported: without it loaded there is no DTensor, and importing it costs ~0.5 s.)"""
    dtensor = sys.modules.get("torch.distributed.tensor")
    return t.to_local() if dtensor is not None and isinstance(t, dtensor.DTensor) else t


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS normalisation without a weight (queries per head, mHC inputs): the ``rms_norm`` kernel."""
    return rms_norm(x, None, eps)


# ----------------------------------------------------------------------------------------------- RoPE
def rope_inv_freq(rope_dim: int, theta: float, yarn=None) -> torch.Tensor:
    """One inverse frequency per interleaved channel pair; YaRN blends interpolation and extrapolation."""
    pos_freqs = theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float) / rope_dim)
    inv = 1.0 / pos_freqs
    if yarn is None:
        return inv

    def corr_dim(rot: float) -> float:
        return rope_dim * math.log(yarn.original_max_position_embeddings / (rot * 2 * math.pi)) / (2 * math.log(theta))

    low, high = max(math.floor(corr_dim(yarn.beta_fast)), 0), min(math.ceil(corr_dim(yarn.beta_slow)), rope_dim - 1)
    high = high + 0.001 if low == high else high
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp
    return (inv / yarn.factor) * (1 - extrapolate) + inv * extrapolate  # attention factor fixed at 1 (V4)


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype):
    ang = positions[..., None].float() * inv_freq.to(positions.device)
    return ang.cos().to(dtype), ang.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate consecutive channel pairs of the trailing ``2*F`` channels of ``x [B, H, T, C]``.

    ``cos``/``sin`` are ``[B, T, F]`` (one angle per pair); leading channels pass through (the ``rope`` kernel).
    """
    return _rope_op(x, cos, sin)


# -------------------------------------------------------------------------------------- compression
