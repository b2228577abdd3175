"""Single-process training loop shared by CPT and SFT (the objective is in the labels).

Resumes from the newest complete checkpoint in ``ckpt_dir``: model, optimizer, scheduler step,
RNG and data position (the batch at step ``s`` is a pure function of ``s``), so a resumed run
continues exactly. Metrics go to an ``on_log(step, metrics)`` callback; nothing here knows about
MLflow or Prefect.
"""

from __future__ import annotations

import logging
import math
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from kernels import fused_linear_cross_entropy
from trainer import checkpoint
from trainer.data import IGNORE, Packed, batch_indices
from trainer.metrics import device_type, mfu, training_flops_per_token, training_peak_flops
from trainer.models.deepseek_v4.model import Transformer
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


def _no_decay(name: str, p: torch.nn.Parameter) -> bool:
    return p.dim() < 2 or "embed" in name or "norm" in name or name.endswith((".fn", ".ape"))


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """No weight decay on norms, embeddings, biases/scales and the mHC / position-bias tables."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if _no_decay(name, p) else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizers(model: torch.nn.Module, cfg: StageTrainConfig) -> list[torch.optim.Optimizer]:
    """AdamW everywhere, or Muon (``trainer.muon.ShardedMuon``) on the hidden weight matrices -- 2-D
    projections and the stacked ``[E, D, I]`` expert weights, one matrix per expert -- and AdamW on the rest
    (embeddings, LM head, norms, mHC tables, biases)."""
    from trainer.muon import ShardedMuon

    adamw = dict(lr=cfg.lr, betas=(0.9, 0.95), eps=cfg.adam_eps)
    if cfg.optimizer == "adamw":
        return [torch.optim.AdamW(param_groups(model, cfg.weight_decay), **adamw)]
    muon, rest = [], {"decay": [], "no_decay": []}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if p.dim() in (2, 3) and not _no_decay(name, p) and "lm_head" not in name:
            muon.append(p)
        else:
            rest["no_decay" if _no_decay(name, p) else "decay"].append(p)
    return [ShardedMuon(muon, lr=cfg.lr, weight_decay=cfg.weight_decay, adjust_lr_fn="match_rms_adamw",
                        ns_dtype=torch.float32 if cfg.muon_ns_dtype == "fp32" else torch.bfloat16),
            torch.optim.AdamW([{"params": rest["decay"], "weight_decay": cfg.weight_decay},
                               {"params": rest["no_decay"], "weight_decay": 0.0}], **adamw)]


def lr_lambda(cfg: StageTrainConfig) -> Callable[[int], float]:
    """Linear warmup, then cosine decay to ``min_lr_ratio`` of the peak, or (wsd) a constant peak and a
    linear decay to ``min_lr_ratio`` over the last ``decay_fraction`` of the steps."""

    def f(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / (cfg.warmup_steps + 1)
        if cfg.schedule == "wsd":
            decay_start = cfg.steps - max(1, round(cfg.decay_fraction * cfg.steps))
            if step < decay_start:
                return 1.0
            progress = min(1.0, (step - decay_start) / max(1, cfg.steps - decay_start))
            return 1.0 - (1.0 - cfg.min_lr_ratio) * progress
        span = max(1, cfg.steps - cfg.warmup_steps)
        progress = min(1.0, (step - cfg.warmup_steps) / span)
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return f


def mtp_labels(labels_bt: torch.Tensor, doc_bt: torch.Tensor) -> torch.Tensor:
    """Targets of the MTP head at positions 0..T-2: the label one step further, inside the same document."""
    nxt = labels_bt[:, 1:].clone()
    nxt[doc_bt[:, 1:] != doc_bt[:, :-1]] = IGNORE
    return nxt


def loss_fn(model: Transformer, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int, torch.Tensor | None, int]:
    """Summed main cross-entropy and its token count, and the same for the MTP head (if any).

    The CSA indexers' KL losses (summed over tokens, scaled by ``indexer_loss_weight``) are added to the
    main sum: they train only the indexers, whose inputs are detached.
    """
    h, mtp_h = model.hidden_train(batch["input_ids"], batch["doc_ids"])
    labels = batch["labels"]
    w = model.lm_head.weight
    n = int((labels != IGNORE).sum())
    # the LM head and the loss together, chunk by chunk: the [tokens, vocab] logits never exist at once
    loss = fused_linear_cross_entropy(h.reshape(-1, h.shape[-1]), w, labels.reshape(-1), ignore_index=IGNORE,
                                      reduction="sum")
    aux = model.indexer_loss() if model.training else None
    if aux is not None:
        loss = loss + model.cfg.indexer_loss_weight * aux
    if not mtp_h:
        return loss, n, None, 0
    target = mtp_labels(labels, batch["doc_ids"])
    mtp = sum(fused_linear_cross_entropy(m.reshape(-1, m.shape[-1]), w, target.reshape(-1), ignore_index=IGNORE,
                                         reduction="sum") for m in mtp_h)
    return loss, n, mtp, int((target != IGNORE).sum())


def discard_expert_load(model: torch.nn.Module) -> None:
    """Forget the expert load counted by a skipped step's forward (the bias update never sees it)."""
    for m in model.modules():
        load = getattr(m, "load_e", None)
        if isinstance(load, torch.Tensor):
            load.zero_()


def non_finite_message(bad_in_row: int, step: int, loss: float, grad_norm: float, limit: int) -> str:
    return (f"{bad_in_row} non-finite steps in a row (the last: step {step}, loss {loss}, grad norm {grad_norm}); "
            f"stopping at train.max_bad_steps={limit}. The skipped steps changed no weights: resume from the "
            f"last checkpoint with a lower lr, or look for bad data at these steps")


def apply_activation_checkpointing(model: Transformer, mode: str) -> None:
    """Recompute the MoE (``moe``) or whole blocks (``block``) in the backward pass instead of storing them."""
    if mode == "none":
        return
    from torch.utils.checkpoint import checkpoint

    def wrap(module: torch.nn.Module) -> None:
        if getattr(module, "_trex_ac", False):
            return
        inner = module.forward
        module.forward = lambda *a, **k: checkpoint(inner, *a, use_reentrant=False, **k)
        module._trex_ac = True

    layers = model.layers.values() if isinstance(model.layers, torch.nn.ModuleDict) else model.layers  # a stage
    for layer in list(layers) + [m.block for m in model.mtp]:
        wrap(layer.ffn if mode == "moe" else layer)


def train(model: Transformer, data: Packed, cfg: StageTrainConfig, ckpt_dir: str | Path, seed: int,
          on_log: LogFn | None = None, on_step: Callable[[int], None] | None = None,
          max_bad_steps: int | None = None, stop_after: int | None = None) -> TrainResult:
    """Train for ``cfg.steps`` optimizer steps (``stop_after`` ends early, as a kill would)."""
    opts = build_optimizers(model, cfg)
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lr_lambda(cfg)) for o in opts]
    apply_activation_checkpointing(model, cfg.activation_checkpointing)
    max_bad_steps = cfg.max_bad_steps if max_bad_steps is None else max_bad_steps
    flops_per_token = training_flops_per_token(model.cfg, model.vocab_size, cfg.seq_len)
    peak = training_peak_flops(device_type(model))
    start, resumed_from, skipped, loss_val = 0, None, 0, float("nan")
    latest = checkpoint.find_latest(ckpt_dir)
    if latest is not None:
        state = checkpoint.load(latest, model, opts)
        start = resumed_from = state["step"]
        skipped = state.get("skipped_steps", 0)
        loss_val = state.get("loss", float("nan"))
        for sched in scheds:
            sched.last_epoch = start - 1
            sched.step()  # recompute the lr for ``start``
    if len(data) == 0:
        raise ValueError("no training sequences")
    device = next(model.parameters()).device  # batches follow the model (CPU, CUDA, NPU: same code path)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if cfg.dtype == "bf16" else nullcontext()
    model.train()
    bad_in_row = 0
    pending = None  # an asynchronous checkpoint still being written
    t_window, tok_window = time.perf_counter(), 0
    t_total, tok_total = 0.0, 0
    micro = max(1, cfg.batch_size // cfg.grad_accum)
    end = cfg.steps if stop_after is None else min(cfg.steps, stop_after)
    step = start
    for step in range(start, end):
        idx = batch_indices(len(data), cfg.batch_size, step, seed)
        for o in opts:
            o.zero_grad(set_to_none=True)
        total_loss, total_n, total_mtp, total_n_mtp = 0.0, 0, 0.0, 0
        batches = [{k: v.to(device) for k, v in data.batch(idx[i:i + micro]).items()}
                   for i in range(0, len(idx), micro)]
        n_all = sum(int((b["labels"] != IGNORE).sum()) for b in batches)
        n_mtp_all = sum(int((mtp_labels(b["labels"], b["doc_ids"]) != IGNORE).sum()) for b in batches)
        for b in batches:
            with autocast:
                loss_sum, n, mtp_sum, n_mtp = loss_fn(model, b)
            objective = loss_sum / max(1, n_all)
            if mtp_sum is not None:
                objective = objective + model.cfg.mtp_loss_weight * mtp_sum / max(1, n_mtp_all)
                total_mtp += float(mtp_sum.detach())
                total_n_mtp += n_mtp
            objective.backward()
            total_loss += float(loss_sum.detach())
            total_n += n
            tok_window += int((b["doc_ids"] >= 0).sum())
        grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip))
        loss_val = total_loss / max(1, total_n)
        if not math.isfinite(loss_val) or not math.isfinite(grad_norm):
            # skipped: no optimizer step and no expert-bias update, so weights, buffers and optimizer state
            # stay as they were; the schedule still advances (it is a function of the step)
            skipped += 1
            bad_in_row += 1
            for o in opts:
                o.zero_grad(set_to_none=True)
            discard_expert_load(model)
            moe_stats = {}
            log.warning("step %d: non-finite loss %s / grad norm %s, skipped (%d in a row)", step + 1, loss_val,
                        grad_norm, bad_in_row)
            if bad_in_row >= max_bad_steps:
                if pending is not None:
                    pending.wait()  # the last good checkpoint gets published before the run stops
                raise FloatingPointError(non_finite_message(bad_in_row, step + 1, loss_val, grad_norm, max_bad_steps))
        else:
            bad_in_row = 0
            for o in opts:
                o.step()
            moe_stats = model.update_expert_bias()
        for sched in scheds:
            sched.step()
        done = step + 1
        if pending is not None and pending.done():  # publish an async checkpoint as soon as it is written
            pending.wait()
            pending = None
        checkpoint.kill_point("step", done)
        if on_step:
            on_step(done)
        if done % cfg.log_every == 0 or done == end:
            dt = time.perf_counter() - t_window
            t_total += dt
            tok_total += tok_window
            tps = tok_window / max(dt, 1e-9)
            metrics = {"loss": loss_val, "lr": scheds[0].get_last_lr()[0], "grad_norm": grad_norm,
                       "tokens_per_s": tps, "skipped_steps": skipped, **moe_stats}
            if peak:
                metrics["mfu"] = mfu(tps, flops_per_token, peak)
            if total_n_mtp:
                metrics["mtp_loss"] = total_mtp / total_n_mtp
            if on_log:
                on_log(done, metrics)
            t_window, tok_window = time.perf_counter(), 0
        if done % cfg.ckpt_every == 0 or done == cfg.steps:
            if pending is not None:
                pending.wait()
            pending = checkpoint.save(ckpt_dir, done, model, opts, {"skipped_steps": skipped, "loss": loss_val},
                                      cfg.keep_last, async_save=cfg.async_checkpoint and done != cfg.steps)
            if not isinstance(pending, checkpoint.PendingSave):
                pending = None
    if pending is not None:
        pending.wait()
    latest = checkpoint.find_latest(ckpt_dir)
    return TrainResult(steps=end, resumed_from=resumed_from, final_loss=loss_val,
                       tokens_per_s=tok_total / max(t_total, 1e-9), checkpoint=str(latest) if latest else "",
                       skipped_steps=skipped, mfu=mfu(tok_total / max(t_total, 1e-9), flops_per_token, peak))


@torch.no_grad()
def evaluate_loss(model: Transformer, data: Packed, batch_size: int = 8) -> float:
    """Mean token loss over all rows of ``data`` (no gradient)."""
    was_training = model.training
    device = next(model.parameters()).device
    model.eval()
    total, n = 0.0, 0
    for s in range(0, len(data), batch_size):
        batch = data.batch(torch.arange(s, min(s + batch_size, len(data))))
        loss_sum, k, _, _ = loss_fn(model, {key: v.to(device) for key, v in batch.items()})
        total += float(loss_sum)
        n += k
    model.train(was_training)
    return total / max(1, n)
