"""Register task: log the final HF export as an artifact and add it to the MLflow model registry.

The version is tagged with its lineage (``trex/tracking/registry.py``). With ``promote_if_no_champion`` (the
lifecycle), the first registered model becomes the champion; retraining decides promotion itself
(``tasks/promote.py``).
"""

from __future__ import annotations

import time
from pathlib import Path

from prefect import task

from tasks.common import StageContext, stage_result
from trex.core.refs import read_manifest
from trex.tracking.registry import champion, lineage_tags, promote, register_version, tag_version
from trex.tracking.runs import start_run


@task(name="register")
def register_task(model_ref: dict, eval_ref: dict, registered_model: str, ctx: StageContext,
                  data_ref: dict | None = None, tok_ref: dict | None = None, scores: dict | None = None,
                  promote_if_no_champion: bool = True, alias: str = "champion") -> dict:
    t0 = time.perf_counter()
    read_manifest(model_ref["path"], "model")
    report = read_manifest(eval_ref["path"], "eval")
    scores = scores if scores is not None else {"synthetic": report["pass@1"]}
    run = start_run(ctx.tracking, "register", ctx.parent_run_id, {"stage": "register"})
    if not run.active or run.offline:  # the registry needs the store now: a later retrain registers it
        run.finish()
        return stage_result(model_ref, {"registered": False}, t0, run.run_id)
    run.metrics({"pass_at_1": report["pass@1"]})
    version, source, reused = register_version(
        ctx.tracking, registered_model, run, Path(model_ref["path"]) / "export", model_ref["hash"],
        {"pass_at_1": str(report["pass@1"]), "flow_run_id": str(ctx.flow_run_id)},
        description="T-Rex OR-specialised MoE model")
    tag_version(ctx.tracking, registered_model, version, lineage_tags(model_ref, data_ref, tok_ref, scores))
    promoted = False
    if promote_if_no_champion and champion(ctx.tracking, registered_model, alias) is None:
        promote(ctx.tracking, registered_model, alias, version, "first registered model")
        promoted = True
    run.tags({"registered_model": registered_model, "model_version": version, "reused": reused,
              "promoted": promoted})
    run.finish()
    return stage_result(model_ref, {"registered_model": registered_model, "version": int(version), "source": source,
                                    "reused": reused, "champion": promoted}, t0, run.run_id)
