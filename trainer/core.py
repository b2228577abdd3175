"""The training step, once for every engine: :func:`fit` owns the step sequence and an :class:`Engine` supplies
what differs between one process, the native ``torch.distributed`` layouts and DeepSpeed ZeRO.

A step (``s`` counts from 0; ``done = s + 1`` is the optimizer step just taken)::

    source.batch(s)           the step's global batch: BatchOrder(s) over a fixed dataset, a pure function of
                              (s, seed), so a resume is exact (rows of similar length together with
                              ``group_by_length``); or an RL stage's minibatch of its current rollout
                              (trainer.rollout.RolloutSource, its rollout saved with the checkpoint)
    engine.forward_backward   forward + loss + backward of this rank's share (the engine's hook)
    engine.clip_grad_norm     the global gradient norm, gradients clipped to ``grad_clip``
    engine.all_reduce         loss / token sums of the whole batch (all ranks)
    non-finite loss or norm   engine.skip(): no update, no expert-bias update, the load counted by the
                              forward is dropped; ``skipped_steps`` += 1; ``max_bad_steps`` in a row raise
    else                      engine.update(): optimizer step + aux-loss-free expert-bias update
    schedule.observe          a finite step's loss; ``decay_trigger_loss`` may start the decay here and set
                              the run's last step (trainer.optim.LrSchedule; the lr is re-read)
    engine.schedule           the lr schedule advances (a function of the step, also over a skipped one)
    async checkpoint          published as soon as every rank has written it (engine.written)
    kill point ``step``       (``TREX_KILL_AT``, tests and bench/chaos.py)
    every ``log_every``       metrics -> ``on_log`` on rank 0: loss, lr, grad_norm, tokens_per_s, mfu (when the
                              peak is known), skipped_steps, MoE load statistics, mtp_loss
    every ``ckpt_every``      and at the last step: engine.save (asynchronous if ``async_checkpoint``, except
                              the final one)

The last step is ``steps``, or earlier where the schedule's trigger ended the stable phase
(:attr:`TrainResult.finished` either way). Resume: ``engine.restore`` loads the newest complete checkpoint
(model, optimizer, schedule) and returns its trainer state (step, skipped steps, loss, the schedule's trigger).
:class:`DcpEngine` is what the two native engines share (DCP checkpoints in ``ckpt_dir``, autocast). Nothing
here knows about MLflow or Prefect.
"""

from __future__ import annotations

import logging
import math
import os
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from trainer import checkpoint
from trainer.data import BatchOrder, Packed, row_lengths
from trainer.metrics import mfu
from trainer.optim import LrSchedule
from trex.core.config import StageTrainConfig

LogFn = Callable[[int, dict[str, float]], None]
log = logging.getLogger(__name__)


@dataclass
class TrainResult:
    steps: int
    resumed_from: int | None
    final_loss: float
    tokens_per_s: float
    checkpoint: str
    skipped_steps: int
    mfu: float | None = 0.0  # None: the device's peak is unknown (trainer.metrics.training_peak_flops)
    parts: list = field(default_factory=list, repr=False)  # the distributed engine's parallelized parts
    model: Any = field(default=None, repr=False)  # trainer.entry: the trained model (or its export)
    extra: dict = field(default_factory=dict)  # a torchrun job's peak memory per rank (max) and world size
    init_bytes: int = 0  # the distributed engine: bytes this rank read from its init checkpoint
    finished: bool = True  # the stage's last step was reached (False: stopped early, as a kill would)
    decay_triggered_at: int | None = None  # the step whose loss started the decay (decay_trigger_loss)


@dataclass
class StepSums:
    """A step's sums over the whole batch (every rank, every micro-batch)."""

    loss: float  # summed token loss
    tokens: int  # its label tokens (the normaliser)
    mtp: float = 0.0  # summed MTP-head loss
    mtp_tokens: int = 0  # its targets; 0 without an MTP head
    seen: int = 0  # input tokens (throughput)
    stats: dict = field(default_factory=dict)  # an objective's own sums (RL: clip counts, KL, entropy, ...)


class StaticSource:
    """The batches of a fixed dataset (CPT, SFT): step ``s`` reads the rows :class:`BatchOrder` gives it. A data
    source is what :func:`fit` asks for each step's rows: ``batch(step) -> (data, idx)``; its ``state_dict`` (None:
    nothing beyond the step) goes into every checkpoint and comes back on resume; ``metrics(sums)`` adds to a
    step's log. ``trainer.rollout.RolloutSource`` is the RL stage's."""

    def __init__(self, data: Packed, cfg: StageTrainConfig, seed: int):
        if len(data) == 0:
            raise ValueError("no training sequences")
        self.data = data
        self.order = BatchOrder(len(data), cfg.batch_size, seed, row_lengths(data) if cfg.group_by_length else None)

    def batch(self, step: int) -> tuple[Packed, torch.Tensor]:
        return self.data, self.order(step)

    def state_dict(self) -> dict | None:
        return None

    def load_state_dict(self, state: dict | None) -> None:
        pass

    def metrics(self, sums: StepSums) -> dict[str, float]:
        return {}


class Engine:
    """What :func:`fit` asks of an engine. The defaults serve an engine that keeps its own lr schedulers in
    ``scheds`` and publishes a checkpoint when its own background write is done."""

    rank = 0  # the rank that logs
    flops_per_token = 0.0
    peak: float | None = None  # FLOP/s of the whole job; None: unknown, no MFU
    scheds: list = []
    lr_schedule: LrSchedule  # what every scheduler in ``scheds`` reads

    def restore(self) -> dict | None:
        """Load the newest complete checkpoint (model, optimizer, schedule); return its trainer state."""
        raise NotImplementedError

    def forward_backward(self, data: Packed, idx) -> Any:
        """Zero the gradients, run forward + loss + backward on this rank's share of the rows ``idx``;
        return its partial sums (in whatever form :meth:`all_reduce` takes)."""
        raise NotImplementedError

    def clip_grad_norm(self) -> float:
        """The global gradient norm before clipping (inf/nan kept); gradients clipped in place."""
        raise NotImplementedError

    def all_reduce(self, local: Any) -> StepSums:
        """The whole batch's sums from this rank's (one process: they are the same)."""
        return local

    def skip(self) -> None:
        """A non-finite step: leave weights, buffers and optimizer state as they were."""
        raise NotImplementedError

    def update(self) -> dict[str, float]:
        """Optimizer step and expert-bias update; returns the MoE load statistics to log."""
        raise NotImplementedError

    def schedule(self) -> None:
        for s in self.scheds:
            s.step()

    def restart_schedules(self, start: int) -> None:
        for s in self.scheds:
            s.last_epoch = start - 1
            s.step()  # recompute the lr for ``start``

    def lr(self) -> float:
        return self.scheds[0].get_last_lr()[0]

    def save(self, step: int, state: dict, async_save: bool) -> checkpoint.PendingSave | None:
        """Checkpoint ``step`` with the trainer ``state``; an asynchronous save in flight is returned."""
        raise NotImplementedError

    def written(self, pending: checkpoint.PendingSave) -> bool:
        """Whether an asynchronous save can be published (its writes are done, on every rank)."""
        return pending.done()

    def latest(self) -> str:
        """The newest complete checkpoint ("" if none)."""
        raise NotImplementedError


class DcpEngine(Engine):
    """An engine of the native model: checkpoints are ``trainer.checkpoint``'s DCP steps in ``ckpt_dir``, bf16
    is ``torch.autocast`` over fp32 parameters. Subclasses load a step (:meth:`load`) and say which modules
    train (:attr:`modules`) on which device."""

    ckpt_dir: str | Path
    cfg: StageTrainConfig
    device: torch.device
    modules: list[torch.nn.Module]

    def load(self, step_dir: Path) -> dict:
        raise NotImplementedError

    def restore(self) -> dict | None:
        state = None
        latest = checkpoint.find_latest(self.ckpt_dir)
        if latest is not None:
            state = self.load(latest)  # fit restarts the schedules at its step, with the trigger's state
        self.autocast = torch.autocast(self.device.type, dtype=torch.bfloat16) if self.cfg.dtype == "bf16" \
            else nullcontext()
        for m in self.modules:
            m.train()
        return state

    def latest(self) -> str:
        latest = checkpoint.find_latest(self.ckpt_dir)
        return str(latest) if latest else ""


def non_finite_message(bad_in_row: int, step: int, loss: float, grad_norm: float, limit: int) -> str:
    return (f"{bad_in_row} non-finite steps in a row (the last: step {step}, loss {loss}, grad norm {grad_norm}); "
            f"stopping at train.max_bad_steps={limit}. The skipped steps changed no weights: resume from the "
            f"last checkpoint with a lower lr, or look for bad data at these steps")


def fault_step(rank: int) -> int | None:
    """``TREX_FAULT_RANK``/``TREX_FAULT_STEP``: that rank dies at that step (the fault-tolerance test)."""
    if os.environ.get("TREX_FAULT_RANK") == str(rank):
        return int(os.environ.get("TREX_FAULT_STEP", "1"))
    return None


def fit(engine: Engine, data: Packed | None, cfg: StageTrainConfig, seed: int, on_log: LogFn | None = None,
        on_step: Callable[[int], None] | None = None, max_bad_steps: int | None = None,
        stop_after: int | None = None, source=None) -> TrainResult:
    """Train for ``cfg.steps`` optimizer steps from the newest checkpoint (``stop_after`` ends early, as a kill
    would). The rows of each step come from ``source`` (default: :class:`StaticSource` over ``data``)."""
    source = source if source is not None else StaticSource(data, cfg, seed)
    start, resumed_from, skipped, loss_val = 0, None, 0, float("nan")
    state = engine.restore()
    schedule = engine.lr_schedule
    if state is not None:
        start = resumed_from = int(state["step"])
        skipped, loss_val = int(state.get("skipped_steps", 0)), float(state.get("loss", float("nan")))
        schedule.load_state_dict(state.get("lr_schedule"))
        engine.restart_schedules(start)  # the lr of the resumed step (a decay the trigger started included)
        source.load_state_dict(state.get("source"))
    max_bad = cfg.max_bad_steps if max_bad_steps is None else max_bad_steps
    stop = cfg.steps if stop_after is None else stop_after
    fault = fault_step(engine.rank)
    bad_in_row = 0
    pending = None  # an asynchronous checkpoint still being written
    t_window, tok_window = time.perf_counter(), 0
    t_total, tok_total = 0.0, 0
    step = start
    while step < min(stop, schedule.last_step):
        if fault is not None and step == fault:
            log.error("TREX_FAULT: rank %d exits at step %d", engine.rank, step)
            os._exit(17)
        rows, idx = source.batch(step)
        local = engine.forward_backward(rows, idx)
        grad_norm = engine.clip_grad_norm()
        sums = engine.all_reduce(local)
        loss_val = sums.loss / max(1, sums.tokens)
        tok_window += sums.seen
        if not (math.isfinite(loss_val) and math.isfinite(grad_norm)):  # the same verdict on every rank
            skipped, bad_in_row = skipped + 1, bad_in_row + 1
            engine.skip()
            moe_stats = {}
            if engine.rank == 0:
                log.warning("step %d: non-finite loss %s / grad norm %s, skipped (%d in a row)", step + 1, loss_val,
                            grad_norm, bad_in_row)
            if bad_in_row >= max_bad:
                if pending is not None:
                    pending.wait()  # the last good checkpoint gets published before the run stops
                raise FloatingPointError(non_finite_message(bad_in_row, step + 1, loss_val, grad_norm, max_bad))
        else:
            bad_in_row = 0
            moe_stats = engine.update()
        done = step + 1
        triggered = bad_in_row == 0 and schedule.observe(done, loss_val)
        engine.schedule()
        if triggered:
            engine.restart_schedules(done)  # the decay starts at the next step; an engine may have read the lr
            if engine.rank == 0:
                log.info("step %d: mean loss of the last %d steps below %s: the lr decays over the next %d steps",
                         done, cfg.decay_trigger_window, cfg.decay_trigger_loss, schedule.decay_len)
        last = schedule.last_step
        if pending is not None and engine.written(pending):  # publish an async checkpoint once it is written
            pending.wait()
            pending = None
        checkpoint.kill_point("step", done)
        if on_step:
            on_step(done)
        if done % cfg.log_every == 0 or done == min(stop, last):
            dt = time.perf_counter() - t_window
            t_total, tok_total = t_total + dt, tok_total + tok_window
            tps = tok_window / max(dt, 1e-9)
            metrics = {"loss": loss_val, "lr": engine.lr(), "grad_norm": grad_norm, "tokens_per_s": tps,
                       "skipped_steps": skipped, **moe_stats}
            if engine.peak:
                metrics["mfu"] = mfu(tps, engine.flops_per_token, engine.peak)
            if sums.mtp_tokens:
                metrics["mtp_loss"] = sums.mtp / sums.mtp_tokens
            metrics.update(source.metrics(sums))
            if on_log and engine.rank == 0:
                on_log(done, metrics)
            t_window, tok_window = time.perf_counter(), 0
        if done % cfg.ckpt_every == 0 or done == last:
            if pending is not None:
                pending.wait()
            trainer_state = {"skipped_steps": skipped, "loss": loss_val, "lr_schedule": schedule.state_dict()}
            if (source_state := source.state_dict()) is not None:
                trainer_state["source"] = source_state
            pending = engine.save(done, trainer_state, async_save=cfg.async_checkpoint and done != last)
        step = done
    if pending is not None:
        pending.wait()
    tps_all = tok_total / max(t_total, 1e-9)
    return TrainResult(steps=step, resumed_from=resumed_from, final_loss=loss_val, tokens_per_s=tps_all,
                       checkpoint=engine.latest(), skipped_steps=skipped,
                       mfu=mfu(tps_all, engine.flops_per_token, engine.peak),
                       finished=step >= schedule.last_step, decay_triggered_at=schedule.triggered_at)
