"""Evaluate flow: Pass@1 of a trained model directory on a curated held-out split."""

from __future__ import annotations

from pathlib import Path

from prefect import flow

from flows.common import FlowRecorder
from tasks.evaluate import benchmark_task, evaluate_task
from trex.core.config import load_config
from trex.core.refs import ref_of


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


@flow(name="evaluate-benchmarks", log_prints=True)
def benchmarks_flow(model: str, benchmarks: list[str], backend: str = "native", base_url: str | None = None,
                    data: str | None = None, config: str | None = "configs/tiny.yaml",
                    overrides: list[str] | None = None) -> dict:
    """Pass@1 of a model (a T-Rex stage directory, an HF directory, or a served model name with ``base_url``)
    on public benchmarks; one resumable task per benchmark."""
    cfg = load_config(config, overrides or [])
    ref = ref_of(model, "model") if backend == "native" and (Path(model) / "manifest.json").is_file() else {"path": model}
    opts = {"base_url": base_url} if base_url else {}
    rec = FlowRecorder(cfg, "evaluate-benchmarks")
    metrics = {}
    try:
        for name in benchmarks:
            res = rec.stage(f"evaluate-{name}", benchmark_task, eval_cfg=cfg.eval.model_dump(mode="json"), model=ref,
                            backend=backend, backend_opts=opts, benchmark=name, data=data)
            metrics[f"pass_at_1_{name}"] = res["summary"]["pass@1"]
    except BaseException:
        rec.finish(failed=True)
        raise
    rec.finish(metrics)
    return metrics
