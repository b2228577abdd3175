"""Sink attention: every query head over one shared K=V head, a learned sink logit per head, a boolean mask.

``out[b, h, t] = sum_s p[b, h, t, s] * kv[b, s]`` with ``p = softmax([q . kv_s * C^-0.5 for visible s] + [sink_h])``
over the visible keys and one extra logit ``sink_h`` whose value is zero (DeepSeek-V4's attention core:
``Attention._attend``; its CPU path is ``trainer/models/deepseek_v4/cpu_attention.py``).

Backends:

* ``reference``: one fused ``scaled_dot_product_attention`` call. Heads are folded into the query rows
  (``[B, 1, H*T, C]``) so K/V are never copied per head; the sink is an extra key that holds 1 in an extra
  channel where every real key holds 0, and each query holds ``sink_h / scale`` there. It computes the whole
  ``T x S`` rectangle the mask covers, and the dense additive mask it needs costs ``O(H T S)`` memory.
* ``triton``: FlexAttention (``torch.nn.attention.flex_attention``, compiled: inductor generates the Triton
  kernel) with the mask as a **block mask**, so key blocks a query block cannot see are skipped (a sliding
  window or a compressed layer's selected entries cost what they hold). The sink is not a key: with ``Z`` the
  softmax denominator over the visible keys and ``lse = log Z`` (FlexAttention returns and differentiates it),
  the sink scales each output row by ``Z / (Z + e^{sink_h}) = sigmoid(lse - sink_h)``. CUDA only (FlexAttention
  has no CPU backward in torch 2.13 and no NPU kernel): elsewhere, and without autograd (inference: every new
  prompt length would compile a kernel), it runs the reference. ``TREX_KERNEL_SINK_ATTENTION=reference`` (or
  ``kernels.use_backends(sink_attention="reference")``) keeps masked SDPA on CUDA.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from kernels.registry import get, register

BLOCK = 128  # query and key block of the block mask
# the reference's head width (C + the sink channel) is padded with zeros to a multiple of this: CUDA's
# memory-efficient SDPA kernel (the fused one that takes a mask) needs it, and a width of C + 1 sent SDPA to its
# math path (fp32 score matrices) on an H200
SINK_ALIGN = 8


def sink_attention(q_bhtc: torch.Tensor, kv_bsc: torch.Tensor, sinks_h: torch.Tensor,
                   mask_bts: torch.Tensor) -> torch.Tensor:
    """``[B, H, T, C]``: attention of ``q`` over the rows of ``kv_bsc`` (keys = values) visible in ``mask_bts``
    ([B, T, S] bool), plus a sink logit per head."""
    return get("sink_attention", q_bhtc.device.type)(q_bhtc, kv_bsc, sinks_h, mask_bts)


@register("sink_attention", "reference")
def sink_attention_reference(q_bhtc, kv_bsc, sinks_h, mask_bts) -> torch.Tensor:
    b, h, t, c = q_bhtc.shape
    s = kv_bsc.shape[1]
    scale = c ** -0.5
    w = -(-(c + 1) // SINK_ALIGN) * SINK_ALIGN  # the head width with the sink channel, rounded up
    sink_q = (sinks_h.to(q_bhtc.dtype) / scale).view(1, h, 1, 1).expand(b, h, t, 1)
    q = F.pad(torch.cat([q_bhtc, sink_q], dim=-1), (0, w - c - 1)).reshape(b, 1, h * t, w)
    rows = F.pad(kv_bsc, (0, w - c))  # real keys: 0 in the sink channel (and the padding)
    sink_key, sink_value = kv_bsc.new_zeros(b, 1, w), kv_bsc.new_zeros(b, 1, w)
    sink_key[..., c] = 1.0  # (no host tensor to copy to the device on every call)
    k = torch.cat([rows, sink_key], dim=1)
    v = torch.cat([rows, sink_value], dim=1)  # (V = K; equal widths keep SDPA on a fused kernel)
    mask = torch.cat([mask_bts, mask_bts.new_ones(b, t, 1)], dim=-1)
    mask = mask[:, None].expand(b, h, t, s + 1).reshape(b, 1, h * t, s + 1)
    out = F.scaled_dot_product_attention(q, k[:, None], v[:, None], attn_mask=mask, scale=scale)
    return out[..., :c].view(b, h, t, c)


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def block_mask_of(mask_bts: torch.Tensor, compile_: bool = True):
    """A FlexAttention ``BlockMask`` of the dense boolean mask ``[B, T, S]`` (the same for every head)."""
    from torch.nn.attention.flex_attention import create_block_mask

    b, t, s = mask_bts.shape

    def mask_mod(bi, hi, qi, ki):
        return mask_bts[bi, qi, ki]

    return create_block_mask(mask_mod, B=b, H=None, Q_LEN=t, KV_LEN=s, device=mask_bts.device,
                             BLOCK_SIZE=BLOCK, _compile=compile_)


def flex_sink_attention(q_bhtc, kv_bsc, sinks_h, mask_bts, flex=None, compile_mask: bool = True) -> torch.Tensor:
    """The ``triton`` backend's computation with ``flex`` as the FlexAttention function (default: compiled)."""
    from torch.nn.attention.flex_attention import AuxRequest

    c, device = q_bhtc.shape[-1], q_bhtc.device.type
    # one dtype for the kernel: autocast's (as autocast casts SDPA's inputs), else the query's
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else q_bhtc.dtype
    kv = kv_bsc.to(dtype)[:, None]  # [B, 1, S, C]: one KV head for every query head
    out, aux = (flex or _compiled_flex())(q_bhtc.to(dtype), kv, kv, block_mask=block_mask_of(mask_bts, compile_mask),
                                          scale=c ** -0.5, enable_gqa=True, return_aux=AuxRequest(lse=True))
    gate = torch.sigmoid(aux.lse - sinks_h.float().view(1, -1, 1))  # [B, H, T]
    return out * gate.unsqueeze(-1).to(out.dtype)


def _flex_applies(q_bhtc: torch.Tensor) -> bool:
    """Training on CUDA: elsewhere, and without autograd, the ``triton`` backend runs the reference."""
    return q_bhtc.device.type == "cuda" and torch.is_grad_enabled()


def _traced_flex(q_bhtc, kv_bsc, sinks_h, mask_bts) -> torch.Tensor:
    """What ``torch.compile`` traces for the ``triton`` backend: FlexAttention as a graph op (dynamo handles it
    natively; calling the separately compiled function would break the graph)."""
    if not _flex_applies(q_bhtc):
        return sink_attention_reference(q_bhtc, kv_bsc, sinks_h, mask_bts)
    from torch.nn.attention.flex_attention import flex_attention

    return flex_sink_attention(q_bhtc, kv_bsc, sinks_h, mask_bts, flex=flex_attention, compile_mask=False)


@register("sink_attention", "triton", traced=_traced_flex)
def sink_attention_triton(q_bhtc, kv_bsc, sinks_h, mask_bts) -> torch.Tensor:
    if not _flex_applies(q_bhtc):
        return sink_attention_reference(q_bhtc, kv_bsc, sinks_h, mask_bts)
    return flex_sink_attention(q_bhtc, kv_bsc, sinks_h, mask_bts)
