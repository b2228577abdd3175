"""The CPU path of V4's attention core (``Attention._attend``): every head over one shared K=V head, a learned
sink logit per head, and a boolean visibility mask.

Two things make it faster than one masked ``scaled_dot_product_attention`` call on CPU, with the same values:

* **Query blocks over visible columns.** SDPA computes every key column a mask hides. The queries are split
  into blocks of ``CPU_QUERY_BLOCK`` and each block attends only to the key columns it can see (causal,
  windowed and compressed masks hide about half of them at the tiny model's 1,024-token context).
* **The sink as a mask column.** The portable path (``Attention._attend`` on other devices) appends a channel
  to queries and keys so that a zero-valued key carries the sink logit; a head width of 129 instead of 128 costs
  the CPU flash kernel ~13 %. Here the sink key and value are zero vectors and the additive mask's sink column
  holds the logit. SDPA does not differentiate its mask, so ``_SinkFlashCPU`` calls the CPU flash kernel and its
  backward directly and adds the sink gradient itself: ``d sink = -p_sink (dO . O)`` per query row, with
  ``p_sink = exp(sink - logsumexp)`` from the kernel's log-sum-exp.

**Compiled training** (:func:`fuse`, which the engines call with the model's compilation) replaces the flash
kernel where a block sees at most ``CPU_MATERIALISE_COLS`` columns: the score matrix is materialised
(``_SinkSoftmaxCPU``: two batched products forward, four backward -- the flash backward recomputes the scores,
five -- and the softmax over ``[logits, sink]`` and its gradient as compiled element-wise passes), in blocks of
``CPU_MATERIALISE_BLOCK`` queries. On the AMD AVX-512 host, bench_20m bf16: the CPU flash kernel ran the
``[8, 1024, 128] x [8, 128, ~256]`` blocks at ~160 GFLOP/s forward and ~220 backward, the batched products run at
~300-390; the compiled step 1.08x faster, blocks of 64 instead of 128 another ~1.03x (fp32: 1.02x). The cost is
memory: the block's probabilities (``[B, r*H, n]`` in the compute dtype) are kept for the backward -- hence the
cap on ``n``, above which (long contexts, a CSA block's union of selected entries) the flash kernel stays. Eager
code keeps the flash kernel: the element-wise passes uncompiled cost more than the products save.

Heads are folded into the query rows (``[B, 1, r*H, C]``, token-major: ``row = t * H + head``): K/V are never
copied per head, and a block of queries is a view of the token-major ``q [B, T, H, C]`` that ``Attention._attend``
passes (the compiled graph writes it so: head-major queries cost a copy of every block, ~9 ms a step at
bench_20m, and a token-major view of head-major memory another copy of the whole ``q`` in the compiled
backward's tangent).

A few queries per row (decoding: one) take neither: the flash kernel's blocking does not pay for a single query
row per head, and selecting the visible columns copies the whole cache each step. Up to ``CPU_DIRECT_QUERIES``
queries, two batched matrix products and one softmax over ``[logits, sink]`` give the same values (one query
per row, 60 rows over 257 keys: 1.8 instead of 10.3 ms on the AVX2 host; greedy decoding 1.14x faster as a whole,
``trex bench decode``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from kernels import eager_version, run_eagerly

CPU_QUERY_BLOCK = 128  # query rows per kernel call
# while compiled (:func:`fuse`): query blocks of this many rows, and those with up to CPU_MATERIALISE_COLS visible
# columns (sink included) through a materialised score matrix (:class:`_SinkSoftmaxCPU`) instead of the flash
# kernel (which lost as much speed as it saved columns in blocks of 64; the products do not, and a window of 128
# computes 191 instead of 255 columns a query in them)
CPU_MATERIALISE_BLOCK = 64
CPU_MATERIALISE_COLS = 512
CPU_DIRECT_QUERIES = 8  # up to this many queries per row: plain matrix products (decoding), not the flash kernel
# False: CPU tensors take the portable path too (one masked SDPA call with the sink as an extra channel), the
# path GPUs/NPUs run; tests set it (monkeypatch) to check that path against transformers on CPU
CPU_PATH = True


def mask_parts(mask_bts: torch.Tensor | Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """A mask, or its parts along the keys, as bool tensors (a float part, e.g. the CSA indexer's 0/1 selection:
    True where > 0)."""
    parts = [mask_bts] if isinstance(mask_bts, torch.Tensor) else mask_bts
    return [m if m.dtype == torch.bool else m > 0 for m in parts]


def use_cpu_path(t: torch.Tensor) -> bool:
    """Whether ``Attention._attend`` computes ``t``'s attention here (CPU tensors, unless ``CPU_PATH`` is off)."""
    return CPU_PATH and t.device.type == "cpu"


class _SinkFlashCPU(torch.autograd.Function):
    """``softmax([q k^T * scale + bias, sink]) [v; 0]`` for heads folded into rows (``row = t * h + head``)."""

    @staticmethod
    def forward(ctx, q_b1rc, kv_b1nc, bias_b1rn, sinks_h, scale):
        b, _, rows, _ = q_b1rc.shape
        h = sinks_h.shape[0]
        # the sink column (the last key: a zero vector) holds each row's head's sink logit (row = t * h + head)
        sink_r = sinks_h.to(bias_b1rn.dtype).repeat(rows // h)
        bias_b1rn[..., -1] = sink_r.expand(b, 1, rows)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q_b1rc, kv_b1nc, kv_b1nc, 0.0, False, attn_mask=bias_b1rn, scale=scale)
        ctx.save_for_backward(q_b1rc, kv_b1nc, bias_b1rn, out, lse, sink_r)
        ctx.scale, ctx.h = scale, h
        return out

    @staticmethod
    def backward(ctx, dout):
        q, kv, bias, out, lse, sink_r = ctx.saved_tensors
        # (any layout: the kernel makes the gradient contiguous itself where it is not)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, kv, kv, out, lse, 0.0, False, attn_mask=bias, scale=ctx.scale)
        p_sink = torch.exp(sink_r.float() - lse.float())  # [B, 1, rows]
        d_row = -(p_sink * row_dot(dout, out))
        b, _, rows = d_row.shape
        d_sinks = d_row.view(b, rows // ctx.h, ctx.h).sum((0, 1))
        return dq, dk + dv, None, d_sinks, None


class _SinkSoftmaxCPU(torch.autograd.Function):
    """The same function as :class:`_SinkFlashCPU` through a materialised score matrix: two batched products
    forward, four backward, and the softmax over ``[logits, sink]`` and its gradient as compiled element-wise
    passes (:func:`fuse`). Inputs: ``q [B, r*h, C]`` (``row = t * h + head``), the block's visible K=V columns
    ``kv [B, n, C]`` (no sink row), their additive mask ``bias [B, r, n]`` (0 / -inf, one row per query: shared by
    the heads), ``sinks [h]``."""

    @staticmethod
    def forward(ctx, q_bmc, kv_bnc, bias_brn, sinks_h, scale):
        b, rows, _ = q_bmc.shape
        h, n = sinks_h.shape[0], kv_bnc.shape[1]
        s_bmn = torch.bmm(q_bmc, kv_bnc.transpose(1, 2))
        p_brhn, p_sink_brh = _FUSED["probs"](s_bmn.view(b, rows // h, h, n), bias_brn, sinks_h, scale)
        p_bmn = p_brhn.view(b, rows, n)
        out = torch.bmm(p_bmn, kv_bnc)
        ctx.save_for_backward(q_bmc, kv_bnc, p_bmn, p_sink_brh, out)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, kv, p, p_sink, out = ctx.saved_tensors
        b, rows, n = p.shape
        h = p_sink.shape[-1]
        dout = dout.to(out.dtype)
        # softmax backward over [logits, sink]: the sink's value is zero, so sum_j p_j dp_j = dO . O per row
        d_row = row_dot(dout, out)  # [B, r*h] fp32
        dp = torch.bmm(dout, kv.transpose(1, 2))
        ds = _FUSED["grad"](p, dp, d_row, ctx.scale)
        dq = torch.bmm(ds, kv)
        dkv = torch.bmm(p.transpose(1, 2), dout).baddbmm_(ds.transpose(1, 2), q)
        d_sinks = -(p_sink * d_row.view(b, rows // h, h)).sum((0, 1))
        return dq, dkv, None, d_sinks, None


def _probs(s_brhn, bias_brn, sinks_h, scale):
    """``softmax([s * scale + bias, sink_h])`` in fp32 per (query, head) row: the key columns' probabilities in
    ``s``'s dtype and the sink's (fp32 ``[B, r, h]``). A row that sees no key gets only its sink. (A ``where`` on
    the 0/1 visibility instead of the additive mask compiles to a scalar loop over the bytes: 5.4 instead of 0.9 ms
    at ``[8, 128, 8, 256]``.)"""
    x = s_brhn.float() * scale + bias_brn[:, :, None, :].float()
    sink = sinks_h.float()
    m = torch.maximum(x.amax(-1), sink)  # finite: the sink is always seen
    e = torch.exp(x - m[..., None])
    e_sink = torch.exp(sink - m)
    inv = 1.0 / (e.sum(-1) + e_sink)
    return (e * inv[..., None]).to(s_brhn.dtype), e_sink * inv


def _grad(p_bmn, dp_bmn, d_row_bm, scale):
    """The logits' gradient (times ``scale``: what the products with ``q`` and ``kv`` take), in ``p``'s dtype."""
    return (p_bmn.float() * (dp_bmn.float() - d_row_bm[..., None]) * scale).to(p_bmn.dtype)


_FUSED: dict[str, Callable] = {}  # "row_dot", "probs", "grad" -> compiled versions, while fused (:func:`fuse`)


def fuse(backend: Callable | str | None = "inductor") -> None:
    """Compute :func:`row_dot` through ``torch.compile(backend=backend)`` from now on in this process (one pass
    over the two 16-bit operands instead of two fp32 copies, a product and a sum: ~4x faster at bench_20m's
    ``[8, 1, 1024, 128]``), and query blocks of up to ``CPU_MATERIALISE_COLS`` visible columns through
    :class:`_SinkSoftmaxCPU` with its element-wise passes compiled (symbolic shapes: the number of visible columns
    is data); ``None``: back to eager ops and the flash kernel for every block. The training engines turn it on
    with the model's own compilation (``train.<stage>.compile``)."""
    _FUSED.clear()
    if backend is not None:
        _FUSED["row_dot"] = torch.compile(_row_dot, backend=backend, dynamic=False)
        _FUSED["probs"] = torch.compile(_probs, backend=backend, dynamic=True)
        _FUSED["grad"] = torch.compile(_grad, backend=backend, dynamic=True)


def fused() -> bool:
    return bool(_FUSED)


def _row_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a.float() * b.float()).sum(-1)


def row_dot(a_rc: torch.Tensor, b_rc: torch.Tensor) -> torch.Tensor:
    """``sum_c a[..., c] * b[..., c]`` in fp32 (the sink gradient's ``dO . O`` per query row)."""
    return (_FUSED.get("row_dot") or _row_dot)(a_rc, b_rc)


_EAGER_KEY = (__name__, "sink_attention_cpu")  # under torch.compile the core runs eagerly (kernels.run_eagerly)


def sink_attention_cpu(q_bthc: torch.Tensor, kv_bsc: torch.Tensor | Sequence[torch.Tensor], sinks_h: torch.Tensor,
                       mask_bts: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor:
    """``[B, T, H, C]`` attention output of ``H`` query heads (``q_bthc``, token-major: contiguous, a block of
    queries is a view) over the ``S`` shared K=V rows where ``mask_bts`` is True, plus one sink logit per head
    (its value is zero). ``mask_bts`` may come in parts along the keys (``[B, T, S_i]``, ``sum S_i = S``; bool,
    or float: True where > 0), joined here: compiled CPU code copies bool tensors one element at a time. ``kv_bsc``
    may come in parts too (``[B, S_i, C]``, a sequence): few queries read them apart (a decoding step does not copy
    the cache to join them), more are joined first.
    Compiled code calls it eagerly: the visible columns of each query block are data (traced, every batch would
    compile anew)."""
    return eager_version(_EAGER_KEY, _sink_attention_cpu)(q_bthc, kv_bsc, sinks_h, mask_bts)


def _sink_attention_cpu(q_bthc: torch.Tensor, kv_bsc: torch.Tensor | Sequence[torch.Tensor], sinks_h: torch.Tensor,
                        mask_bts: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor:
    b, t, h, c = q_bthc.shape
    parts = mask_parts(mask_bts)  # (eagerly: compiled CPU code would write the bools one at a time)
    kv_parts = [kv_bsc] if isinstance(kv_bsc, torch.Tensor) else list(kv_bsc)
    if t <= CPU_DIRECT_QUERIES:
        mask = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
        return _direct(q_bthc.transpose(1, 2), kv_parts, sinks_h, mask).transpose(1, 2)
    kv_bsc = kv_parts[0] if len(kv_parts) == 1 else torch.cat(kv_parts, dim=1)
    scale = c ** -0.5
    visible = torch.cat([*parts, parts[0].new_ones(b, t, 1)], dim=-1)  # [B, T, S + 1]: + the sink's column
    visible = visible.view(torch.uint8)  # 0/1 bytes
    seen_ts = visible.amax(0)  # (a bool any() over a leading dim runs ~150x slower on a CPU)
    materialise = "probs" in _FUSED
    block = CPU_MATERIALISE_BLOCK if materialise else CPU_QUERY_BLOCK
    outs = []
    for t0, q_blk in zip(range(0, t, block), q_bthc.split(block, dim=1)):
        r = q_blk.shape[1]
        cols = seen_ts[t0:t0 + r].amax(0).nonzero().squeeze(1)  # ascending: the sink column (S) comes last
        n = cols.numel()
        # the block's additive mask, one row per query (the heads share it), sink column last: log(1) = 0,
        # log(0) = -inf, ~4x faster than a ``where`` between two scalars
        m_brn = torch.log(visible[:, t0:t0 + r].index_select(2, cols).to(q_bthc.dtype))
        kv_blk = kv_bsc.index_select(1, cols[:-1])  # the visible keys (the sink's is each function's own)
        if materialise and n <= CPU_MATERIALISE_COLS:
            out = _SinkSoftmaxCPU.apply(q_blk.reshape(b, r * h, c), kv_blk, m_brn[..., :-1], sinks_h, scale)
        else:
            # one row per (query, head): a copy, the sink's logit goes in it (``where`` over the head-expanded bool
            # mask took ~7x longer); the sink's key / value: a zero row
            m = m_brn[:, :, None].expand(b, r, h, n).contiguous().view(b, 1, r * h, n)
            kv_sink = torch.cat([kv_blk, kv_blk.new_zeros(b, 1, c)], dim=1)[:, None]
            out = _SinkFlashCPU.apply(q_blk.reshape(b, 1, r * h, c), kv_sink, m, sinks_h, scale)
        outs.append(out.view(b, r, h, c))
    return torch.cat(outs, dim=1)


def _direct(q_bhtc: torch.Tensor, kv_parts: list[torch.Tensor], sinks_h: torch.Tensor,
            mask_bts: torch.Tensor) -> torch.Tensor:
    """The definition for few queries: ``softmax([q k^T * scale masked, sink]) [kv; 0]``, heads folded into rows
    of batched products (``[B, H*T, C] x [B, C, S_i]`` per part of the keys, ``kv_parts``, in order along the
    mask's keys); a query that sees no key gets only its sink (zero)."""
    b, h, t, c = q_bhtc.shape
    q = q_bhtc.reshape(b, h * t, c)
    logits_bhts = torch.cat([torch.bmm(q, kv.transpose(1, 2)) for kv in kv_parts], dim=-1).view(b, h, t, -1)
    s = logits_bhts.shape[-1]
    logits_bhts = (logits_bhts * c ** -0.5).masked_fill(~mask_bts[:, None], float("-inf"))
    sink = sinks_h.to(logits_bhts.dtype).view(1, h, 1, 1).expand(b, h, t, 1)
    p_bhts = torch.cat([logits_bhts, sink], dim=-1).softmax(-1, dtype=torch.float32)[..., :s].to(kv_parts[0].dtype)
    out, start = None, 0
    for kv in kv_parts:
        width = kv.shape[1]
        part = torch.bmm(p_bhts[..., start:start + width].reshape(b, h * t, width), kv)
        out, start = part if out is None else out.add_(part), start + width
    return out.view(b, h, t, c)


run_eagerly(_EAGER_KEY, _sink_attention_cpu)
