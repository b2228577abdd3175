"""Optimizers and the learning-rate schedule of every engine: one no-decay rule, AdamW or Muon + AdamW, and
linear warmup followed by cosine decay or warmup-stable-decay (WSD)."""

from __future__ import annotations

import math
from typing import Callable, Iterable

import torch

from trainer.muon import ShardedMuon
from trex.core.config import StageTrainConfig

Named = Iterable[tuple[str, torch.nn.Parameter]]


def no_decay(name: str, p: torch.nn.Parameter) -> bool:
    """No weight decay on norms, embeddings, biases/scales and the mHC / position-bias tables: under the native
    names (``.fn``, ``.ape``) and under transformers' (``hc_head.hc_fn``, ``compressor.position_bias``)."""
    return (p.dim() < 2 or "embed" in name or "norm" in name
            or name.endswith((".fn", ".ape", ".hc_fn", ".position_bias")))


def _groups(named: Named, weight_decay: float) -> list[dict]:
    decay, rest = [], []
    for name, p in named:
        if p.requires_grad:
            (rest if no_decay(name, p) else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """The decayed and the :func:`no_decay` parameters of ``model`` (trainable ones, in module order)."""
    return _groups(model.named_parameters(), weight_decay)


def _muon_matrix(name: str, p: torch.nn.Parameter) -> bool:
    return p.dim() in (2, 3) and not no_decay(name, p) and "lm_head" not in name


def build_optimizers(model: torch.nn.Module, cfg: StageTrainConfig) -> list[torch.optim.Optimizer]:
    """AdamW everywhere, or Muon (``trainer.muon.ShardedMuon``) on the hidden weight matrices -- 2-D
    projections and the stacked ``[E, D, I]`` expert weights, one matrix per expert -- and AdamW on the rest
    (embeddings, LM head, norms, mHC tables, biases)."""
    adamw = dict(lr=cfg.lr, betas=(0.9, 0.95), eps=cfg.adam_eps)
    if cfg.optimizer == "adamw":
        return [torch.optim.AdamW(param_groups(model, cfg.weight_decay), **adamw)]
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    muon = [p for n, p in named if _muon_matrix(n, p)]
    rest = [(n, p) for n, p in named if not _muon_matrix(n, p)]
    return [ShardedMuon(muon, lr=cfg.lr, weight_decay=cfg.weight_decay, adjust_lr_fn="match_rms_adamw",
                        ns_dtype=torch.float32 if cfg.muon_ns_dtype == "fp32" else torch.bfloat16),
            torch.optim.AdamW(_groups(rest, cfg.weight_decay), **adamw)]


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


def schedulers(opts: list[torch.optim.Optimizer], cfg: StageTrainConfig) -> list[torch.optim.lr_scheduler.LambdaLR]:
    return [torch.optim.lr_scheduler.LambdaLR(o, lr_lambda(cfg)) for o in opts]
