"""The single-process engine: the native DeepSeek-V4 model on one device (CPU, CUDA or NPU: batches follow the
model), CPT and SFT alike (the objective is in the labels).

The step itself is :func:`trainer.core.fit`'s; here: gradient-accumulation micro-batches normalised by the
token counts of the whole step batch, ``torch.nn.utils.clip_grad_norm_``'s clipping (left to a fused AdamW's
step when it can: :func:`trainer.optim.defer_clip`), AdamW or Muon + AdamW, the
model's own expert-bias update, and DCP checkpoints (``trainer.checkpoint.save``, optionally asynchronous)
holding model, optimizer, RNG and the trainer state, so a resumed run continues exactly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from trainer import checkpoint
from trainer.core import DcpEngine, LogFn, StepSums, TrainResult, fit
from trainer.data import Packed, trim_padding
from trainer.metrics import device_type, training_flops_per_token, training_peak_flops
from trainer.models.deepseek_v4.model import Transformer
from trainer.models.deepseek_v4.training import (CrossEntropy, apply_activation_checkpointing, apply_compile,
                                                 discard_expert_load)
from trainer.optim import LrSchedule, build_optimizers, clip_grad_norm_, schedulers, step_optimizers
from trex.core.config import StageTrainConfig


class SingleEngine(DcpEngine):
    def __init__(self, model: Transformer, cfg: StageTrainConfig, ckpt_dir: str | Path, objective=None):
        """``objective``: what a step minimises (default :class:`CrossEntropy`; the RL stage's GRPO objective)."""
        self.model, self.cfg, self.ckpt_dir = model, cfg, ckpt_dir
        self.objective = objective or CrossEntropy()
        self.opts = build_optimizers(model, cfg)
        self.lr_schedule = LrSchedule(cfg)
        self.scheds = schedulers(self.opts, self.lr_schedule)
        apply_activation_checkpointing(model, cfg.activation_checkpointing)
        if cfg.compile:
            apply_compile(model)
        self.flops_per_token = training_flops_per_token(model.cfg, model.vocab_size, cfg.seq_len)
        self.peak = training_peak_flops(device_type(model), dtype=cfg.dtype)
        self.micro = max(1, cfg.batch_size // cfg.grad_accum)
        self.modules, self.device = [model], next(model.parameters()).device  # batches follow the model

    def load(self, step_dir: Path) -> dict:
        return checkpoint.load(step_dir, self.model, self.opts)

    def forward_backward(self, data: Packed, idx: torch.Tensor) -> StepSums:
        model, micro = self.model, self.micro
        for o in self.opts:
            o.zero_grad(set_to_none=True)
        sums = StepSums(0.0, 0)
        batches = [{k: v.to(self.device) for k, v in trim_padding(data.batch(idx[i:i + micro])).items()}
                   for i in range(0, len(idx), micro)]
        n_all, n_mtp_all = self.objective.normaliser(batches)
        for b in batches:
            with self.autocast:
                loss_sum, n, mtp_sum, n_mtp, stats = self.objective(model, b)
            for k, v in stats.items():
                sums.stats[k] = sums.stats.get(k, 0.0) + v
            objective = loss_sum / max(1, n_all)
            if mtp_sum is not None:
                objective = objective + model.cfg.mtp_loss_weight * mtp_sum / max(1, n_mtp_all)
                sums.mtp += float(mtp_sum.detach())
                sums.mtp_tokens += n_mtp
            objective.backward()
            sums.loss += float(loss_sum.detach())
            sums.tokens += n
            sums.seen += int((b["doc_ids"] >= 0).sum())
        return sums

    def clip_grad_norm(self) -> float:
        return clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip, self.opts)

    def skip(self) -> None:
        for o in self.opts:
            o.zero_grad(set_to_none=True)
        discard_expert_load(self.model)

    def update(self) -> dict[str, float]:
        step_optimizers(self.opts)
        return self.model.update_expert_bias()

    def save(self, step: int, state: dict, async_save: bool) -> checkpoint.PendingSave | None:
        saved = checkpoint.save(self.ckpt_dir, step, self.model, self.opts, state, self.cfg.keep_last,
                                async_save=async_save)
        return saved if isinstance(saved, checkpoint.PendingSave) else None


def train(model: Transformer, data: Packed | None, cfg: StageTrainConfig, ckpt_dir: str | Path, seed: int,
          on_log: LogFn | None = None, on_step: Callable[[int], None] | None = None,
          max_bad_steps: int | None = None, stop_after: int | None = None, objective=None,
          source=None) -> TrainResult:
    """Train ``model`` in place for ``cfg.steps`` optimizer steps, resuming from the newest complete checkpoint
    in ``ckpt_dir`` (``stop_after`` ends early, as a kill would). ``objective`` / ``source``: the RL stage's
    (default: cross-entropy over ``data``'s batches)."""
    return fit(SingleEngine(model, cfg, ckpt_dir, objective), data, cfg, seed, on_log=on_log, on_step=on_step,
               max_bad_steps=max_bad_steps, stop_after=stop_after, source=source)
