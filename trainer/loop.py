"""Single-process training loop shared by CPT and SFT (the objective is in the labels).

Resumes from the newest complete checkpoint in ``ckpt_dir``: model, optimizer, scheduler step,
RNG and data position (the batch at step ``s`` is a pure function of ``s``), so a resumed run
continues exactly. Metrics go to an ``on_log(step, metrics)`` callback; nothing here knows about
MLflow or Prefect.
"""

from __future__ import annotations

import math
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from trainer import checkpoint
from trainer.data import IGNORE, Packed, batch_indices
from trainer.models.deepseek_v4.model import Transformer, document_mask
from trex.config import StageTrainConfig

LogFn = Callable[[int, dict[str, float]], None]


@dataclass
class TrainResult:
    steps: int
    resumed_from: int | None
    final_loss: float
    tokens_per_s: float
    checkpoint: str
    skipped_steps: int


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """No weight decay on norms, embeddings and 1-D parameters."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.dim() < 2 or "embed" in name or "norm" in name else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def lr_lambda(cfg: StageTrainConfig) -> Callable[[int], float]:
    """Linear warmup then cosine decay to ``min_lr_ratio`` of the peak."""

    def f(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / (cfg.warmup_steps + 1)
        span = max(1, cfg.steps - cfg.warmup_steps)
        progress = min(1.0, (step - cfg.warmup_steps) / span)
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return f


def loss_fn(model: Transformer, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
    mask = document_mask(batch["doc_ids"])
    logits = model(batch["input_ids"], batch["position_ids"], mask)
    labels = batch["labels"]
    n = int((labels != IGNORE).sum())
    loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.view(-1), ignore_index=IGNORE, reduction="sum")
    return loss, n


def train(model: Transformer, data: Packed, cfg: StageTrainConfig, ckpt_dir: str | Path, seed: int,
          on_log: LogFn | None = None, on_step: Callable[[int], None] | None = None,
          max_bad_steps: int = 5, stop_after: int | None = None) -> TrainResult:
    """Train for ``cfg.steps`` optimizer steps (``stop_after`` ends early, as a kill would)."""
    opt = torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg))
    start, resumed_from, skipped, loss_val = 0, None, 0, float("nan")
    latest = checkpoint.find_latest(ckpt_dir)
    if latest is not None:
        state = checkpoint.load(latest, model, opt)
        start = resumed_from = state["step"]
        skipped = state.get("skipped_steps", 0)
        loss_val = state.get("loss", float("nan"))
        sched.last_epoch = start - 1
        sched.step()  # recompute the lr for ``start``
    if len(data) == 0:
        raise ValueError("no training sequences")
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if cfg.dtype == "bf16" else nullcontext()
    model.train()
    bad_in_row = 0
    t_window, tok_window = time.perf_counter(), 0
    t_total, tok_total = 0.0, 0
    micro = max(1, cfg.batch_size // cfg.grad_accum)
    end = cfg.steps if stop_after is None else min(cfg.steps, stop_after)
    step = start
    for step in range(start, end):
        idx = batch_indices(len(data), cfg.batch_size, step, seed)
        opt.zero_grad(set_to_none=True)
        total_loss, total_n = 0.0, 0
        batches = [data.batch(idx[i:i + micro]) for i in range(0, len(idx), micro)]
        n_all = sum(int((b["labels"] != IGNORE).sum()) for b in batches)
        for b in batches:
            with autocast:
                loss_sum, n = loss_fn(model, b)
            (loss_sum / max(1, n_all)).backward()
            total_loss += float(loss_sum.detach())
            total_n += n
            tok_window += int((b["doc_ids"] >= 0).sum())
        grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip))
        loss_val = total_loss / max(1, total_n)
        if not math.isfinite(loss_val) or not math.isfinite(grad_norm):
            skipped += 1
            bad_in_row += 1
            opt.zero_grad(set_to_none=True)
            if bad_in_row >= max_bad_steps:
                raise FloatingPointError(f"{bad_in_row} non-finite steps in a row at step {step}")
        else:
            bad_in_row = 0
            opt.step()
        sched.step()
        moe_stats = model.update_expert_bias()
        done = step + 1
        if on_step:
            on_step(done)
        if done % cfg.log_every == 0 or done == end:
            dt = time.perf_counter() - t_window
            t_total += dt
            tok_total += tok_window
            metrics = {"loss": loss_val, "lr": sched.get_last_lr()[0], "grad_norm": grad_norm,
                       "tokens_per_s": tok_window / max(dt, 1e-9), "skipped_steps": skipped, **moe_stats}
            if on_log:
                on_log(done, metrics)
            t_window, tok_window = time.perf_counter(), 0
        if done % cfg.ckpt_every == 0 or done == cfg.steps:
            checkpoint.save(ckpt_dir, done, model, opt, {"skipped_steps": skipped, "loss": loss_val}, cfg.keep_last)
    latest = checkpoint.find_latest(ckpt_dir)
    return TrainResult(steps=end, resumed_from=resumed_from, final_loss=loss_val,
                       tokens_per_s=tok_total / max(t_total, 1e-9), checkpoint=str(latest) if latest else "",
                       skipped_steps=skipped)


@torch.no_grad()
def evaluate_loss(model: Transformer, data: Packed, batch_size: int = 8) -> float:
    """Mean token loss over all rows of ``data`` (no gradient)."""
    was_training = model.training
    model.eval()
    total, n = 0.0, 0
    for s in range(0, len(data), batch_size):
        loss_sum, k = loss_fn(model, data.batch(torch.arange(s, min(s + batch_size, len(data)))))
        total += float(loss_sum)
        n += k
    model.train(was_training)
    return total / max(1, n)
