"""LLM stage tasks of curation (``data.llm``): ``rewrite`` and ``distill``, each from one ``instances`` reference to
the next (``ordata/llm``). The response cache is ``data.llm.cache_dir`` (default ``<run.state_dir>/llm-cache``):
it outlives the stage directories, so a re-run stage (crashed, or re-run for another configuration) asks the
endpoints only what they never answered. Each logs its accounting, its endpoint usage (MLflow metrics
``llm_<stage>_*`` and the Prefect table artifact ``trex-llm-<stage>``) and, for ``distill``, the pass rates."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

from prefect import task
from prefect.artifacts import create_table_artifact

from ordata.llm.distill import distill_stage
from ordata.llm.rewrite import rewrite_stage
from tasks.common import TASK_OPTIONS, StageContext, plain, stage_dir, stage_key, stage_result
from tasks.curate import log_accounting, log_usage, usage_table
from tasks.progress import stage_progress
from trex.core.config import DataConfig
from trex.core.refs import fresh_dir, read_manifest, write_manifest
from trex.tracking.runs import start_run


def cache_dir(data: DataConfig, ctx: StageContext) -> Path:
    """``data.llm.cache_dir``, else ``llm-cache`` beside the stage outputs (``<run.state_dir>/llm-cache``)."""
    return Path(data.llm.cache_dir) if data.llm.cache_dir else Path(ctx.output_dir).parent / "llm-cache"


def _stage(name: str, fn: Callable, data: DataConfig, instances_ref: dict, ctx: StageContext) -> dict:
    t0 = time.perf_counter()
    read_manifest(instances_ref["path"], "instances")
    out = fresh_dir(stage_dir(ctx, name, stage_key(data=data, instances=instances_ref["hash"])))
    run = start_run(ctx.tracking, name, ctx.parent_run_id, {"stage": name}, resume_key=f"{name}:{out.name}")
    run.params({"llm": plain(data.llm), "instances_hash": instances_ref["hash"]})
    with stage_progress(name) as progress:
        info = fn(data, instances_ref["path"], out, cache_dir(data, ctx), progress)
    ref = write_manifest(out, "instances", info)
    mine = {k: v for k, v in info["accounting"].items() if k.startswith(name)}
    log_accounting(run, mine)
    log_usage(run, {name: info["llm"][name]})
    create_table_artifact(usage_table({name: info["llm"][name]}), key=f"trex-llm-{name}",
                          description=f"{name}: answers asked for = cache hits + answered + failed + refused")
    report = info["llm"][name]["report"]
    if name == "distill":
        run.metrics({"distill_pass_rate": report["overall"]["pass_rate"],
                     "distill_accept_rate": report["overall"]["accept_rate"],
                     **{f"distill_pass_rate_{cell.replace('/', '_')}": c["pass_rate"]
                        for cell, c in report["per_cell"].items()}})
        create_table_artifact([{"cell": cell, **c} for cell, c in report["per_cell"].items()],
                              key="trex-distill-pass-rates", description="family/category/representation pass rates")
    run.tags({"content_hash": ref["hash"], "output_dir": ref["path"]})
    run.finish()
    usage = info["llm"][name]["usage"]
    summary = {"kept": f"{mine[name]['kept']}/{mine[name]['in']}",
               **{f"{stage}_{k}": acc[k] for stage, acc in mine.items() for k in ("in", "kept")},
               "requests": usage["sent"], "cache_hits": usage["cache_hits"],
               "completion_tokens": usage["completion_tokens"]}
    return stage_result(ref, summary, t0, run.run_id)


@task(name="rewrite", **TASK_OPTIONS)
def rewrite_task(data: DataConfig, instances_ref: dict, ctx: StageContext) -> dict:
    return _stage("rewrite", rewrite_stage, data, instances_ref, ctx)


@task(name="distill", **TASK_OPTIONS)
def distill_task(data: DataConfig, instances_ref: dict, ctx: StageContext) -> dict:
    return _stage("distill", distill_stage, data, instances_ref, ctx)
