"""The native multi-process trainer: any PP x DP/FSDP x EP x TP layout of the DeepSeek-V4 model.

Every rank builds the same model from the same seed, keeps its pipeline stage(s) (``prune_to_stage``), and
applies TP, expert sharding and FSDP2 (``parallelize.py``). A step takes the global batch of
``train.batch_size`` rows (the same rows as the single-process loop), gives each data-parallel rank its
slice, and runs it as gradient-accumulation micro-batches (no PP) or through a
``torch.distributed.pipelining`` schedule. Objectives are normalised by the global token counts and
gradients are summed, so the update is the single-process one; then: expert-shard gradient sums, a global
gradient norm and clip, AdamW, the schedule, the aux-loss-free bias update from the globally summed expert
load, and rank-0 metrics. Checkpoints are DCP over all ranks (``checkpoint.save_parts``), loadable under
any other layout; with ``train.async_checkpoint`` they are written in the background over a gloo group of
their own and published when the next save (or the end of the run) waits for them. A non-finite step
(loss or global gradient norm, the same verdict on every rank) is skipped -- no optimizer step, no bias
update -- and ``train.max_bad_steps`` of them in a row stop the run.
"""

from __future__ import annotations

import logging
import math
import os
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from trainer import checkpoint
from trainer.data import Packed, batch_indices
from trainer.loop import (TrainResult, apply_activation_checkpointing, build_optimizers, discard_expert_load,
                          lr_lambda, non_finite_message)
from trainer.metrics import mfu, training_flops_per_token, training_peak_flops
from trainer.models.deepseek_v4 import parallelize as par
from trainer.models.deepseek_v4.model import Transformer
from trainer.parallel import stage as stg
from trainer.parallel.dims import ParallelDims, build_mesh
from trainer.parallel.grads import all_reduce_grads, clip_grad_norm
from trainer.parallel.pipeline import build_schedule

log = logging.getLogger(__name__)


@dataclass
class Layout:
    dims: ParallelDims
    schedule: str = "1f1b"
    microbatches: int = 0
    stage_layers: list[int] | None = None
    sequence_parallel: bool = False
    reshard_after_forward: bool = True

    @classmethod
    def from_config(cls, pc, world_size: int) -> "Layout":
        dims = ParallelDims.from_config(pc, world_size)
        return cls(dims, pc.pp_schedule, pc.pp_microbatches, pc.pp_layers, pc.sequence_parallel and dims.tp > 1,
                   pc.reshard_after_forward)

    def n_microbatches(self, batch_size: int) -> int:
        """Pipeline micro-batches per step: as configured, or one per row of a data-parallel rank's batch."""
        return self.microbatches or max(1, batch_size // self.dims.dp)


def build_parts(model: Transformer, layout: Layout, mesh, param_dtype, cfg) -> tuple[list, list[int]]:
    """This rank's model parts, parallelized; and their stage indices."""
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
        par.apply_fsdp(part, mesh, dims, param_dtype, layout.reshard_after_forward)
        stg.bind(part)
        part.act_dtype = param_dtype
    return parts, ids


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


def train_parallel(model: Transformer, data: Packed, cfg, layout: Layout, ckpt_dir: str | Path, seed: int,
                   on_log: Callable[[int, dict], None] | None = None, stop_after: int | None = None,
                   device: torch.device | None = None, max_bad_steps: int | None = None) -> TrainResult:
    """Train ``cfg.steps`` steps under ``layout`` (the process group must be up; see ``launch.py``)."""
    dims = layout.dims
    world = dist.get_world_size() if dist.is_initialized() else 1
    dims.check_world(world)
    dims.check_model(model.cfg, cfg.batch_size, layout.n_microbatches(cfg.batch_size))
    device = device or torch.device("cpu")
    mesh = build_mesh(dims, device.type)
    rank = dist.get_rank()
    param_dtype = torch.bfloat16 if cfg.dtype == "bf16" and dims.dp > 1 else None
    model.to(device)
    parts, ids = build_parts(model, layout, mesh, param_dtype, cfg)
    part_opts = [build_optimizers(p, cfg) for p in parts]  # AdamW, or Muon + AdamW, per part
    opts = [o for po in part_opts for o in po]
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lr_lambda(cfg)) for o in opts]
    schedule = build_schedule(parts, ids, layout, mesh, device, cfg, seq_len=data.input_ids.shape[1],
                              param_dtype=param_dtype) if dims.pp > 1 else None
    dp_group = mesh["dp"].get_group() if dims.dp > 1 else None
    dp_rank = mesh["dp"].get_local_rank() if dims.dp > 1 else 0
    tp_rank = mesh["tp"].get_local_rank() if dims.tp > 1 else 0
    experts = [p for part in parts for p in par.expert_params(part)]
    ep_replicas = mesh["dp_mod_ep"].get_group() if dims.ep > 1 and dims.dp // dims.ep > 1 else None
    params = [p for part in parts for p in part.parameters()]
    sp_params = [p for part in parts for p in par.sequence_parallel_params(part)] if layout.sequence_parallel else []
    if layout.sequence_parallel and data.input_ids.shape[1] % dims.tp:
        raise ValueError(f"parallel.sequence_parallel: train.seq_len={data.input_ids.shape[1]} is not divisible by "
                         f"parallel.tp={dims.tp}")
    flops_per_token = training_flops_per_token(model.cfg, model.vocab_size, cfg.seq_len)
    peak = training_peak_flops(device.type)
    peak = peak * world if peak else None
    # async checkpoints: DCP's writer thread runs collectives; they get a group no training collective uses
    ckpt_group = dist.new_group(backend="gloo") if cfg.async_checkpoint else None
    poll_group = dist.new_group(backend="gloo") if cfg.async_checkpoint else None  # "has every rank written it?"
    pending = None  # an asynchronous checkpoint still being written
    start, resumed_from, skipped, loss_val = 0, None, 0, float("nan")
    latest = checkpoint.find_latest(ckpt_dir)
    if latest is not None:
        state = checkpoint.load_parts(latest, parts, part_opts)
        start = resumed_from = state["step"]
        skipped, loss_val = state.get("skipped_steps", 0), state.get("loss", float("nan"))
        for s in scheds:
            s.last_epoch = start - 1
            s.step()
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if cfg.dtype == "bf16" else nullcontext()
    for p in parts:
        p.train()
    per_rank = cfg.batch_size // dims.dp
    max_bad = cfg.max_bad_steps if max_bad_steps is None else max_bad_steps
    end = cfg.steps if stop_after is None else min(cfg.steps, stop_after)
    fault = _fault_plan(rank)
    bad_in_row, tok_window, t_window, t_total, tok_total = 0, 0, time.perf_counter(), 0.0, 0
    for step in range(start, end):
        if fault is not None and step == fault:
            log.error("TREX_FAULT: rank %d exits at step %d", rank, step)
            os._exit(17)
        idx = batch_indices(len(data), cfg.batch_size, step, seed)
        full = data.batch(idx)
        n_tok, n_mtp = stg.count_tokens(full["labels"], full["doc_ids"])
        mine = {k: v[dp_rank * per_rank:(dp_rank + 1) * per_rank].to(device) for k, v in full.items()}
        for part in parts:
            stg.set_token_counts(part, n_tok, n_mtp)
            stg.reset_sums(part)
        for o in opts:
            o.zero_grad(set_to_none=True)
        with autocast:
            if schedule is not None:
                _pipeline_step(schedule, parts, ids, mine)
            else:
                _accumulate(parts[0], mine, cfg.grad_accum)
        if ep_replicas is not None:
            all_reduce_grads(experts, ep_replicas)
        if sp_params:
            all_reduce_grads(sp_params, mesh["tp"].get_group())
        grad_norm = clip_grad_norm(params, cfg.grad_clip, dims.pp)
        sums = torch.tensor([sum(p.sums["loss"] for p in parts), sum(p.sums["mtp"] for p in parts)],
                            dtype=torch.float64, device=device)
        if tp_rank != 0:
            sums.zero_()
        dist.all_reduce(sums)
        loss_val = float(sums[0]) / max(1, n_tok)
        if not (math.isfinite(loss_val) and math.isfinite(grad_norm)):  # all ranks agree (summed, global)
            skipped, bad_in_row = skipped + 1, bad_in_row + 1
            for part in parts:
                discard_expert_load(part)
            moe_stats = {}
            if rank == 0:
                log.warning("step %d: non-finite loss %s / grad norm %s, skipped (%d in a row)", step + 1, loss_val,
                            grad_norm, bad_in_row)
            if bad_in_row >= max_bad:
                if pending is not None:
                    pending.wait()  # every rank is here: publish the last good checkpoint first
                raise FloatingPointError(non_finite_message(bad_in_row, step + 1, loss_val, grad_norm, max_bad))
        else:
            bad_in_row = 0
            for o in opts:
                o.step()
            moe_stats = _bias_update(parts, dp_group, model.cfg.bias_update_rate)
        for s in scheds:
            s.step()
        done = step + 1
        if pending is not None and _all_done(pending, poll_group):  # publish an async checkpoint once every rank wrote it
            pending.wait()
            pending = None
        checkpoint.kill_point("step", done)
        tok_window += int((full["doc_ids"] >= 0).sum())
        if done % cfg.log_every == 0 or done == end:
            dt = time.perf_counter() - t_window
            t_total, tok_total = t_total + dt, tok_total + tok_window
            tps = tok_window / max(dt, 1e-9)
            metrics = {"loss": loss_val, "lr": scheds[0].get_last_lr()[0], "grad_norm": grad_norm,
                       "tokens_per_s": tps, "skipped_steps": skipped, **(moe_stats if dims.pp == 1 else {})}
            if peak:
                metrics["mfu"] = mfu(tps, flops_per_token, peak)
            if n_mtp and model.cfg.mtp_layers:
                metrics["mtp_loss"] = float(sums[1]) / n_mtp
            if on_log and rank == 0:
                on_log(done, metrics)
            t_window, tok_window = time.perf_counter(), 0
        if done % cfg.ckpt_every == 0 or done == cfg.steps:
            if pending is not None:
                pending.wait()
            pending = checkpoint.save_parts(
                ckpt_dir, done, parts, part_opts, {"skipped_steps": skipped, "loss": loss_val,
                                                   "layout": dims.describe()}, cfg.keep_last,
                async_group=ckpt_group if done != cfg.steps else None)
            if not isinstance(pending, checkpoint.PendingSave):
                pending = None
    if pending is not None:
        pending.wait()
    latest = checkpoint.find_latest(ckpt_dir)
    tps_all = tok_total / max(t_total, 1e-9)
    result = TrainResult(steps=end, resumed_from=resumed_from, final_loss=loss_val, tokens_per_s=tps_all,
                         checkpoint=str(latest) if latest else "", skipped_steps=skipped,
                         mfu=mfu(tps_all, flops_per_token, peak))
    result.parts = parts  # this rank's parallelized parts (export, tests)
    return result


def _all_done(pending: checkpoint.PendingSave, group) -> bool:
    """Whether every rank's background write has finished (one tiny all-reduce on a gloo group of its own:
    CPU tensors whatever the training backend): the ranks publish together."""
    flag = torch.tensor([1 if pending.done() else 0], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
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


def _pipeline_step(schedule, parts, ids, batch: dict) -> None:
    kwargs = {"input_ids": batch["input_ids"], "doc_ids": batch["doc_ids"], "labels": batch["labels"]}
    args = (batch["input_ids"],) if 0 in ids else ()
    schedule.step(*args, target=batch["labels"], **kwargs)


def _fault_plan(rank: int) -> int | None:
    """``TREX_FAULT_RANK``/``TREX_FAULT_STEP``: that rank dies at that step (the fault-tolerance test)."""
    if os.environ.get("TREX_FAULT_RANK") == str(rank):
        return int(os.environ.get("TREX_FAULT_STEP", "1"))
    return None


def gather_full_state(parts) -> dict[str, torch.Tensor]:
    """Every parameter and buffer as a full tensor on every rank (tests compare them to one process)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

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
