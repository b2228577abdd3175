"""The native multi-process engine: any PP x DP/FSDP x EP x TP layout of the DeepSeek-V4 model.

Every rank builds the same model from the same seed, keeps its pipeline stage(s) (``prune_to_stage``), and
applies TP, expert sharding and FSDP2 (``parallelize.py``). A step (:func:`trainer.core.fit`) takes the
global batch of ``train.batch_size`` rows (the same rows as the single-process engine), gives each
data-parallel rank its slice, and runs it as gradient-accumulation micro-batches (no PP) or through a
``torch.distributed.pipelining`` schedule. Objectives are normalised by the global token counts and
gradients are summed, so the update is the single-process one; then: expert-shard gradient sums, a global
gradient norm and clip, the optimizer, the schedule, the aux-loss-free bias update from the globally summed
expert load. Checkpoints are DCP over all ranks (``checkpoint.save_parts``), loadable under any other
layout; with ``train.async_checkpoint`` they are written in the background over a gloo group of their own
and published once every rank has written them. A non-finite step (loss or global gradient norm: the same
verdict on every rank) is skipped.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from trainer import checkpoint
from trainer.core import DcpEngine, StepSums, TrainResult, fit
from trainer.data import Packed, trim_padding
from trainer.hub.sharded import load_owned
from trainer.metrics import DTYPES, training_flops_per_token, training_peak_flops
from trainer.models.deepseek_v4 import parallelize as par
from trainer.models.deepseek_v4 import stage as stg
from trainer.models.deepseek_v4.model import Transformer
from trainer.models.deepseek_v4.training import apply_activation_checkpointing, apply_compile, discard_expert_load
from trainer.optim import LrSchedule, build_optimizers, schedulers, step_optimizers
from trainer.parallel.dims import Layout, build_mesh
from trainer.parallel.grads import all_reduce_grads, clip_grad_norm
from trainer.parallel.pipeline import build_schedule
from trex.core.config import StageTrainConfig


def build_parts(model: Transformer, layout: Layout, mesh, param_dtype, cfg, act_dtype) -> tuple[list, list[int]]:
    """This rank's model parts, parallelized; and their stage indices. ``act_dtype``: what a pipeline stage sends
    the next one (:func:`pipeline_act_dtype`)."""
    dims = layout.dims
    if dims.pp == 1:
        parts, ids = [model], [0]
        model.stage_first = model.stage_last = True
    else:
        ranges = par.stage_layers(model.cfg.num_layers, dims.stages, layout.stage_layers)
        ids = par.stage_ids(dims, mesh["pp"].get_local_rank(), layout.schedule)
        parts = [par.prune_to_stage(model, ranges[s], s == 0, s == dims.stages - 1) for s in ids]
    for part in parts:
        apply_activation_checkpointing(part, cfg.activation_checkpointing)  # before FSDP wraps the blocks
        if dims.tp > 1:
            par.apply_tp(part, mesh["tp"])
        par.apply_experts(part, mesh, dims)
        if layout.sequence_parallel:
            par.apply_sequence_parallel(part, mesh["tp"])
        if cfg.compile:  # per block, inside FSDP's wrapping (as torchtitan does)
            apply_compile(part)
        par.apply_fsdp(part, mesh, dims, param_dtype, layout.reshard_after_forward, DTYPES[layout.reduce_dtype])
        stg.bind(part)
        part.act_dtype = act_dtype
    return parts, ids


def pipeline_act_dtype(cfg, model_cfg) -> torch.dtype:
    """The dtype of the activations between pipeline stages (the mHC streams, MTP's next-token embeddings): the
    streams' own under the run's precision -- bf16 under bf16 autocast unless ``hc_streams_fp32``, else fp32. The
    schedule's receive buffers are declared in it and each stage casts what it sends to it. (It was FSDP's
    parameter dtype, fp32 without data parallelism: a bf16 run with PP and no DP sent bf16 streams into fp32
    buffers, and every loss was NaN.)"""
    return torch.bfloat16 if cfg.dtype == "bf16" and not model_cfg.hc_streams_fp32 else torch.float32


def _bias_update(parts, dp_group, rate: float) -> dict[str, float]:
    """Sum the expert load over data-parallel ranks, then update every local MoE's bias identically."""
    stats = {}
    for part in parts:
        for name, moe in par.moe_modules(part):
            if dp_group is not None:
                dist.all_reduce(moe.load_e, group=dp_group)
            s = moe.update_bias(rate)
            if name.startswith("layers."):
                idx = name.split(".")[1]
                stats.update({f"moe{idx}_{k}": v for k, v in s.items()})
    return stats


class DistributedEngine(DcpEngine):
    """The process group must be up (``trainer.parallel.dims.init_distributed``)."""

    def __init__(self, model: Transformer, seq_len: int, cfg: StageTrainConfig, layout: Layout,
                 ckpt_dir: str | Path, device: torch.device | None = None, init_reader=None):
        """``init_reader`` (a ``trainer.hub.CheckpointReader``): the initial weights, of which each rank reads
        only the slices it owns; ``model`` may then be on the meta device (it is never materialised whole)."""
        dims = self.dims = layout.dims
        world = dist.get_world_size() if dist.is_initialized() else 1
        dims.check_world(world)
        dims.check_model(model.cfg, cfg.batch_size, layout.n_microbatches(cfg.batch_size))
        self.cfg, self.ckpt_dir, self.model_cfg = cfg, ckpt_dir, model.cfg
        device = self.device = device or torch.device("cpu")
        mesh = self.mesh = build_mesh(dims, device.type)
        self.rank = dist.get_rank()
        param_dtype = torch.bfloat16 if cfg.dtype == "bf16" and dims.dp > 1 else None
        act_dtype = pipeline_act_dtype(cfg, model.cfg)
        on_meta = any(p.is_meta for p in model.parameters())
        if on_meta and init_reader is None:
            raise ValueError("a model on the meta device needs init_reader (the checkpoint to fill it from)")
        if not on_meta:
            model.to(device)
        self.parts, ids = build_parts(model, layout, mesh, param_dtype, cfg, act_dtype)
        self.ids = ids
        self.init_bytes = load_owned(self.parts, init_reader, device) if init_reader is not None else 0
        self.part_opts = [build_optimizers(p, cfg) for p in self.parts]  # AdamW, or Muon + AdamW, per part
        self.opts = [o for po in self.part_opts for o in po]
        self.lr_schedule = LrSchedule(cfg)
        self.scheds = schedulers(self.opts, self.lr_schedule)
        self.pipeline = build_schedule(self.parts, ids, layout, mesh, device, cfg, seq_len=seq_len,
                                       act_dtype=act_dtype) if dims.pp > 1 else None
        self.dp_group = mesh["dp"].get_group() if dims.dp > 1 else None
        self.dp_rank = mesh["dp"].get_local_rank() if dims.dp > 1 else 0
        self.tp_rank = mesh["tp"].get_local_rank() if dims.tp > 1 else 0
        self.experts = [p for part in self.parts for p in par.expert_params(part)]
        self.ep_replicas = mesh["dp_mod_ep"].get_group() if dims.ep > 1 and dims.dp // dims.ep > 1 else None
        self.params = [p for part in self.parts for p in part.parameters()]
        self.sp_params = [p for part in self.parts for p in par.sequence_parallel_params(part)] \
            if layout.sequence_parallel else []
        self.tp_partial = [p for part in self.parts for p in par.tp_partial_params(part)] if dims.tp > 1 else []
        if layout.sequence_parallel and seq_len % dims.tp:
            raise ValueError(f"parallel.sequence_parallel: train.seq_len={seq_len} is not divisible by "
                             f"parallel.tp={dims.tp}")
        self.flops_per_token = training_flops_per_token(model.cfg, model.vocab_size, cfg.seq_len)
        peak = training_peak_flops(device.type, dtype=cfg.dtype)
        self.peak = peak * world if peak else None
        # async checkpoints: DCP's writer thread runs collectives; they get a group no training collective uses
        # and "has every rank written it?" another one
        self.ckpt_group = dist.new_group(backend="gloo") if cfg.async_checkpoint else None
        self.poll_group = dist.new_group(backend="gloo") if cfg.async_checkpoint else None
        self.per_rank = cfg.batch_size // dims.dp
        self.modules = self.parts
        # trailing all-padding columns are cut (trainer.data.trim_padding) unless shapes must stay fixed: a pipeline
        # schedule is built for seq_len, sequence parallelism splits it over the tp ranks
        self.trim = self.pipeline is None and not layout.sequence_parallel

    def load(self, step_dir: Path) -> dict:
        return checkpoint.load_parts(step_dir, self.parts, self.part_opts)

    def forward_backward(self, data: Packed, idx: torch.Tensor) -> tuple[int, int, int]:
        full = trim_padding(data.batch(idx)) if self.trim else data.batch(idx)
        n_tok, n_mtp = stg.count_tokens(full["labels"], full["doc_ids"])
        lo, hi = self.dp_rank * self.per_rank, (self.dp_rank + 1) * self.per_rank
        mine = {k: v[lo:hi].to(self.device) for k, v in full.items()}
        for part in self.parts:
            stg.set_token_counts(part, n_tok, n_mtp)
            stg.reset_sums(part)
        for o in self.opts:
            o.zero_grad(set_to_none=True)
        with self.autocast:
            if self.pipeline is not None:
                _pipeline_step(self.pipeline, self.ids, mine)
            else:
                _accumulate(self.parts[0], mine, self.cfg.grad_accum)
        return n_tok, n_mtp, int((full["doc_ids"] >= 0).sum())

    def clip_grad_norm(self) -> float:
        if self.ep_replicas is not None:
            all_reduce_grads(self.experts, self.ep_replicas)
        if self.sp_params:
            all_reduce_grads(self.sp_params, self.mesh["tp"].get_group())
        if self.tp_partial:  # (LoRA on the routed experts under tp)
            all_reduce_grads(self.tp_partial, self.mesh["tp"].get_group())
        return clip_grad_norm(self.params, self.cfg.grad_clip, self.dims.pp, self.opts)

    def all_reduce(self, local: tuple[int, int, int]) -> StepSums:
        n_tok, n_mtp, seen = local
        sums = torch.tensor([sum(p.sums["loss"] for p in self.parts), sum(p.sums["mtp"] for p in self.parts)],
                            dtype=torch.float64, device=self.device)
        if self.tp_rank != 0:
            sums.zero_()
        dist.all_reduce(sums)
        return StepSums(float(sums[0]), n_tok, float(sums[1]), n_mtp if self.model_cfg.mtp_layers else 0, seen)

    def skip(self) -> None:
        for part in self.parts:
            discard_expert_load(part)

    def update(self) -> dict[str, float]:
        step_optimizers(self.opts)
        rate = self.model_cfg.bias_update_rate if getattr(self.parts[0], "balance_experts", True) else 0.0
        stats = _bias_update(self.parts, self.dp_group, rate)  # (a frozen LoRA base: rate 0)
        return stats if self.dims.pp == 1 else {}  # with PP, rank 0 holds only its own stages' layers

    def save(self, step: int, state: dict, async_save: bool) -> checkpoint.PendingSave | None:
        saved = checkpoint.save_parts(self.ckpt_dir, step, self.parts, self.part_opts,
                                      {**state, "layout": self.dims.describe()}, self.cfg.keep_last,
                                      async_group=self.ckpt_group if async_save else None)
        return saved if isinstance(saved, checkpoint.PendingSave) else None

    def written(self, pending: checkpoint.PendingSave) -> bool:
        """Whether every rank's background write has finished (one tiny all-reduce on a gloo group of its own:
        CPU tensors whatever the training backend): the ranks publish together."""
        flag = torch.tensor([1 if pending.done() else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.poll_group)
        return bool(flag.item())


def _accumulate(part, batch: dict, grad_accum: int) -> None:
    rows = batch["input_ids"].shape[0]
    micro = max(1, rows // grad_accum)
    chunks = list(range(0, rows, micro))
    for j, s in enumerate(chunks):
        if hasattr(part, "set_requires_gradient_sync"):  # FSDP: reduce-scatter once, after the last one
            part.set_requires_gradient_sync(j == len(chunks) - 1)
        mb = {k: v[s:s + micro] for k, v in batch.items()}
        objective = part(input_ids=mb["input_ids"], doc_ids=mb["doc_ids"], labels=mb["labels"])
        objective.sum().backward()


def _pipeline_step(schedule, ids, batch: dict) -> None:
    kwargs = {"input_ids": batch["input_ids"], "doc_ids": batch["doc_ids"], "labels": batch["labels"]}
    args = (batch["input_ids"],) if 0 in ids else ()
    schedule.step(*args, target=batch["labels"], **kwargs)


def train_parallel(model: Transformer, data: Packed, cfg: StageTrainConfig, layout: Layout, ckpt_dir: str | Path,
                   seed: int, on_log: Callable[[int, dict], None] | None = None, stop_after: int | None = None,
                   device: torch.device | None = None, max_bad_steps: int | None = None,
                   init_reader=None) -> TrainResult:
    """Train ``cfg.steps`` steps under ``layout``; ``result.parts`` are this rank's parallelized parts and
    ``result.init_bytes`` the bytes it read from ``init_reader`` (see :class:`DistributedEngine`)."""
    engine = DistributedEngine(model, data.input_ids.shape[1], cfg, layout, ckpt_dir, device, init_reader)
    result = fit(engine, data, cfg, seed, on_log=on_log, max_bad_steps=max_bad_steps, stop_after=stop_after)
    result.parts = engine.parts
    result.init_bytes = engine.init_bytes
    return result


def gather_full_state(parts) -> dict[str, torch.Tensor]:
    """Every parameter and buffer as a full tensor on every rank: for tests and benchmarks that compare a layout
    with one process at toy sizes. Never for the export (it is written offline from the DCP checkpoint)."""
    out: dict[str, torch.Tensor] = {}
    for part in parts:
        sd = get_model_state_dict(part, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=False))
        out.update({k: v.detach().cpu() for k, v in sd.items()})
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, out)
    merged: dict[str, torch.Tensor] = {}
    for g in gathered:
        for k, v in g.items():
            merged.setdefault(k, v)
    return merged
