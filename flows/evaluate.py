"""Evaluate flows: Pass@1 of a trained model directory on a curated held-out split, and on public benchmarks.

The configuration: ``cfg`` (parsed by the CLI) or ``config`` + ``overrides`` (a deployment run), see
``flows/common.py: resolve_config``.
"""

from __future__ import annotations

from pathlib import Path

from prefect import flow

from flows.common import FlowRecorder, resolve_config
from tasks.evaluate import benchmark_task, evaluate_task
from trex.core.config import TrexConfig
from trex.core.refs import ref_of


@flow(name="evaluate", log_prints=True)
def evaluate_flow(model_dir: str, data_dir: str, config: str | None = "configs/tiny.yaml",
                  overrides: list[str] | None = None, cfg: TrexConfig | None = None) -> dict:
    cfg = resolve_config(cfg, config, overrides)
    model, data = ref_of(model_dir, "model"), ref_of(data_dir, "data")
    with FlowRecorder(cfg, "evaluate", sandbox=("eval",)) as rec:
        res = rec.stage("evaluate-model", evaluate_task, eval_cfg=cfg.eval, model_ref=model, data_ref=data,
                        label="model")
        rec.metrics["pass_at_1"] = res["summary"]["pass@1"]
    return res["summary"]


@flow(name="evaluate-benchmarks", log_prints=True)
def benchmarks_flow(model: str, benchmarks: list[str], backend: str = "native", base_url: str | None = None,
                    data: str | None = None, config: str | None = "configs/tiny.yaml",
                    overrides: list[str] | None = None, cfg: TrexConfig | None = None) -> dict:
    """Pass@1 of a model (a T-Rex stage directory, an HF directory, or a served model name with ``base_url``)
    on public benchmarks; one resumable task per benchmark."""
    cfg = resolve_config(cfg, config, overrides)
    ref = ref_of(model, "model") if backend == "native" and (Path(model) / "manifest.json").is_file() else {"path": model}
    opts = {"base_url": base_url} if base_url else {}
    with FlowRecorder(cfg, "evaluate-benchmarks", sandbox=("eval",)) as rec:
        for name in benchmarks:
            res = rec.stage(f"evaluate-{name}", benchmark_task, eval_cfg=cfg.eval, model=ref, backend=backend,
                            backend_opts=opts, benchmark=name, data=data)
            rec.metrics[f"pass_at_1_{name}"] = res["summary"]["pass@1"]
    return rec.metrics
