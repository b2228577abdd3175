"""Register task: log the final HF export as an artifact and add it to the MLflow model registry."""

from __future__ import annotations

import time
from pathlib import Path

from prefect import task

from tasks.common import StageContext, stage_result
from tasks.tracking import client, start_run
from trex.refs import read_manifest


@task(name="register")
def register_task(model_ref: dict, eval_ref: dict, registered_model: str, ctx: StageContext) -> dict:
    from mlflow.exceptions import MlflowException

    t0 = time.perf_counter()
    read_manifest(model_ref["path"], "model")
    report = read_manifest(eval_ref["path"], "eval")
    run = start_run(ctx.tracking, "register", ctx.parent_run_id, {"stage": "register"})
    if not run.active:
        return stage_result(model_ref, {"registered": False}, t0, None)
    run.metrics({"pass_at_1": report["pass@1"]})
    c = client(ctx.tracking["uri"])
    try:
        c.create_registered_model(registered_model, description="T-Rex OR-specialised MoE model")
    except MlflowException:
        pass  # already registered
    for existing in c.search_model_versions(f"name='{registered_model}'"):
        if existing.tags.get("content_hash") == model_ref["hash"]:
            run.tags({"registered_model": registered_model, "model_version": existing.version, "reused": True})
            run.finish()
            return stage_result(model_ref, {"registered_model": registered_model, "version": int(existing.version),
                                            "source": existing.source, "reused": True}, t0, run.run_id)
    run.artifact(Path(model_ref["path"]) / "export", "model")
    source = f"{c.get_run(run.run_id).info.artifact_uri}/model"
    mv = c.create_model_version(registered_model, source=source, run_id=run.run_id,
                                tags={"content_hash": model_ref["hash"], "pass_at_1": str(report["pass@1"]),
                                      "flow_run_id": str(ctx.flow_run_id)})
    run.tags({"registered_model": registered_model, "model_version": mv.version})
    run.finish()
    return stage_result(model_ref, {"registered_model": registered_model, "version": int(mv.version),
                                    "source": source}, t0, run.run_id)
