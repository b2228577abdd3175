"""Optimizers and the learning-rate schedule of every engine: one no-decay rule, AdamW or Muon + AdamW, and
linear warmup followed by cosine decay or warmup-stable-decay (WSD), whose decay a loss threshold can start."""

from __future__ import annotations

import math
from typing import Iterable, Sequence

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


def adamw_fused(params: Iterable[torch.nn.Parameter]) -> bool:
    """AdamW's fused kernel (one pass per parameter instead of ~10 multi-tensor passes) where every parameter is
    on one device type, CUDA or CPU, and either all are plain tensors or all are DTensors of one device mesh
    (FSDP2's shards: the fused op runs on the local shards; DTensors of several meshes -- expert or tensor
    parallel layouts -- and other devices keep the foreach implementation). On an H200 the foreach step of a
    2.5 B-parameter model took 49 ms of a 340 ms training step; on this 2-core CPU the 58 M parameters of
    bench_20m take 37 ms fused against 120 ms foreach (whose CPU path is a loop of per-tensor ops), ~4 % of that
    config's training step."""
    from torch.distributed.tensor import DTensor

    params = list(params)
    if not params or len({p.device.type for p in params}) != 1 or params[0].device.type not in ("cuda", "cpu"):
        return False
    sharded = [p for p in params if isinstance(p, DTensor)]
    return not sharded or (len(sharded) == len(params) and len({p.device_mesh for p in sharded}) == 1)


def clip_grad_norm_(params: Iterable[torch.nn.Parameter], max_norm: float,
                    optimizers: Sequence[torch.optim.Optimizer] = ()) -> float:
    """``torch.nn.utils.clip_grad_norm_`` (L2): the same norm and the same clipping factor
    ``min(1, max_norm / (norm + 1e-6))``, computed the same way, but the gradients are multiplied only when the
    factor is not exactly 1 (inf/nan norms included: their factor is 0 / nan, as torch applies it). Below the
    threshold (steps whose norm is under ``max_norm``) that saves a pass over every gradient: ~12 ms a step for
    bench_20m's 45 M fp32 gradients on 2 cores. Returns the norm before clipping.

    With ``optimizers`` (those about to step over these parameters) a finite factor below 1 is not applied here
    when :func:`defer_clip` can hand it to their next step instead; call :func:`step_optimizers` to step them."""
    for o in optimizers:
        clear_deferred_clip(o)
    params = [p for p in params if p.grad is not None]
    total = torch.nn.utils.get_total_norm([p.grad for p in params])
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    if float(coef) != 1.0 and not defer_clip(optimizers, params, coef):
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return float(total)


def defer_clip(optimizers: Sequence[torch.optim.Optimizer], params: list[torch.nn.Parameter],
               coef: torch.Tensor) -> bool:
    """Hand the clipping factor ``coef`` (a finite 0-d tensor in (0, 1)) to the optimizers' next step instead of
    multiplying every gradient by it now, where that step can apply it as it reads the gradients: every optimizer
    is a fused torch Adam / AdamW (its kernel divides each gradient by ``grad_scale`` -- the attribute
    ``torch.amp.GradScaler`` sets for fused optimizers -- and writes the clipped gradient back) and together they
    hold every parameter in ``params``. One pass over the gradients fewer: bench_20m's 59 M fp32 gradients on 2
    cores, the multiply 12.1 ms, the fused step 37.4 -> 40.0 ms with the scale. The update differs from
    multiplying first by one rounding (``g / (1 / coef)`` instead of ``g * coef``). Returns whether it did;
    :func:`step_optimizers` clears the factor after the step."""
    if not optimizers or not bool(torch.isfinite(coef)) or float(coef) <= 0.0:
        return False
    if not all(isinstance(o, torch.optim.Adam) and all(g.get("fused") for g in o.param_groups) for o in optimizers):
        return False
    held = {id(p) for o in optimizers for g in o.param_groups for p in g["params"]}
    if any(id(p) not in held for p in params):
        return False
    scale = torch.reciprocal(coef.detach().to(torch.float32)).reshape(())
    for o in optimizers:
        o.grad_scale = scale  # type: ignore[attr-defined]
    return True


def step_optimizers(optimizers: Sequence[torch.optim.Optimizer]) -> None:
    """Step every optimizer, applying (and then clearing) a clipping factor :func:`defer_clip` left them."""
    for o in optimizers:
        o.step()
        clear_deferred_clip(o)


def clear_deferred_clip(optimizer: torch.optim.Optimizer) -> None:
    """Forget a factor :func:`defer_clip` left (a skipped step)."""
    if getattr(optimizer, "grad_scale", None) is not None:
        optimizer.grad_scale = None  # type: ignore[attr-defined]


def build_optimizers(model: torch.nn.Module, cfg: StageTrainConfig) -> list[torch.optim.Optimizer]:
    """AdamW everywhere, or Muon (``trainer.muon.ShardedMuon``) on the hidden weight matrices -- 2-D
    projections and the stacked ``[E, D, I]`` expert weights, one matrix per expert -- and AdamW on the rest
    (embeddings, LM head, norms, mHC tables, biases)."""
    adamw = dict(lr=cfg.lr, betas=(0.9, 0.95), eps=cfg.adam_eps)
    if cfg.optimizer == "adamw":
        groups = param_groups(model, cfg.weight_decay)
        return [torch.optim.AdamW(groups, **adamw, fused=adamw_fused(p for g in groups for p in g["params"]) or None)]
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    muon = [p for n, p in named if _muon_matrix(n, p)]
    rest = [(n, p) for n, p in named if not _muon_matrix(n, p)]
    return [ShardedMuon(muon, lr=cfg.lr, weight_decay=cfg.weight_decay, adjust_lr_fn="match_rms_adamw",
                        ns_dtype=torch.float32 if cfg.muon_ns_dtype == "fp32" else torch.bfloat16),
            torch.optim.AdamW(_groups(rest, cfg.weight_decay), **adamw, fused=adamw_fused(p for _, p in rest) or None)]


class LrSchedule:
    """The learning-rate factor of every step: linear warmup, then cosine decay to ``min_lr_ratio`` of the peak,
    or (wsd) a constant peak and a linear decay to ``min_lr_ratio`` over the last ``decay_steps`` (default
    ``decay_fraction`` of the steps; all of them in a run shorter than that).

    With ``decay_trigger_loss`` the stable phase ends early, as soon as the mean training loss of the last
    ``decay_trigger_window`` steps (fed by :meth:`observe`) falls below it: a skill that appears abruptly after
    a plateau of varying length (docs/model.md, "Learning at tiny scale") gets the peak rate until it appears
    and the decay right after, and the stage ends ``decay_steps`` later (:attr:`last_step`). The trigger is a
    function of the losses, which every rank sees all-reduced, so all ranks decide alike; its state goes into
    checkpoints (:meth:`state_dict`) for a bit-identical resume."""

    def __init__(self, cfg: StageTrainConfig):
        self.cfg = cfg
        self.decay_len = min(cfg.steps, cfg.decay_steps or max(1, round(cfg.decay_fraction * cfg.steps)))
        self.triggered_at: int | None = None
        self.window: list[float] = []

    @property
    def decay_start(self) -> int:
        """The first decaying step: the trigger's, else the last ``decay_steps``' first."""
        return self.cfg.steps - self.decay_len if self.triggered_at is None else self.triggered_at

    def __call__(self, step: int) -> float:
        cfg = self.cfg
        if step < cfg.warmup_steps:
            return (step + 1) / (cfg.warmup_steps + 1)
        if cfg.schedule == "wsd":
            if step < self.decay_start:
                return 1.0
            progress = min(1.0, (step - self.decay_start) / self.decay_len)
            return 1.0 - (1.0 - cfg.min_lr_ratio) * progress
        span = max(1, cfg.steps - cfg.warmup_steps)
        progress = min(1.0, (step - cfg.warmup_steps) / span)
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    @property
    def last_step(self) -> int:
        """The step the stage ends at: ``steps``, or ``decay_steps`` after the trigger."""
        return self.cfg.steps if self.triggered_at is None else min(self.cfg.steps, self.triggered_at + self.decay_len)

    def observe(self, done: int, loss: float) -> bool:
        """The training loss of step ``done`` (1-based; finite steps only). True when it ends the stable phase:
        the decay then starts at step ``done`` (re-read the lr of every scheduler)."""
        limit, size = self.cfg.decay_trigger_loss, self.cfg.decay_trigger_window
        if limit is None or self.triggered_at is not None:
            return False
        self.window = (self.window + [float(loss)])[-size:]
        if (len(self.window) == size and done >= self.cfg.warmup_steps and done < self.decay_start
                and sum(self.window) / size < limit):
            self.triggered_at = done
            return True
        return False

    def state_dict(self) -> dict:
        return {"triggered_at": self.triggered_at, "window": list(self.window)}

    def load_state_dict(self, state: dict | None) -> None:
        state = state or {}
        self.triggered_at, self.window = state.get("triggered_at"), list(state.get("window", []))


def schedulers(opts: list[torch.optim.Optimizer], schedule: LrSchedule) -> list[torch.optim.lr_scheduler.LambdaLR]:
    """One ``LambdaLR`` per optimizer over ``schedule``: through a plain function, which ``LambdaLR.state_dict``
    leaves out (the trigger's state travels in the trainer state)."""
    return [torch.optim.lr_scheduler.LambdaLR(o, lambda step: schedule(step)) for o in opts]
