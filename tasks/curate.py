"""Curate tasks: the OR datasets (a ``data`` reference).

Without LLM stages, ``curate`` builds and assembles in one call (``ordata.curate.curate``). With them
(``data.llm``), ``curate-instances`` writes the verified instances (an ``instances`` reference), the LLM stages
(``tasks/llm.py``) transform them, and ``assemble`` writes the datasets. Each logs its accounting (``in = kept +
rejected + quarantined`` per stage) to MLflow and as a Prefect table artifact.
"""

from __future__ import annotations

import time

from prefect import task
from prefect.artifacts import create_table_artifact

from ordata.curate import assemble_stage, build_stage, curate
from tasks.common import TASK_OPTIONS, StageContext, plain, stage_dir, stage_key, stage_result
from tasks.progress import stage_progress
from trex.core.config import DataConfig
from trex.core.refs import fresh_dir, read_manifest, write_manifest
from trex.tracking.runs import start_run

USAGE_METRICS = ("calls", "cache_hits", "answered", "failed", "refused_budget", "http_requests", "retries",
                 "prompt_tokens", "completion_tokens", "cached_completion_tokens", "seconds")


def accounting_table(accounting: dict) -> list[dict]:
    return [{"stage": stage, "in": acc["in"], "kept": acc["kept"], "rejected": sum(acc.get("rejected", {}).values()),
             "quarantined": acc["quarantined"],
             "reasons": ", ".join(f"{k}={v}" for k, v in acc.get("rejected", {}).items())}
            for stage, acc in accounting.items()]


def usage_table(llm: dict) -> list[dict]:
    """One row per LLM stage and endpoint: requests, retries, errors, cache hits, tokens."""
    rows = []
    for stage, entry in llm.items():
        u = entry["usage"]
        rows.append({"stage": stage, "endpoint": "(all)", **{k: u[k] for k in USAGE_METRICS}})
        rows += [{"stage": stage, "endpoint": name, **e} for name, e in u["endpoints"].items()]
    return rows


def log_accounting(run, accounting: dict, prefix: str = "") -> None:
    for stage, acc in accounting.items():
        run.metrics({f"{prefix}{stage}_{k}": v for k, v in acc.items() if isinstance(v, int)})  # balanced: 1 / 0


def log_usage(run, llm: dict) -> None:
    """``llm_<stage>_<counter>`` metrics: answers asked for, cache hits, requests, retries, tokens, seconds."""
    for stage, entry in llm.items():
        run.metrics({f"llm_{stage}_{k}": entry["usage"][k] for k in USAGE_METRICS})


def publish(run, info: dict) -> None:
    """The curation's counts, rejections, accounting and LLM usage: MLflow metrics and Prefect table artifacts."""
    counts = info["counts"]
    run.metrics({f"count_{k}": v for k, v in counts.items() if isinstance(v, int)})
    run.metrics({f"rejected_{k}": v for k, v in info["rejection_reasons"].items()})
    log_accounting(run, info["accounting"])
    create_table_artifact(accounting_table(info["accounting"]), key="trex-curation-accounting",
                          description="in = kept + rejected + quarantined")
    if info.get("llm"):
        log_usage(run, info["llm"])
        create_table_artifact(usage_table(info["llm"]), key="trex-llm-usage",
                              description="LLM stages: answers asked for = cache hits + answered + failed + refused")


@task(name="curate", **TASK_OPTIONS)
def curate_task(data: DataConfig, ctx: StageContext) -> dict:
    t0 = time.perf_counter()
    out = fresh_dir(stage_dir(ctx, "data", stage_key(data=data)))
    run = start_run(ctx.tracking, "curate", ctx.parent_run_id, {"stage": "curate"}, resume_key=f"curate:{out.name}")
    run.params({"data": plain(data)})
    with stage_progress("curate") as progress:
        info = curate(data, out, progress)
    return _finish(run, out, info, t0)


def _finish(run, out, info: dict, t0: float) -> dict:
    ref = write_manifest(out, "data", info)
    publish(run, info)
    run.tags({"content_hash": ref["hash"], "output_dir": ref["path"]})
    run.finish()
    counts = info["counts"]
    summary = {"sft": counts["sft"], "eval": counts["eval"], "cpt": counts["cpt"], "rejected": counts["rejected"]}
    if "eval_ood" in counts:
        summary["eval_ood"] = counts["eval_ood"]
    return stage_result(ref, summary, t0, run.run_id)


@task(name="curate-instances", **TASK_OPTIONS)
def instances_task(data: DataConfig, ctx: StageContext) -> dict:
    """Generate, solve and verify the instances that the LLM stages transform (an ``instances`` reference)."""
    t0 = time.perf_counter()
    out = fresh_dir(stage_dir(ctx, "instances", stage_key(data=data)))
    run = start_run(ctx.tracking, "curate-instances", ctx.parent_run_id, {"stage": "curate-instances"},
                    resume_key=f"instances:{out.name}")
    run.params({"data": plain(data)})
    with stage_progress("curate") as progress:
        info = build_stage(data, out, progress)
    ref = write_manifest(out, "instances", info)
    log_accounting(run, info["accounting"])
    run.metrics({f"count_{k}": v for k, v in info["splits"].items()})
    run.tags({"content_hash": ref["hash"], "output_dir": ref["path"]})
    run.finish()
    return stage_result(ref, dict(info["splits"]), t0, run.run_id)


@task(name="assemble", **TASK_OPTIONS)
def assemble_task(data: DataConfig, instances_ref: dict, ctx: StageContext) -> dict:
    """The datasets from the (rewritten, distilled) instances: a ``data`` reference, logged as ``curate``."""
    t0 = time.perf_counter()
    read_manifest(instances_ref["path"], "instances")
    out = fresh_dir(stage_dir(ctx, "data", stage_key(data=data, instances=instances_ref["hash"])))
    run = start_run(ctx.tracking, "curate", ctx.parent_run_id, {"stage": "curate"}, resume_key=f"curate:{out.name}")
    run.params({"data": plain(data), "instances_hash": instances_ref["hash"]})
    return _finish(run, out, assemble_stage(data, instances_ref["path"], out), t0)
