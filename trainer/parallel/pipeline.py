"""Pipeline schedules from ``torch.distributed.pipelining`` over the engine's model parts.

Each part (``prune_to_stage``) becomes a :class:`PipelineStage` on the ``pp`` process group with its
activation shapes given up front (no meta-device shape inference: routing and packing are data dependent).
Activations between stages are the mHC residual streams ``[mb, T, hc_mult, D]`` and, with an MTP head, the
next-token embeddings ``[mb, T-1, D]``; the last stage returns its already normalised objective (shape
``[1]``), so the schedule's loss function is the identity and gradients are not rescaled
(``scale_grads=False``). Micro-batch kwargs (token ids for hash routing, document ids for packing, labels)
reach every stage.

Schedules: ``gpipe``, ``1f1b`` (one stage per rank), ``interleaved_1f1b`` (``vpp`` looped stages per rank),
``zbv`` (zero-bubble V: two stages per rank, backward split into input and weight gradients) and
``dualpipev`` (DualPipe's V layout with overlapped forward/backward pairs).
"""

from __future__ import annotations

import torch
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as S

_SINGLE = {"gpipe": S.ScheduleGPipe, "1f1b": S.Schedule1F1B}
_MULTI = {"interleaved_1f1b": S.ScheduleInterleaved1F1B, "zbv": S.ScheduleZBVZeroBubble,
          "dualpipev": S.ScheduleDualPipeV}


def _loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return output.sum()


def build_schedule(parts, stage_ids: list[int], layout, mesh, device, cfg, seq_len: int, act_dtype):
    """The pipeline schedule over this rank's stages; ``act_dtype``: the dtype of the activations the stages
    exchange (each stage casts what it sends to it: ``stage_forward``)."""
    dims = layout.dims
    m = layout.n_microbatches(cfg.batch_size)
    mb = cfg.batch_size // dims.dp // m
    mcfg = parts[0].cfg
    # example activations (their requires_grad is part of the static metadata: gradients flow back)
    tokens = seq_len // dims.tp if layout.sequence_parallel else seq_len  # a rank's slice under SP
    hidden = torch.empty(mb, tokens, mcfg.hc_mult, mcfg.hidden_size, dtype=act_dtype, device=device, requires_grad=True)
    nxt = torch.empty(mb, seq_len - 1, mcfg.hidden_size, dtype=act_dtype, device=device,
                      requires_grad=True) if mcfg.mtp_layers else None
    acts = (hidden,) if nxt is None else (hidden, nxt)
    ids = torch.zeros(mb, seq_len, dtype=torch.long, device=device)
    group = mesh["pp"].get_group()
    stages = []
    for part, s in zip(parts, stage_ids):
        first, last = s == 0, s == dims.stages - 1
        stages.append(PipelineStage(part, s, dims.stages, device,
                                    input_args=(ids,) if first else acts,
                                    output_args=(torch.empty(1, device=device, requires_grad=True),) if last else acts,
                                    group=group))
    if layout.schedule in _SINGLE:
        if len(stages) != 1:
            raise ValueError(f"parallel.pp_schedule={layout.schedule} runs one stage per rank (set vpp=1)")
        return _SINGLE[layout.schedule](stages[0], m, loss_fn=_loss, scale_grads=False)
    return _MULTI[layout.schedule](stages, m, loss_fn=_loss, scale_grads=False)
