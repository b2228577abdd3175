"""Fill a rank's parallelized model parts with just the slices of a checkpoint it owns.

The parts are built on the ``meta`` device (no weights anywhere), pruned to the rank's pipeline stages and
parallelized (TP / EP / FSDP2 DTensors), then allocated with ``to_empty``. For every parameter and
persistent buffer this rank holds, the global index range of its local shard comes from the DTensor's
mesh and placements (a plain tensor is the whole thing), and :meth:`CheckpointReader.read` reads that range
only: a pipeline stage reads its layers, an expert-parallel rank its experts, a TP / FSDP rank its rows or
columns. The bytes each rank read are returned so a job can report them.
"""

from __future__ import annotations

import itertools

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

_WRAPPERS = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def _clean(name: str) -> str:
    for w in _WRAPPERS:
        name = name.replace(w, "")
    return name


def local_index(t: torch.Tensor) -> tuple[torch.Tensor, tuple[slice, ...]]:
    """(this rank's local tensor, its index range in the global tensor)."""
    if isinstance(t, DTensor):
        shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        return t.to_local(), tuple(slice(o, o + s) for o, s in zip(offset, shape))
    return t, tuple(slice(0, s) for s in t.shape)


@torch.no_grad()
def load_owned(parts: list[nn.Module], reader, device: torch.device) -> int:
    """Allocate ``parts`` on ``device`` if they are on ``meta`` and copy in their owned slices from
    ``reader`` (a :class:`trainer.hub.CheckpointReader`); the bytes read by this rank."""
    before = reader.bytes_read
    for part in parts:
        if any(t.is_meta for t in itertools.chain(part.parameters(), part.buffers())):
            # LoRA factors are not in the checkpoint: made before (``trainer.lora``), they survive the allocation
            adapters = {n: local_index(p.data)[0].clone() for n, p in part.named_parameters()
                        if ".lora." in n and not p.is_meta}
            part.to_empty(device=device)
            if hasattr(part, "init_buffers"):
                part.init_buffers()
            for n, p in part.named_parameters():
                if n in adapters:
                    local_index(p.data)[0].copy_(adapters[n])
        persistent = {_clean(k) for k in part.state_dict()}
        for name, t in itertools.chain(part.named_parameters(), part.named_buffers()):
            key = _clean(name)
            if key not in persistent or ".lora." in key:
                continue
            local, index = local_index(t.data if isinstance(t, nn.Parameter) else t)
            if local.numel() == 0:
                continue
            value = reader.read(key, index)
            if tuple(value.shape) != tuple(local.shape):
                raise ValueError(f"{key}: read {tuple(value.shape)} for a local shard of {tuple(local.shape)}")
            local.copy_(value.to(local.dtype))
    return reader.bytes_read - before
