"""Curate task: generate, solve, verify and write the OR datasets (a ``data`` reference)."""

from __future__ import annotations

import time

from prefect import task
from prefect.artifacts import create_table_artifact

from ordata.curate import curate
from tasks.common import TASK_OPTIONS, StageContext, plain, stage_dir, stage_key, stage_result
from tasks.progress import stage_progress
from trex.core.config import DataConfig
from trex.core.refs import fresh_dir, write_manifest
from trex.tracking.runs import start_run


@task(name="curate", **TASK_OPTIONS)
def curate_task(data: DataConfig, ctx: StageContext) -> dict:
    t0 = time.perf_counter()
    out = fresh_dir(stage_dir(ctx, "data", stage_key(data=data)))
    run = start_run(ctx.tracking, "curate", ctx.parent_run_id, {"stage": "curate"}, resume_key=f"curate:{out.name}")
    run.params({"data": plain(data)})
    with stage_progress("curate") as progress:
        info = curate(data, out, progress)
    ref = write_manifest(out, "data", info)
    counts = info["counts"]
    run.metrics({f"count_{k}": v for k, v in counts.items() if isinstance(v, int)})
    run.metrics({f"rejected_{k}": v for k, v in info["rejection_reasons"].items()})
    table = []
    for stage, acc in info["accounting"].items():
        run.metrics({f"{stage}_{k}": v for k, v in acc.items() if isinstance(v, int)})
        table.append({"stage": stage, "in": acc["in"], "kept": acc["kept"], "rejected": sum(acc["rejected"].values()),
                      "quarantined": acc["quarantined"], "reasons": ", ".join(f"{k}={v}" for k, v in acc["rejected"].items())})
    create_table_artifact(table, key="trex-curation-accounting", description="in = kept + rejected + quarantined")
    run.tags({"content_hash": ref["hash"], "output_dir": ref["path"]})
    run.finish()
    summary = {"sft": counts["sft"], "eval": counts["eval"], "cpt": counts["cpt"], "rejected": counts["rejected"]}
    return stage_result(ref, summary, t0, run.run_id)
