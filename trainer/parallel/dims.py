"""Layout sizes (:class:`ParallelDims`) and the layout an engine runs (:class:`Layout`), their validation,
process-group start-up and the named DeviceMesh.

World = ``pp x dp_replicate x dp_shard x tp``. Expert parallelism is carved out of ``dp_shard``
(``dp_shard = edp x ep``): an expert-parallel group is a set of data-parallel ranks that split the experts
between them and exchange tokens, which is how the reference system lays out V4 (V4-Flash EP32 = DP32).
The mesh has the dimensions ``("pp", "dp_replicate", "edp", "ep", "tp")`` (size-1 dimensions included, so
that every name always exists) plus flattened views:

- ``dp_shard`` = (edp, ep): FSDP2 shards the non-expert parameters over it (HSDP with ``dp_replicate``);
- ``dp`` = (dp_replicate, edp, ep): the ranks that see different data (losses, token counts, expert load);
- ``dp_mod_ep`` = (dp_replicate, edp): the replicas of one expert shard (their gradients are summed).
"""

from __future__ import annotations

import datetime
import os
import sys
from dataclasses import dataclass
from typing import NoReturn

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

MESH_DIMS = ("pp", "dp_replicate", "edp", "ep", "tp")


class LayoutError(ValueError):
    """A layout that cannot run: sizes that do not multiply to the world or do not divide the model."""


@dataclass(frozen=True)
class ParallelDims:
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    ep: int = 1
    vpp: int = 1

    @classmethod
    def from_config(cls, pc, world_size: int) -> "ParallelDims":
        """Resolve ``dp_shard: -1`` against the world size and validate."""
        fixed = pc.pp * pc.dp_replicate * pc.tp
        dp_shard = pc.dp_shard
        if dp_shard == -1:
            if world_size % fixed:
                raise LayoutError(f"parallel: world size {world_size} is not divisible by pp*dp_replicate*tp = "
                                  f"{pc.pp}*{pc.dp_replicate}*{pc.tp} = {fixed}")
            dp_shard = world_size // fixed
        dims = cls(pc.pp, pc.dp_replicate, dp_shard, pc.tp, pc.ep, pc.vpp)
        dims.check_world(world_size)
        return dims

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.tp

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def edp(self) -> int:
        return self.dp_shard // self.ep

    @property
    def stages(self) -> int:
        return self.pp * self.vpp

    def describe(self) -> str:
        parts = [f"{k.upper()}{v}" for k, v in (("pp", self.pp), ("dp", self.dp), ("tp", self.tp), ("ep", self.ep))
                 if v > 1]
        if self.vpp > 1:
            parts.append(f"VPP{self.vpp}")
        return "x".join(parts) or "single"

    def check_world(self, world_size: int) -> None:
        if self.dp_shard % self.ep:
            raise LayoutError(f"parallel.ep={self.ep} must divide parallel.dp_shard={self.dp_shard} "
                              "(expert parallelism is carved out of the sharded data-parallel ranks)")
        if self.world_size != world_size:
            raise LayoutError(f"parallel: pp*dp_replicate*dp_shard*tp = {self.pp}*{self.dp_replicate}*"
                              f"{self.dp_shard}*{self.tp} = {self.world_size} != world size {world_size}")

    def check_model(self, mcfg, batch_size: int, microbatches: int) -> None:
        """Each dimension must divide what it splits; the error names the config key."""
        checks = [
            (mcfg.num_heads % self.tp == 0, f"model.num_heads={mcfg.num_heads} not divisible by parallel.tp={self.tp}"),
            (mcfg.o_groups % self.tp == 0, f"model.o_groups={mcfg.o_groups} not divisible by parallel.tp={self.tp}"),
            (mcfg.moe_intermediate_size % self.tp == 0,
             f"model.moe_intermediate_size={mcfg.moe_intermediate_size} not divisible by parallel.tp={self.tp}"),
            (mcfg.n_routed_experts % self.ep == 0,
             f"model.n_routed_experts={mcfg.n_routed_experts} not divisible by parallel.ep={self.ep}"),
            (mcfg.num_layers >= self.stages,
             f"model.num_layers={mcfg.num_layers} < pipeline stages pp*vpp={self.stages}"),
            (batch_size % self.dp == 0,
             f"train.batch_size={batch_size} not divisible by data-parallel size {self.dp}"),
            (self.pp == 1 or (batch_size // self.dp) % microbatches == 0,
             f"per-rank batch {batch_size // max(1, self.dp)} not divisible by {microbatches} pipeline micro-batches"),
        ]
        for ok, msg in checks:
            if not ok:
                raise LayoutError(msg)



@dataclass
class Layout:
    """A layout as the engine runs it: the sizes plus the pipeline schedule, its micro-batches and stage
    split, sequence parallelism, FSDP's resharding and its gradient reduction dtype."""

    dims: ParallelDims
    schedule: str = "1f1b"
    microbatches: int = 0
    stage_layers: list[int] | None = None
    sequence_parallel: bool = False
    reshard_after_forward: bool = True
    reduce_dtype: str = "fp32"  # FSDP2's gradient reduction under bf16 training: "fp32" or "bf16"

    @classmethod
    def from_config(cls, pc, world_size: int) -> "Layout":
        dims = ParallelDims.from_config(pc, world_size)
        return cls(dims, pc.pp_schedule, pc.pp_microbatches, pc.pp_layers, pc.sequence_parallel and dims.tp > 1,
                   pc.reshard_after_forward, pc.reduce_dtype)

    def n_microbatches(self, batch_size: int) -> int:
        """Pipeline micro-batches per step: as configured, or one per row of a data-parallel rank's batch."""
        return self.microbatches or max(1, batch_size // self.dims.dp)

def device_for_rank(local_rank: int) -> torch.device:
    """The accelerator this rank drives (``torch.accelerator``: CUDA, NPU, ...) or the CPU."""
    acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if acc is None:
        return torch.device("cpu")
    torch.accelerator.set_device_index(local_rank)
    return torch.device(acc.type, local_rank)


def backend_for(device: torch.device, requested: str = "auto") -> str:
    if requested != "auto":
        return requested
    return {"cuda": "nccl", "npu": "hccl"}.get(device.type, "gloo")


def init_distributed(backend: str = "auto", timeout_s: float = 120.0) -> torch.device:
    """Start the default process group from torchrun's environment (or a single-process group)."""
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = device_for_rank(local_rank)
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        kind = backend_for(device, backend)
        if kind == "hccl":
            import torch_npu  # noqa: F401  (optional extra; registers the HCCL backend)
        dist.init_process_group(kind, timeout=datetime.timedelta(seconds=timeout_s))
    return device


def shutdown() -> None:
    """End cleanly: a barrier first, so no rank tears down gloo while another is still talking to it."""
    if dist.is_initialized():
        try:
            dist.barrier()
        finally:
            dist.destroy_process_group()


def exit_rank(code: int = 0) -> NoReturn:
    """A rank's last call: :func:`shutdown`, flush, then leave without interpreter finalization
    (``os._exit``). Gloo work objects still referenced from Python (a collective's handle, a tensor a worker
    thread held) are otherwise destroyed while the interpreter is torn down, and that can abort a rank whose
    work finished ("terminate called without an active exception", SIGABRT; pytorch/pytorch#179291): seen
    here about once in a test suite run of two-process jobs, after the job's result was printed."""
    try:
        shutdown()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def build_mesh(dims: ParallelDims, device_type: str) -> DeviceMesh:
    sizes = (dims.pp, dims.dp_replicate, dims.edp, dims.ep, dims.tp)
    mesh = init_device_mesh(device_type, sizes, mesh_dim_names=MESH_DIMS)
    mesh["edp", "ep"]._flatten("dp_shard")
    mesh["dp_replicate", "edp", "ep"]._flatten("dp")
    mesh["dp_replicate", "edp"]._flatten("dp_mod_ep")
    return mesh


def bubble_fraction(pp: int, microbatches: int, vpp: int = 1, schedule: str = "1f1b") -> float:
    """Idle share of a pipeline step: ``(pp-1) / (vpp*m + pp-1)`` for (interleaved) 1F1B and GPipe; the
    zero-bubble V schedules fill most of it with weight-gradient work (taken here as a third of 1F1B's)."""
    if pp <= 1:
        return 0.0
    bubble = (pp - 1) / (vpp * microbatches + pp - 1)
    return bubble / 3 if schedule in ("zbv", "dualpipev") else bubble
