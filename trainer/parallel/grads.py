"""Gradient norm/clipping and gradient reductions that FSDP does not do, for any layout.

A parameter is a plain tensor (replicated over every rank of its pipeline stage) or a DTensor (FSDP, TP or
expert shards, any mix). Its contribution to the global squared norm is the sum of squares of the local
shard divided by the number of ranks holding that same shard, and one all-reduce over the world sums it
all: each distinct element is then counted exactly once, over all stages.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from trainer.optim import clear_deferred_clip, defer_clip


def _local_and_copies(g: torch.Tensor, ranks_per_stage: int) -> tuple[torch.Tensor, int]:
    if isinstance(g, DTensor):
        shards = 1
        for i, pl in enumerate(g.placements):
            if pl.is_shard():
                shards *= g.device_mesh.size(i)
        return g.to_local(), ranks_per_stage // shards
    return g, ranks_per_stage


def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float, pp: int = 1,
                   optimizers: Sequence[torch.optim.Optimizer] = ()) -> float:
    """Clip all gradients in place to a global L2 norm ``max_norm`` (as ``torch.nn.utils.clip_grad_norm_``:
    ``coef = max_norm / (norm + 1e-6)``, at most 1); returns the norm before clipping (inf/nan kept). With
    ``optimizers`` the factor is left to their next step where :func:`trainer.optim.defer_clip` can (fused AdamW
    over FSDP2's shards: one pass over the local gradients fewer); step them with
    :func:`trainer.optim.step_optimizers`."""
    for o in optimizers:
        clear_deferred_clip(o)
    world = dist.get_world_size() if dist.is_initialized() else 1
    total = torch.zeros((), dtype=torch.float64)
    grads = []
    for p in params:
        if p.grad is None:
            continue
        loc, copies = _local_and_copies(p.grad, world // pp)
        grads.append(loc)
        if loc.numel():  # (accumulated in float64 without a float64 copy of the gradient: 1.8x faster)
            total += torch.linalg.vector_norm(loc.detach(), dtype=torch.float64).square().cpu() / copies
    if world > 1:
        total = total.to(_comm_device(grads))
        dist.all_reduce(total)
    norm = float(total.sqrt())
    if math.isfinite(norm):
        coef = min(1.0, max_norm / (norm + 1e-6))
        held = [p for p in params if p.grad is not None]
        if coef < 1.0 and not defer_clip(optimizers, held, torch.tensor(coef, dtype=torch.float32)):
            for g in grads:
                g.mul_(coef)
    return norm


def _comm_device(grads: list[torch.Tensor]) -> torch.device:
    return grads[0].device if grads else torch.device("cpu")


def all_reduce_grads(params: list[torch.nn.Parameter], group) -> None:
    """Sum the (local) gradients of ``params`` over ``group`` (expert shards replicated over dp_mod_ep)."""
    for p in params:
        if p.grad is not None:
            g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            dist.all_reduce(g, group=group)
