"""One entry point for a training stage (CPT or SFT; :func:`train_rl` for RL): :func:`train_stage` picks the engine, trains with resume
and writes ``out_dir/checkpoints/`` (with ``model.json``, the architecture an offline conversion needs) and
the export ``out_dir/export/`` (transformers' layout, float32: ``trainer.export``).

- ``train.engine: deepspeed``: transformers' model + DeepSpeed ZeRO in a ``torchrun`` job of
  ``train.nproc`` processes (``trainer/engines/deepspeed_rank.py``, docs/baseline.md);
- ``parallel.nproc_per_node x nnodes > 1``: the native distributed engine in a ``torchrun`` job
  (``trainer/engines/distributed_rank.py``, docs/parallel.md);
- otherwise the single-process engine, here (``trainer/engines/single.py``).

A job's metrics come back as rank 0's ``TREX_METRICS`` lines and reach ``on_log`` like the in-process
engine's. The native job's export is written here, offline, from its final DCP checkpoint, tensor by tensor
(``trainer.export.export_checkpoint``): no rank gathers the model.

``init_dir`` may be any checkpoint ``trainer.hub`` reads (the published hub layout, transformers', a T-Rex
export): the architecture then comes from its ``config.json`` (:func:`resolve_model`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from trainer.checkpoint import seed_rngs
from trainer.core import LogFn, TrainResult
from trainer.data import Packed, save_packed
from trainer.engines import single
from trainer.export import build_model, export, export_checkpoint, load_export
from trainer.hub.dcp_source import LORA_CARD, DcpSource, write_base_card, write_model_card
from trainer.hub.reader import CheckpointError, CheckpointReader, check_args
from trainer.models.deepseek_v4.args import ModelArgs
from trainer.models.deepseek_v4.model import Transformer
from trainer.hub.frozen_base import is_quantised, load_frozen_base
from trainer.lora import LoRAError, apply_lora, bf16_base, save_adapter
from trainer.rl import GRPOObjective, policy_parameters
from trainer.rollout import RewardFn, RLPrompt, RolloutSource
from trainer.torchrun import JobSpec, launch, metrics_callback, train_result
from trex.core.config import LoRAConfig, ParallelConfig, RLConfig, StageTrainConfig


ADAPTER_DIR = "adapter"  # a LoRA stage's PEFT adapter, beside its (merged) export


def model_size(model_args: ModelArgs, vocab_size: int) -> dict[str, int]:
    """Total, activated and MTP parameter counts (``Transformer.num_params``), on the meta device."""
    with torch.device("meta"):
        return Transformer(model_args, vocab_size).num_params()


def resolve_model(model_args: ModelArgs, init_dir: str | None, vocab_size: int) -> tuple[ModelArgs, int]:
    """The architecture and vocabulary to train: ``model_args`` from scratch; from ``init_dir``, its
    ``config.json`` (the keys ``model_args`` set must agree) and its vocabulary, which must hold the tokenizer's
    ``vocab_size`` ids (a checkpoint's embedding may be padded beyond them)."""
    if init_dir is None:
        return model_args, vocab_size
    with CheckpointReader(init_dir) as reader:
        args = check_args(reader, model_args)
        if vocab_size > reader.vocab_size:
            raise CheckpointError(f"{reader.root / 'config.json'}: vocab_size {reader.vocab_size} is smaller than the "
                                  f"tokenizer's {vocab_size} tokens")
        return args, reader.vocab_size


def train_stage(stage: str, model_args: ModelArgs, train_cfg: StageTrainConfig, parallel_cfg: ParallelConfig | None,
                seed: int, data: Packed, out_dir: str | Path, tokenizer_dir: str, vocab_size: int,
                init_dir: str | None = None, on_log: LogFn | None = None,
                on_step: Callable[[int], None] | None = None, export_extra: dict | None = None,
                job_dir: str | Path | None = None, env: dict | None = None,
                on_line: Callable[[str], None] | None = print) -> TrainResult:
    """Train ``stage`` from ``init_dir`` (an export) or from the seed's initial weights, export, and return
    the result with ``.model``: the trained model (in-process) or the export loaded back. ``export_extra``:
    more keys for the export's config.json (beside ``trex_stage``, ``trex_steps`` and, for a job,
    ``trex_engine``). A job's own files (spec, packed rows) go to ``job_dir``, by default ``out_dir/parallel`` (the
    native job) or ``out_dir/deepspeed`` (the DeepSpeed job). The train task puts them outside the stage
    directory: ``spec.json`` names absolute paths, and the stage's content hash must not depend on where it
    was written."""
    out = Path(out_dir)
    parallel_cfg = parallel_cfg or ParallelConfig()
    lora = train_cfg.lora
    quantised = bool(lora.rank and init_dir is not None and lora.base == "auto" and is_quantised(init_dir))  # QLoRA
    if lora.rank and train_cfg.engine == "deepspeed":
        raise LoRAError(f"train.{stage}.lora runs on the native engines (not {train_cfg.engine})")
    if lora.rank and parallel_cfg.world_size > 1:
        if parallel_cfg.tp > 1 and parallel_cfg.sequence_parallel:
            raise LoRAError(f"train.{stage}.lora with parallel.sequence_parallel is not supported (a row-parallel "
                            f"adapter would have to join the reduce-scatter); set parallel.sequence_parallel: false")
        if parallel_cfg.tp > 1 and quantised:
            raise LoRAError(f"train.{stage}.lora.base: auto (QLoRA) with parallel.tp={parallel_cfg.tp} is not "
                            f"supported (the quantised blocks are not split); use tp=1 with ep / pp, or base: fp32")
    if lora.rank:
        train_cfg = train_cfg.model_copy(update={"lr": lora.lr or train_cfg.lr})  # (the adapters' own)
    model_args, vocab_size = resolve_model(model_args, init_dir, vocab_size)
    write_model_card(out / "checkpoints", model_args, vocab_size, tokenizer_dir)
    if lora.rank:  # the adapters' rank and alpha, for an offline export / merge of the DCP checkpoint
        (out / "checkpoints" / LORA_CARD).write_text(lora.model_dump_json(indent=2))
    if quantised:  # QLoRA: the checkpoints hold the adapters; the frozen base is init_dir, named beside them
        write_base_card(out / "checkpoints", init_dir)
    extra = {"trex_stage": stage, **(export_extra or {})}  # + trex_steps: the steps trained, at export
    if train_cfg.engine == "deepspeed":
        job = Path(job_dir) if job_dir else out / "deepspeed"
        return _job(model_args, train_cfg, ParallelConfig(), seed, data, out, job, train_cfg.nproc,
                    tokenizer_dir, vocab_size, init_dir, on_log, on_step, {**extra, "trex_engine": "deepspeed"},
                    env, on_line)
    if parallel_cfg.world_size > 1:
        job = Path(job_dir) if job_dir else out / "parallel"
        return _job(model_args, train_cfg, parallel_cfg, seed, data, out, job, parallel_cfg.nproc_per_node,
                    tokenizer_dir, vocab_size, init_dir, on_log, on_step,
                    {**extra, "trex_engine": "native-parallel"}, env, on_line)
    seed_rngs(seed)
    if quantised:  # QLoRA: the published FP8 / MXFP4 weights stay quantised, dequantised per use
        model = load_frozen_base(init_dir, model_args)
    else:
        model = build_model(model_args, vocab_size, seed) if init_dir is None else load_export(init_dir, model_args)
    if lora.rank:  # adapters on the frozen model; only they train, at their own learning rate
        apply_lora(model, lora, seed)
        if lora.base == "bf16":
            bf16_base(model)
        train_cfg = train_cfg.model_copy(update={"lr": lora.lr or train_cfg.lr})
        extra = {**extra, "trex_lora": {"rank": lora.rank, "alpha": lora.alpha, "targets": list(lora.targets),
                                        "base": "quantised" if quantised else lora.base}}
    result = single.train(model, data, train_cfg, out / "checkpoints", seed, on_log=on_log, on_step=on_step)
    export(model, tokenizer_dir, out / "export", {**extra, "trex_steps": result.steps})  # adapters merged
    if lora.rank:
        save_adapter(model, lora, out / ADAPTER_DIR, str(Path(init_dir).resolve()) if init_dir else None)
    result.model = model
    return result


def _job(model_args, train_cfg, parallel_cfg, seed, data, out: Path, job: Path, nproc: int, tokenizer_dir,
         vocab_size, init_dir, on_log, on_step, extra: dict, env, on_line) -> TrainResult:
    """A ``torchrun`` job of ``nproc`` ranks per node: the packed rows and the spec in ``job``."""
    spec = JobSpec(model=model_args, vocab_size=vocab_size, train=train_cfg, parallel=parallel_cfg, seed=seed,
                   data=str(save_packed(data, job / "packed.pt")), ckpt_dir=str(out / "checkpoints"),
                   export_dir=str(out / "export"), tokenizer_dir=tokenizer_dir, init_dir=init_dir,
                   export_extra=extra)
    r = launch(spec, job, nproc, on_metrics=metrics_callback(on_log, on_step), on_line=on_line, env=env,
               nnodes=parallel_cfg.nnodes, rdzv_endpoint=parallel_cfg.rdzv_endpoint)
    result = train_result(r)
    if train_cfg.engine == "native" and result.finished:
        export_checkpoint(out / "checkpoints", tokenizer_dir, out / "export", {**extra, "trex_steps": result.steps})
        if train_cfg.lora.rank:  # the adapter from the final checkpoint (small: read whole)
            state, conf = DcpSource(out / "checkpoints").lora()
            save_adapter(state, LoRAConfig(**conf), out / ADAPTER_DIR,
                         str(Path(init_dir).resolve()) if init_dir else None)
    result.model = load_export(out / "export")
    return result


def train_rl(cfg: RLConfig, seed: int, prompts: list[RLPrompt], reward: RewardFn, out_dir: str | Path,
             tokenizer_dir: str, init_dir: str, end_ids: set[int], pad_id: int, decode: Callable[[list[int]], str],
             on_log: LogFn | None = None, on_step: Callable[[int], None] | None = None,
             stop_after: int | None = None) -> TrainResult:
    """The RL stage: the policy loaded from ``init_dir`` (the SFT export) trained with the GRPO objective
    (:class:`trainer.rl.GRPOObjective`) on rollouts (:class:`trainer.rollout.RolloutSource`) by the single-process
    engine's step -- the training core of CPT and SFT, its checkpoints holding the rollout in progress -- then
    exported like any stage. ``reward`` is the task's (the attested sandbox); with ``cfg.kl_beta > 0`` a frozen copy
    of the initial policy is the KL reference."""
    out = Path(out_dir)
    seed_rngs(seed)
    model = load_export(init_dir)
    policy_parameters(model)
    write_model_card(out / "checkpoints", model.cfg, model.vocab_size, tokenizer_dir)
    ref = None
    if cfg.kl_beta > 0:
        ref = load_export(init_dir)
        ref.requires_grad_(False)
    sampler = vllm_sampler(model, cfg, out / "rollout_policy", tokenizer_dir, end_ids) \
        if cfg.rollout_backend == "vllm" else None
    source = RolloutSource(model, prompts, reward, cfg, end_ids, pad_id, decode, seed, ref, sampler)
    result = single.train(model, None, cfg, out / "checkpoints", seed, on_log=on_log, on_step=on_step,
                          stop_after=stop_after, objective=GRPOObjective(cfg), source=source)
    export(model, tokenizer_dir, out / "export", {"trex_stage": "rl", "trex_steps": result.steps})
    result.model = model
    return result


def vllm_sampler(model: Transformer, cfg: RLConfig, policy_dir: Path, tokenizer_dir: str, end_ids: set[int]):
    """``train.rl.rollout_backend: vllm``: the initial policy written in the published bf16 layout to
    ``policy_dir`` (what the engine loads), then an engine that receives the policy's weights in that layout before
    each rollout (:class:`trainer.sampler.VLLMSampler`)."""
    from trainer.hub.reader import BF16
    from trainer.hub.writer import hub_stream
    from trainer.sampler import VLLMSampler

    def stream(m):
        return hub_stream(((k, v.detach()) for k, v in m.state_dict().items()), m.cfg, "hub-bf16", BF16)

    export(model, tokenizer_dir, policy_dir, {"trex_stage": "rl-rollout-policy"}, to="hub-bf16", scheme=BF16)
    v = cfg.vllm
    return VLLMSampler(policy_dir, end_ids, stream, model.cfg.max_seq_len, v.gpu_memory_utilization,
                       v.tensor_parallel_size, v.dtype, v.sync_chunk_mb, v.engine_opts)
