"""The native parallel engine as a ``torchrun`` job: the per-rank entry point and the Prefect task's helper.

Every rank (``python -m trainer.parallel.launch --spec spec.json`` under torchrun): start the process group
(backend from the device: gloo / NCCL / HCCL, with ``parallel.timeout_s`` as the collective timeout), build
the same model from the seed (or the ``init_dir`` export), train under the configured layout with resume
from the newest complete checkpoint, print rank 0's metrics as ``TREX_METRICS`` lines, gather the weights
and let rank 0 write the HF export, then print ``TREX_RESULT``. Any exception ends this rank at once with
a non-zero status (the others may be blocked in a collective; torchrun stops them).

If ``MLFLOW_RUN_ID`` and ``MLFLOW_TRACKING_URI`` are set and the spec asks for ``log_direct`` (multi-node
jobs whose rank 0 is not on the launching node), rank 0 logs into that MLflow run itself.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Callable

from trainer.launch import (
    METRICS_PREFIX,
    RESULT_PREFIX,
    MetricsFn,
    emit,
    launch,
    metrics_callback,
    peak_memory_mb,
    run_rank,
    train_result,
)


def _direct_logger() -> Callable[[int, dict], None] | None:
    if not (os.environ.get("MLFLOW_RUN_ID") and os.environ.get("MLFLOW_TRACKING_URI")):
        return None
    import mlflow

    client, run_id = mlflow.MlflowClient(), os.environ["MLFLOW_RUN_ID"]
    return lambda step, m: [client.log_metric(run_id, k, float(v), step=step) for k, v in m.items()]


def run(spec: dict) -> dict:
    import torch
    import torch.distributed as dist

    from trainer.data import load_packed
    from trainer.export import build_model, export, load_export
    from trainer.models.deepseek_v4.args import ModelArgs
    from trainer.parallel.dims import init_distributed
    from trainer.parallel.engine import Layout, gather_full_state, train_parallel
    from trex.core.config import ParallelConfig, StageTrainConfig

    pc = ParallelConfig(**spec["parallel"])
    device = init_distributed(pc.backend, pc.timeout_s)
    rank = dist.get_rank()
    mcfg, tcfg = ModelArgs(**spec["model"]), StageTrainConfig(**spec["train"])
    torch.manual_seed(spec["seed"])
    model = build_model(mcfg, spec["vocab_size"], spec["seed"])
    if spec.get("init_dir"):
        model.load_state_dict(load_export(spec["init_dir"]).state_dict())
    data = load_packed(spec["data"])
    layout = Layout.from_config(pc, dist.get_world_size())
    direct = _direct_logger() if spec.get("log_direct") else None

    def on_log(step: int, m: dict) -> None:
        emit(METRICS_PREFIX, {"step": step, **m})
        if direct:
            direct(step, m)

    result = train_parallel(model, data, tcfg, layout, spec["ckpt_dir"], spec["seed"], on_log=on_log,
                            device=device)
    full = gather_full_state(result.parts)
    if rank == 0 and spec.get("export_dir"):
        fresh = build_model(mcfg, spec["vocab_size"], spec["seed"])
        fresh.load_state_dict(full)
        export(fresh, spec.get("tokenizer_dir"), spec["export_dir"], spec.get("export_extra") or {})
    out = {"steps": result.steps, "resumed_from": result.resumed_from, "final_loss": result.final_loss,
           "tokens_per_s": result.tokens_per_s, "checkpoint": result.checkpoint,
           "skipped_steps": result.skipped_steps, "mfu": result.mfu, "world": dist.get_world_size(),
           "layout": layout.dims.describe()}
    peak = torch.tensor([peak_memory_mb(device)], dtype=torch.float64)
    peaks = [torch.zeros_like(peak) for _ in range(dist.get_world_size())]
    dist.all_gather(peaks, peak)
    out["peak_mem_mb"] = [float(p) for p in peaks]
    if rank == 0:
        emit(RESULT_PREFIX, out)
    return out


def train_stage(model_cfg, vocab_size: int, tcfg, parallel, seed: int, data, out_dir: str | Path,
                tokenizer_dir: str | None, init_dir: str | None = None, on_log: MetricsFn | None = None,
                on_step: Callable[[int], None] | None = None, export_extra: dict | None = None,
                on_line: Callable[[str], None] | None = print, env: dict | None = None,
                job_dir: str | Path | None = None):
    """The Prefect train task's multi-process branch: pack file, launch torchrun, export into ``out_dir``.
    The job's own files (spec, packed rows) go to ``job_dir`` (default ``out_dir/parallel``): the task keeps
    them out of the stage directory, whose content hash must not depend on how it was trained."""
    from trainer.data import save_packed

    out = Path(out_dir)
    job = Path(job_dir) if job_dir else out / "parallel"
    spec = {"model": model_cfg.model_dump(mode="json"), "vocab_size": vocab_size,
            "train": tcfg.model_dump(mode="json"), "parallel": parallel.model_dump(mode="json"), "seed": seed,
            "data": str(save_packed(data, job / "packed.pt")), "ckpt_dir": str(out / "checkpoints"),
            "export_dir": str(out / "export"), "tokenizer_dir": tokenizer_dir, "init_dir": init_dir,
            "export_extra": export_extra or {}, "log_direct": parallel.nnodes > 1}

    r = launch(spec, job, parallel.nproc_per_node, on_metrics=metrics_callback(on_log, on_step), on_line=on_line,
               target=["-m", "trainer.parallel.launch"], env=env, nnodes=parallel.nnodes,
               rdzv_endpoint=parallel.rdzv_endpoint)
    return train_result(r)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="one rank of the native parallel engine (run under torchrun)")
    ap.add_argument("--spec", required=True)
    a = ap.parse_args(argv)
    return run_rank(lambda: run(json.loads(Path(a.spec).read_text())))


if __name__ == "__main__":
    sys.exit(main())
