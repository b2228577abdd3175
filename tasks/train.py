"""Train task (CPT or SFT): pack the data, train with resume (``trainer.entry``), export an HF-style directory.

Output (a ``model`` reference): ``checkpoints/`` (DCP steps + ``latest``) and ``export/``
(safetensors + config.json + tokenizer). The directory is keyed by the inputs and never wiped, so
an interrupted run resumes from its newest complete checkpoint.
"""

from __future__ import annotations

import time
import warnings
from pathlib import Path

import datasets
from prefect import task

from tasks.common import TASK_OPTIONS, StageContext, log_data_split, plain, stage_dir, stage_key, stage_result
from tasks.plots import plot_dir, publish_plot
from tasks.progress import stage_progress
from trainer import allocator
from trainer.data import cpt_documents, pack
from trainer.entry import model_size, resolve_model, train_stage
from trainer.models.deepseek_v4.args import ModelArgs
from trainer.models.deepseek_v4.training import evaluate_loss
from trainer.tokenizer import ChatTokenizer
from trex.core.config import ParallelConfig, StageTrainConfig
from trex.core.refs import MANIFEST, read_manifest, write_manifest
from trex.tracking.plots import loss_curve
from trex.tracking.runs import start_run


def _load_docs(stage: str, data_dir: Path, tok, seq_len: int, split: str | None = None):
    if stage == "cpt":
        rows = datasets.load_from_disk(str(data_dir / (split or "cpt"))).to_list()
        return cpt_documents(tok, [r["text"] for r in rows], seq_len)
    rows = datasets.load_from_disk(str(data_dir / (split or "sft"))).to_list()
    return [tok.encode_chat(r["messages"]) for r in rows]


def _validation_loss(model, data_dir: Path, tok, train: StageTrainConfig) -> float | None:
    """The SFT model's mean token loss on the ``sft_val`` split; None, with one warning naming the data directory,
    where there is nothing to score: the split is empty (``sft.val_fraction: 0``, too few samples) or absent, or
    ``seq_len`` truncates away every label of its rows."""
    split = data_dir / "sft_val"
    docs = _load_docs("sft", data_dir, tok, train.seq_len, "sft_val") if split.is_dir() else []
    loss = evaluate_loss(model, pack(docs, train.seq_len, tok.pad_id, train.packing))
    if loss is None:
        if not split.is_dir():
            why = "is missing"
        elif not docs:
            why = "is empty"
        else:
            why = f"has no label token within seq_len={train.seq_len} in its {len(docs)} rows"
        warnings.warn(f"SFT: the validation split sft_val {why} (data directory {data_dir}): no val_loss is reported",
                      RuntimeWarning, stacklevel=2)
    return loss


def _allocator(train: StageTrainConfig, parallel: ParallelConfig | None) -> str:
    """The allocator the stage trains with: this process's, or the one ``torchrun.launch`` gives a job."""
    if train.engine == "deepspeed" or (parallel is not None and parallel.world_size > 1):
        return allocator.for_jobs()
    return allocator.in_use()


@task(name="train", **{**TASK_OPTIONS, "cache_policy": TASK_OPTIONS["cache_policy"] - "parallel"})
def train_task(stage: str, model: ModelArgs, train: StageTrainConfig, seed: int, data_ref: dict, tok_ref: dict,
               init_ref: dict | None, ctx: StageContext, parallel: ParallelConfig | None = None) -> dict:
    """``parallel`` (the layout) is not part of the cache key: every layout computes the same model, and a
    stage re-run under another layout resumes from the same checkpoints (DCP reshards them)."""
    t0 = time.perf_counter()
    read_manifest(data_ref["path"], "data")
    read_manifest(tok_ref["path"], "tokenizer")
    if init_ref is not None:
        read_manifest(init_ref["path"], "model")
    key = stage_key(stage=stage, model=model, train=train, seed=seed, data=data_ref["hash"], tok=tok_ref["hash"],
                    init=init_ref and init_ref["hash"])
    out = stage_dir(ctx, stage, key)
    out.mkdir(parents=True, exist_ok=True)
    (out / MANIFEST).unlink(missing_ok=True)
    tok = ChatTokenizer(tok_ref["path"])
    init_dir = str(Path(init_ref["path"]) / "export") if init_ref else None
    model, vocab_size = resolve_model(model, init_dir, tok.vocab_size)  # an init checkpoint's architecture
    data = pack(_load_docs(stage, Path(data_ref["path"]), tok, train.seq_len), train.seq_len, tok.pad_id,
                train.packing)

    run = start_run(ctx.tracking, stage, ctx.parent_run_id, {"stage": stage}, resume_key=f"{stage}:{key}")
    params = model_size(model, vocab_size)
    run.params({"model": plain(model), "train": plain(train), "seed": seed, "data_hash": data_ref["hash"],
                "tokenizer_hash": tok_ref["hash"], "init": init_ref["path"] if init_ref else "scratch",
                "params_total": params["total"], "params_active": params["active"],
                "cpu_allocator": _allocator(train, parallel)})
    run.metrics({f"data_{k}": v for k, v in data.stats.items()})
    log_data_split(run, data_ref, "cpt" if stage == "cpt" else "sft", "training")
    if stage == "sft" and (Path(data_ref["path"]) / "sft_val").is_dir():
        log_data_split(run, data_ref, "sft_val", "validation")
    history: dict[str, list[tuple[int, float]]] = {"loss": [], "mtp_loss": []}

    def on_log(step: int, m: dict) -> None:
        run.metrics(m, step)
        for k in history:
            if k in m:
                history[k].append((step, float(m[k])))

    with stage_progress(stage) as progress, run.system_metrics(ctx.tracking.get("system_metrics", True)):
        # in this process, or a torchrun job (native layouts, DeepSpeed) whose rank 0's metrics reach on_log
        result = train_stage(stage, model, train, parallel, seed, data, out, tok_ref["path"], vocab_size,
                             init_dir=init_dir,
                             on_log=on_log, on_step=lambda step: progress("steps", step, train.steps),
                             job_dir=Path(ctx.output_dir) / "jobs" / f"{stage}-{out.name}")
        run.metrics(result.extra)  # a job's peak memory per rank (max) and world size
        if result.finished:  # a decay the loss started ended the stage before train.steps: the bar ends there
            progress("steps", result.steps, result.steps)
    summary = {"steps": result.steps, "decay_triggered_at": result.decay_triggered_at,
               "final_loss": result.final_loss, "tokens_per_s": result.tokens_per_s,
               "mfu": result.mfu, "resumed_from": result.resumed_from, "skipped_steps": result.skipped_steps,
               **params}
    if stage == "sft":
        val_loss = _validation_loss(result.model, Path(data_ref["path"]), tok, train)
        if val_loss is not None:  # no validation tokens: no val_loss at all (summary, MLflow, the flow's table)
            summary["val_loss"] = val_loss
    for k in history:  # a resumed run's curve includes the steps logged before the crash
        stored = run.metric_history(k)
        if stored and len(stored) >= len(history[k]):
            history[k] = stored
    if history["loss"]:
        png = loss_curve({k: v for k, v in history.items() if v}, plot_dir(ctx, out) / f"loss_{stage}.png",
                         f"{stage.upper()} loss")
        publish_plot(run, png, f"trex-loss-{stage}", f"{stage.upper()} training loss")
    ref = write_manifest(out, "model", {"stage": stage, "summary": summary, "packing": data.stats,
                                        "inputs": {"data": data_ref, "tokenizer": tok_ref, "init": init_ref}})
    run.metrics({k: v for k, v in summary.items() if isinstance(v, (int, float)) and v is not None})
    run.tags({"content_hash": ref["hash"], "output_dir": ref["path"], "checkpoint": result.checkpoint})
    run.finish()
    return stage_result(ref, summary, t0, run.run_id)
