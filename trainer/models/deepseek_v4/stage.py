"""The training forward of one model part (the whole model, or one pipeline stage) returning its objective.

``stage_forward(part, *acts, input_ids, doc_ids, labels)``:

- first stage: embeds ``input_ids`` into the mHC streams (and, with MTP, the embeddings of the next tokens,
  which travel down the pipeline as a second activation, so the embedding stays on the first stage);
- every stage: its decoder layers; the CSA indexers' KL losses (they train only the indexers) are attached
  to the outgoing activation with :class:`AttachAux`, so their gradient arrives through whatever backward the
  schedule runs;
- last stage: final mHC collapse, norm, the fused chunked (or, under TP, vocabulary-parallel) LM-head
  loss and the MTP loss, normalised by the
  *global* token counts (``set_token_counts``), so summing gradients over data-parallel ranks and
  micro-batches gives exactly the single-process gradient.

The math is ``training.loss_fn``'s; ``tests/trainer/parallel`` checks them equal.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels import fused_linear_cross_entropy
from trainer.data import IGNORE
from trainer.models.deepseek_v4.model import expand_streams
from trainer.models.deepseek_v4.training import mtp_labels
from trainer.parallel.tensor_parallel import gather_seq, local, scatter_seq
from trainer.parallel.vocab_parallel import vocab_parallel_cross_entropy


class AttachAux(torch.autograd.Function):
    """Identity on ``x``; in backward, gives ``aux`` (an already scaled loss term) a gradient of one."""

    @staticmethod
    def forward(ctx, x, aux):
        ctx.aux_shape, ctx.aux_dtype = aux.shape, aux.dtype
        return x.clone()  # not a view: pipeline schedules detach stage outputs in place

    @staticmethod
    def backward(ctx, g):
        return g, torch.ones(ctx.aux_shape, dtype=ctx.aux_dtype, device=g.device)


def set_token_counts(part: nn.Module, n_tokens: int, n_mtp_tokens: int) -> None:
    part.inv_tokens = 1.0 / max(1, n_tokens)
    part.inv_mtp_tokens = 1.0 / max(1, n_mtp_tokens)


def reset_sums(part: nn.Module) -> None:
    part.sums = {"loss": 0.0, "mtp": 0.0}


def _layers(part) -> list[nn.Module]:
    return list(part.layers.values()) if isinstance(part.layers, nn.ModuleDict) else list(part.layers)


def stage_forward(part, *acts, input_ids: torch.Tensor, doc_ids: torch.Tensor, labels: torch.Tensor):
    cfg = part.cfg
    b, t = input_ids.shape
    first, last = getattr(part, "stage_first", True), getattr(part, "stage_last", True)
    act_dtype = getattr(part, "act_dtype", None)
    pos = torch.arange(t, device=input_ids.device).expand(b, t)
    packing = part._packing(doc_ids, pos)  # layouts and shared masks, built eagerly
    rope = part._rope()
    sp = getattr(part, "sp_group", None)  # sequence parallel: this rank's slice of the tokens between regions
    if first:
        x = expand_streams(part.embed(input_ids), cfg.hc_mult, cfg.hc_streams_fp32)
        x = x if sp is None else scatter_seq(x, sp)
        nxt = part.embed(input_ids[:, 1:]) if cfg.mtp_layers else None
    else:
        x, nxt = acts[0], (acts[1] if len(acts) > 1 else None)
    for layer in _layers(part):
        x = layer(x, pos, rope, input_ids, packing)
    aux = [lay.attn.indexer_loss for lay in _layers(part) if lay.attn.indexer_loss is not None]
    if aux:
        aux_sum = torch.stack(aux).sum() * cfg.indexer_loss_weight
        part.sums["loss"] += float(aux_sum.detach())
        x = AttachAux.apply(x, aux_sum * part.inv_tokens)
    if not last:
        x = x if act_dtype is None else x.to(act_dtype)
        if nxt is None:
            return x
        return x, (nxt if act_dtype is None else nxt.to(act_dtype))
    h_raw = part.hc_head(x if sp is None else gather_seq(x, sp))
    h = part.norm(h_raw)
    ce = _head_loss(part, h, labels.reshape(-1))
    part.sums["loss"] += float(ce.detach())
    objective = ce * part.inv_tokens
    if len(part.mtp):
        target = mtp_labels(labels, doc_ids).reshape(-1)
        mpos = torch.arange(t - 1, device=h.device).expand(b, -1)
        mpack = part._packing(doc_ids[:, :-1], mpos)
        for m in part.mtp:
            mh = m(h_raw[:, :-1], nxt.to(h_raw.dtype), mpos, rope, input_ids[:, :-1], mpack, cfg.hc_mult)
            mtp = _head_loss(part, mh, target)
            part.sums["mtp"] += float(mtp.detach())
            objective = objective + cfg.mtp_loss_weight * mtp * part.inv_mtp_tokens
    return torch.stack([objective])  # [1], not a view (see AttachAux)


def _head_loss(part, h_btd: torch.Tensor, labels_n: torch.Tensor) -> torch.Tensor:
    """Summed LM-head cross-entropy: fused and chunked, or vocabulary-parallel under TP (``apply_tp``)."""
    head, h_nd = part.lm_head, h_btd.reshape(-1, h_btd.shape[-1])
    group = getattr(head, "tp_group", None)
    if group is not None:
        return vocab_parallel_cross_entropy(h_nd, local(head.weight), labels_n, head.vocab_start, group, IGNORE)
    return fused_linear_cross_entropy(h_nd, head.weight, labels_n, ignore_index=IGNORE, reduction="sum")


def bind(part: nn.Module) -> nn.Module:
    """Make ``part(*acts, input_ids=..., doc_ids=..., labels=...)`` run :func:`stage_forward`."""
    part.forward = lambda *acts, **kw: stage_forward(part, *acts, **kw)
    reset_sums(part)
    set_token_counts(part, 1, 1)
    return part


def count_tokens(labels_bt: torch.Tensor, doc_bt: torch.Tensor) -> tuple[int, int]:
    """(main, MTP) target counts of a batch."""
    return int((labels_bt != IGNORE).sum()), int((mtp_labels(labels_bt, doc_bt) != IGNORE).sum())
