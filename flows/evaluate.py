"""Evaluate flow: Pass@1 of a trained model directory on a curated held-out split."""

from __future__ import annotations

from prefect import flow

from flows.common import FlowRecorder
from tasks.evaluate import evaluate_task
from trex.config import load_config
from trex.refs import ref_of


@flow(name="evaluate", log_prints=True)
def evaluate_flow(model_dir: str, data_dir: str, config: str | None = "configs/tiny.yaml",
                  overrides: list[str] | None = None) -> dict:
    cfg = load_config(config, overrides or [])
    model, data = ref_of(model_dir, "model"), ref_of(data_dir, "data")
    rec = FlowRecorder(cfg, "evaluate")
    try:
        res = rec.stage("evaluate-model", evaluate_task, eval_cfg=cfg.eval.model_dump(mode="json"), model_ref=model,
                        data_ref=data, label="model")
    except BaseException:
        rec.finish(failed=True)
        raise
    rec.finish({"pass_at_1": res["summary"]["pass@1"]})
    return res["summary"]


if __name__ == "__main__":
    from trex.cli import main

    main(["evaluate"])
