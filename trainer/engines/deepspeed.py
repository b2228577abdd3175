"""The baseline recipe: ``transformers``' DeepSeek-V4 (or any ``AutoModelForCausalLM``) + DeepSpeed ZeRO.

:class:`DeepSpeedEngine` runs on every rank of a ``torchrun`` job (``deepspeed_rank.py``); the step is
:func:`trainer.core.fit`'s, as for the native engines, so that the two are comparable step for step:

- initial weights: the native ``build_model(cfg, vocab, seed)`` (or an export / HF directory) converted
  with the state-dict adapter, so both engines start bit-identical;
- data: the same :class:`~trainer.data.Packed` rows, the same ``batch_indices(step, seed)`` batch per
  optimizer step; rank ``r`` takes the ``r``-th contiguous slice of that batch and splits it into
  ``grad_accum`` micro-batches;
- objective: summed token cross-entropy divided by the label tokens of the *whole* step batch (all ranks,
  all micro-batches), i.e. the same token-weighted mean; AdamW (betas 0.9/0.95, eps 1e-8; fused where the
  native loop's is) with the same no-decay groups (``trainer.optim``), the same warmup + cosine/WSD schedule,
  global-norm gradient clipping;
- the aux-loss-free expert-bias update (counts all-reduced over ranks, then the native sign rule);
- metrics, checkpoint cadence, the non-finite guard: ``trainer.core``'s;
- the HF export at the end (``trainer.export.export`` of the fp32 master weights).

Differences (docs/baseline.md): the HF model has no document mask, so packed rows are one causal sequence
(the labels are the same); it has no MTP head and no CSA-indexer loss (its indexer is not trained); with
``dtype: bf16`` DeepSpeed keeps bf16 parameters with fp32 master weights where the native engines use fp32
parameters under autocast; a non-finite step is counted (and ``max_bad_steps`` in a row stop the run) but
DeepSpeed has already applied its optimizer step (only the expert-bias update is skipped). Checkpoints
are DeepSpeed's (``ckpt_dir/step_XXXXXXXX`` + ``latest``), written synchronously.

``deepspeed`` and ``transformers`` are imported where they are used: importing DeepSpeed picks its
accelerator (the launcher sets ``DS_ACCELERATOR`` first), and both take seconds to import.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from trainer.core import Engine, StepSums
from trainer.data import IGNORE, Packed, pack
from trainer.export import build_model, export, load_export
from trainer.metrics import peak_flops, training_flops_per_token
from trainer.models.deepseek_v4.args import ModelArgs
from trainer.models.deepseek_v4.model import Transformer
from trainer.models.deepseek_v4.state_dict_adapter import from_hf, hf_config, to_hf
from trainer.models.deepseek_v4.training import inductor_or_eager
from trainer.optim import LrSchedule, adamw_fused, param_groups, schedulers
from trainer.tokenizer import TOKENIZER_FILES
from trex.core.config import StageTrainConfig


# ------------------------------------------------------------------------------------------ config
def ds_config(cfg: StageTrainConfig, world: int) -> dict:
    """The DeepSpeed JSON for a stage: global batch = ``batch_size`` rows = world x grad_accum x micro."""
    if cfg.batch_size % (world * cfg.grad_accum):
        raise ValueError(f"batch_size {cfg.batch_size} is not divisible by nproc ({world}) x grad_accum "
                         f"({cfg.grad_accum})")
    zero: dict = {"stage": cfg.zero_stage, "overlap_comm": False, "contiguous_gradients": True,
                  "reduce_bucket_size": 50_000_000, "allgather_bucket_size": 50_000_000}
    if cfg.zero_stage == 3:
        zero.update({"stage3_prefetch_bucket_size": 50_000_000, "stage3_param_persistence_threshold": 10_000,
                     "stage3_gather_16bit_weights_on_model_save": False})
    if cfg.offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
        if cfg.zero_stage == 3:
            zero["offload_param"] = {"device": "cpu", "pin_memory": False}
    return {
        "train_batch_size": cfg.batch_size,
        "train_micro_batch_size_per_gpu": cfg.batch_size // (world * cfg.grad_accum),
        "gradient_accumulation_steps": cfg.grad_accum,
        "gradient_clipping": cfg.grad_clip,
        "bf16": {"enabled": cfg.dtype == "bf16"},
        "fp16": {"enabled": False},
        "zero_optimization": zero,
        # the optimizer is torch's AdamW (same as the native loop), also when states are offloaded
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 10 ** 9,
        "wall_clock_breakdown": False,
    }


# ------------------------------------------------------------------------------------------- data
def unpacked(docs: list[tuple[list[int], list[int]]], seq_len: int, pad_id: int) -> Packed:
    """One document per row, right-padded (labels -100 on padding): rows on which a model without a
    document mask computes exactly what the native packed-attention model computes."""
    rows = [pack([d], seq_len, pad_id) for d in docs]
    stats = {"documents": len(docs), "sequences": len(rows), "tokens": sum(r.stats["tokens"] for r in rows),
             "loss_tokens": sum(r.stats["loss_tokens"] for r in rows),
             "truncated": sum(r.stats["truncated"] for r in rows)}
    stats["fill"] = stats["tokens"] / max(1, len(rows) * seq_len)
    return Packed(*(torch.cat([getattr(r, k) for r in rows]) for k in ("input_ids", "labels", "doc_ids",
                                                                        "position_ids")), stats)


# ------------------------------------------------------------------------------------------ model
def _plug_softmax() -> None:
    from transformers.activations import ACT2FN

    # transformers 5.x names "softmax" as a V4 scoring function but has no activation of that name
    ACT2FN.setdefault("softmax", (torch.nn.Softmax, {"dim": -1}))


def hf_from_native(native, cfg: ModelArgs):
    """``DeepseekV4ForCausalLM`` (fp32) holding the native model's weights (MTP weights are dropped)."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    _plug_softmax()
    hf = DeepseekV4ForCausalLM(DeepseekV4Config(**hf_config(cfg.model_copy(update={"mtp_layers": 0}),
                                                            native.vocab_size))).float()
    state = {k: v for k, v in to_hf(native.state_dict(), cfg).items() if not k.startswith("mtp.")}
    missing, unexpected = hf.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise RuntimeError(f"native -> HF weights: missing {missing}, unexpected {unexpected}")
    return hf


def build_baseline_model(model_cfg: ModelArgs | None, vocab_size: int | None, seed: int,
                         init_dir: str | None = None):
    """(HF model, native ModelArgs or None for a non-V4 model).

    No ``init_dir``: the native ``build_model(cfg, vocab, seed)`` converted to HF (the native engine's
    initial weights, bit for bit). A DeepSeek-V4 directory (a T-Rex export or an HF checkpoint) goes
    through ``load_export`` + the adapter; any other directory loads with ``AutoModelForCausalLM``."""
    if init_dir is not None:
        config = json.loads((Path(init_dir) / "config.json").read_text())
        if config.get("model_type") != "deepseek_v4":
            from transformers import AutoModelForCausalLM

            return AutoModelForCausalLM.from_pretrained(init_dir, dtype=torch.float32), None
        native = load_export(init_dir)
    else:
        native = build_model(model_cfg, vocab_size, seed)
    cfg = native.cfg
    if cfg.mtp_layers:
        print("deepspeed engine: transformers' DeepseekV4ForCausalLM has no MTP head; training without it",
              file=sys.stderr)
        cfg = cfg.model_copy(update={"mtp_layers": 0})
    return hf_from_native(native, native.cfg), cfg


def _freeze_untrained_indexers(model: torch.nn.Module) -> None:
    """transformers' model has no indexer loss, so its CSA indexers never get a gradient (the top-k selection is
    not differentiable). Eagerly ZeRO never hears of them; compiled, its gradient hooks fire with no gradient
    (``'NoneType' object has no attribute 'view'`` in ZeRO-2's reduce). Freezing them changes nothing else: AdamW
    skips a parameter without a gradient."""
    for n, p in model.named_parameters():
        if ".indexer." in n:
            p.requires_grad_(False)


def apply_activation_checkpointing(model: torch.nn.Module, mode: str) -> None:
    if mode == "none":
        return
    if mode == "block":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return
    for layer in model.model.layers:
        inner = layer.mlp.forward
        layer.mlp.forward = (lambda f: (lambda *a, **k: checkpoint(f, *a, use_reentrant=False, **k)))(inner)


class ExpertBalance:
    """The native aux-loss-free balancing on an HF V4 model: count each router's selections (forward
    hooks), all-reduce the counts over ranks, and move ``e_score_correction_bias`` by ``rate * sign``."""

    def __init__(self, model: torch.nn.Module, rate: float):
        self.rate = rate
        self.blocks = [m for m in model.modules() if type(m).__name__ == "DeepseekV4SparseMoeBlock"]
        self.loads = [torch.zeros(b.gate.num_experts, dtype=torch.float64) for b in self.blocks]
        for block, load in zip(self.blocks, self.loads):
            block.gate.register_forward_hook(self._hook(load))
            if not block.is_hash:  # keep the selection bias in fp32, as natively (bf16 engines cast buffers)
                block.gate.e_score_correction_bias = block.gate.e_score_correction_bias.float()

    @staticmethod
    def _hook(load: torch.Tensor):
        def hook(module, args, out):
            if module.training:
                idx = out[2].reshape(-1).detach().cpu()
                load.add_(torch.bincount(idx, minlength=load.numel()).to(load.dtype))
        return hook

    @torch.no_grad()
    def update(self) -> dict[str, float]:
        if not self.blocks:
            return {}
        loads = torch.stack(self.loads)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(loads)
        stats = {}
        for i, (block, load) in enumerate(zip(self.blocks, loads)):
            total = load.sum()
            s = {"max_over_mean": 0.0, "entropy": 0.0}
            if total > 0:
                mean, p = load.mean(), load / total
                s = {"max_over_mean": float(load.max() / mean),
                     "entropy": float(-(p * p.clamp_min(1e-12).log()).sum() / math.log(max(2, len(load))))}
                if not block.is_hash:
                    bias = block.gate.e_score_correction_bias
                    bias += (self.rate * torch.sign(mean - load)).to(bias.device, bias.dtype)
            stats.update({f"moe{i}_{k}": v for k, v in s.items()})
        self.discard()
        return stats

    def discard(self) -> None:
        """Forget the selections counted since the last update (a skipped step's)."""
        for load in self.loads:
            load.zero_()


# ----------------------------------------------------------------------------------------- helpers
def _step_dirs(ckpt_dir: Path) -> list[Path]:
    return sorted(p for p in ckpt_dir.glob("step_*") if p.is_dir())


def _retain(ckpt_dir: Path, keep_last: int) -> None:
    latest = (ckpt_dir / "latest").read_text().strip() if (ckpt_dir / "latest").is_file() else None
    for old in _step_dirs(ckpt_dir)[:-keep_last]:
        if old.name != latest:
            shutil.rmtree(old, ignore_errors=True)


def export_from_checkpoint(engine, ckpt_dir: Path, tag: str, cfg: ModelArgs | None, tokenizer_dir: str | None,
                           export_dir: str, extra: dict | None) -> Path:
    """Rank 0: fp32 master weights from the ZeRO checkpoint (any stage, offloaded or not) + the live
    (replicated) buffers -> the native model -> ``trainer.export.export`` (or ``save_pretrained``)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    state = get_fp32_state_dict_from_zero_checkpoint(str(ckpt_dir), tag=tag)
    state = {k: v.detach().float().contiguous() for k, v in state.items()}
    state.update({k: v.detach().clone() for k, v in engine.module.named_buffers()})
    if cfg is None:  # a generic AutoModelForCausalLM
        engine.module.save_pretrained(export_dir, state_dict=state)
        if tokenizer_dir:
            for name in TOKENIZER_FILES:
                if (Path(tokenizer_dir) / name).is_file():
                    shutil.copy2(Path(tokenizer_dir) / name, Path(export_dir) / name)
        return Path(export_dir)
    native = Transformer(cfg, engine.module.config.vocab_size)
    wanted = set(to_hf(native.state_dict(), cfg))
    native.load_state_dict(from_hf({k: v for k, v in state.items() if k in wanted}, cfg))
    return export(native, tokenizer_dir or export_dir, export_dir, extra)


# ------------------------------------------------------------------------------------------- engine
class DeepSpeedEngine(Engine):
    """The HF model under ``deepspeed.initialize`` (the process group is up: ``deepspeed.init_distributed``).
    ``engine.step()`` after every micro-batch applies clipping, AdamW and the lr schedule at the step's
    boundary; the checkpoint of the last step saved is :attr:`last_tag`."""

    def __init__(self, model: torch.nn.Module, native_cfg: ModelArgs | None, cfg: StageTrainConfig,
                 ckpt_dir: str | Path, device_peak: float | None = None):
        import deepspeed

        self.cfg, self.ckpt_dir = cfg, Path(ckpt_dir)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        apply_activation_checkpointing(model, cfg.activation_checkpointing)
        self.balance = ExpertBalance(model, native_cfg.bias_update_rate if native_cfg else 0.0)
        if cfg.compile:
            _freeze_untrained_indexers(model)
        # fused where the native loop's AdamW is (plain parameters on one device type): the same optimizer kernel
        opt = torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8,
                                fused=adamw_fused(model.parameters()) or None)
        self.lr_schedule = LrSchedule(cfg)
        [sched] = schedulers([opt], self.lr_schedule)
        self.engine, _, _, self.sched = deepspeed.initialize(model=model, optimizer=opt, lr_scheduler=sched,
                                                             config=ds_config(cfg, self.world))
        self.scheds = [self.sched]  # fit re-reads the lr through it (resume, the decay trigger)
        if cfg.compile:  # train.<stage>.compile: transformers' model compiled whole by DeepSpeed, static shapes,
            # with the native engine's fallback (a graph inductor fails on runs eagerly)
            self.engine.compile(backend=inductor_or_eager, compile_kwargs={"dynamic": False})
        self.device = self.engine.device
        if native_cfg is not None:
            self.flops_per_token = training_flops_per_token(native_cfg, model.config.vocab_size, cfg.seq_len)
        else:  # 6 N for a generic model
            self.flops_per_token = 6.0 * sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel()
                                             for p in model.parameters())
        per_rank_peak = float(device_peak) if device_peak else peak_flops(self.device.type, dtype=cfg.dtype)
        self.peak = per_rank_peak * self.world  # MFU of the whole job: all ranks' peak together
        self.ckpt_dir.mkdir(parents=True, exist_ok=True)
        self.per_rank = cfg.batch_size // self.world
        self.micro = self.per_rank // cfg.grad_accum
        self.last_tag: str | None = None

    def restore(self) -> dict | None:
        state = None
        if (self.ckpt_dir / "latest").is_file():
            path, state = self.engine.load_checkpoint(str(self.ckpt_dir))
            if path is None:
                raise RuntimeError(f"{self.ckpt_dir}: could not load the checkpoint named by 'latest'")
        self.engine.train()
        return state

    def forward_backward(self, data: Packed, idx: torch.Tensor) -> torch.Tensor:
        gas, micro, engine, device = self.cfg.grad_accum, self.micro, self.engine, self.device
        n_all = int((data.labels[idx] != IGNORE).sum())  # the whole step batch: the native normaliser
        mine = idx[self.rank * self.per_rank:(self.rank + 1) * self.per_rank]
        local = torch.zeros(3, dtype=torch.float64)  # loss sum, label tokens, tokens
        for i in range(gas):
            b = data.batch(mine[i * micro:(i + 1) * micro])
            logits = engine(input_ids=b["input_ids"].to(device), use_cache=False).logits
            labels = b["labels"].to(device)
            loss_sum = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.view(-1),
                                       ignore_index=IGNORE, reduction="sum")
            # DeepSpeed divides by grad_accum and averages over ranks: undo both, so the gradient is
            # d(sum of all ranks' token losses) / n_all, as in the native engines
            engine.backward(loss_sum * (self.world * gas / max(1, n_all)))
            engine.step()
            local += torch.tensor([float(loss_sum.detach()), float((labels != IGNORE).sum()),
                                   float((b["doc_ids"] >= 0).sum())], dtype=torch.float64)
        return local

    def clip_grad_norm(self) -> float:
        gn = self.engine.get_global_grad_norm()  # clipped inside engine.step() (``gradient_clipping``)
        return float(gn) if gn is not None else float("nan")

    def all_reduce(self, local: torch.Tensor) -> StepSums:
        if self.world > 1:
            dist.all_reduce(local)
        return StepSums(float(local[0]), int(local[1]), seen=int(local[2]))

    def skip(self) -> None:
        self.balance.discard()

    def update(self) -> dict[str, float]:
        return self.balance.update()

    def schedule(self) -> None:
        pass  # engine.step() advanced it

    def lr(self) -> float:
        return self.sched.get_last_lr()[0]

    def save(self, step: int, state: dict, async_save: bool) -> None:
        self.last_tag = f"step_{step:08d}"
        self.engine.save_checkpoint(str(self.ckpt_dir), tag=self.last_tag, client_state={"step": step, **state})
        dist.barrier()
        if self.rank == 0:
            _retain(self.ckpt_dir, self.cfg.keep_last)
        dist.barrier()

    def latest(self) -> str:
        latest = self.ckpt_dir / "latest"
        tag = latest.read_text().strip() if latest.is_file() else ""
        return str(self.ckpt_dir / tag) if tag else ""
