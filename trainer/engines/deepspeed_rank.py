"""One rank of the DeepSpeed baseline as a ``torchrun`` job (``trainer.torchrun.launch``)::

    python -m torch.distributed.run --standalone --nproc-per-node N -m trainer.engines.deepspeed_rank --spec spec.json

Start DeepSpeed's process group (its accelerator's backend), build transformers' model from the native
initial weights (or ``init_dir``), train (:class:`~trainer.engines.deepspeed.DeepSpeedEngine` under
``trainer.core.fit``) with resume from DeepSpeed's ``latest`` checkpoint, print rank 0's metrics as
``TREX_METRICS`` lines, let rank 0 export the final checkpoint's fp32 weights, then print ``TREX_RESULT``.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from trainer.checkpoint import seed_rngs
from trainer.core import fit
from trainer.data import load_packed
from trainer.engines.deepspeed import DeepSpeedEngine, build_baseline_model, export_from_checkpoint
from trainer.torchrun import JobSpec, emit_metrics, peak_memory_all, read_spec, report, run_rank


def skip_inference_shm_op() -> None:
    """Keep DeepSpeed from JIT-compiling its shared-memory all-reduce (``deepspeed_shm_comm``) when its process
    group starts. Only ``inference_all_reduce`` (AutoTP inference) uses that op; ZeRO training's collectives go
    through torch.distributed (gloo on CPU) either way, so the baseline's steps are unchanged. The C++ build
    takes ~90 s on 2 cores, paid on the first DeepSpeed run of every machine (each fresh CI machine, a user's
    first ``trex bench compare``). DeepSpeed skips the op when it is not in its table of compatible ops, as on
    non-Linux hosts; the table is recomputed per process (deepspeed==0.19.8, pinned)."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def run(spec: JobSpec) -> dict:
    import deepspeed  # picks its accelerator on import: after the launcher's DS_ACCELERATOR; seconds to import
    from deepspeed.accelerator import get_accelerator
    from deepspeed.utils import logger as ds_logger

    ds_logger.setLevel(logging.WARNING)
    skip_inference_shm_op()
    if spec.threads:
        torch.set_num_threads(spec.threads)
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    cfg = spec.train
    if cfg.optimizer != "adamw":
        raise ValueError("the deepspeed engine trains with AdamW only (Muon needs whole matrices, ZeRO shards them)")
    seed_rngs(spec.seed)
    data = load_packed(spec.data)
    if len(data) == 0:
        raise ValueError("no training sequences")
    model, native_cfg = build_baseline_model(spec.model, spec.vocab_size, spec.seed, spec.init_dir)
    engine = DeepSpeedEngine(model, native_cfg, cfg, spec.ckpt_dir, spec.device_peak)
    result = fit(engine, data, cfg, spec.seed, on_log=emit_metrics, stop_after=spec.stop_after)
    mem = peak_memory_all(engine.device)
    export_dir = None
    if spec.export_dir and result.finished:
        tag = engine.last_tag or (Path(spec.ckpt_dir) / "latest").read_text().strip()  # resumed at the end
        if dist.get_rank() == 0:
            export_dir = str(export_from_checkpoint(engine.engine, Path(spec.ckpt_dir), tag, native_cfg,
                                                    spec.tokenizer_dir, spec.export_dir,
                                                    {**spec.export_extra, "trex_steps": result.steps}))
        dist.barrier()
    return report(result, mem, export_dir=export_dir, flops_per_token=engine.flops_per_token,
                  peak_flops=engine.peak, zero_stage=cfg.zero_stage, device=engine.device.type,
                  compiled=bool(engine.engine.is_compiled))


def main(argv: list[str] | None = None) -> int:
    return run_rank(lambda: run(read_spec(argv, "one rank of the DeepSpeed baseline engine (run under torchrun)")))


if __name__ == "__main__":
    sys.exit(main())
