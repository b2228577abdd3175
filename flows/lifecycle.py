"""The whole lifecycle: curate -> tokenizer -> CPT -> SFT -> evaluate (base and SFT) -> register.

Run it with ``trex lifecycle --config configs/tiny.yaml``, ``python -m trex lifecycle ...`` or as
the ``lifecycle`` Prefect deployment. Stages exchange references only; a second run with the same
inputs reuses every finished stage from Prefect's cache.

The configuration: ``cfg`` (parsed by the CLI) or ``config`` + ``overrides`` (a deployment run), see
``flows/common.py: resolve_config``; tasks get its typed sections.
"""

from __future__ import annotations

from prefect import flow

from flows.common import FlowRecorder, resolve_config
from tasks.curate import curate_task
from tasks.evaluate import benchmark_task, evaluate_task
from tasks.register import register_task
from tasks.tokenizer import tokenizer_task
from tasks.train import train_task
from trex.core.config import TrexConfig


def run_lifecycle(cfg: TrexConfig, flow_name: str = "lifecycle") -> dict:
    with FlowRecorder(cfg, flow_name) as rec:
        metrics = rec.metrics
        data = rec.stage("curate", curate_task, data=cfg.data)["ref"]
        tok = rec.stage("tokenizer", tokenizer_task, tok=cfg.tokenizer, data_ref=data)["ref"]
        cpt = rec.stage("cpt", train_task, stage="cpt", model=cfg.model, train=cfg.train.cpt,
                        seed=cfg.run.seed, data_ref=data, tok_ref=tok, init_ref=None, parallel=cfg.parallel)["ref"]
        sft = rec.stage("sft", train_task, stage="sft", model=cfg.model, train=cfg.train.sft,
                        seed=cfg.run.seed, data_ref=data, tok_ref=tok, init_ref=cpt, parallel=cfg.parallel)["ref"]
        if cfg.eval.evaluate_base:
            base = rec.stage("evaluate-base", evaluate_task, eval_cfg=cfg.eval, model_ref=cpt, data_ref=data,
                             label="base")
            metrics["pass_at_1_base"] = base["summary"]["pass@1"]
        ev = rec.stage("evaluate-sft", evaluate_task, eval_cfg=cfg.eval, model_ref=sft, data_ref=data, label="sft")
        metrics["pass_at_1"] = ev["summary"]["pass@1"]
        if "pass_at_1_base" in metrics:
            metrics["pass_at_1_gain"] = metrics["pass_at_1"] - metrics["pass_at_1_base"]
        for name in cfg.eval.benchmarks:  # public benchmarks (opt-in: eval.benchmarks)
            b = rec.stage(f"evaluate-{name}", benchmark_task, eval_cfg=cfg.eval, model=sft, backend="native",
                          backend_opts={}, benchmark=name, data=None)
            metrics[f"pass_at_1_{name}"] = b["summary"]["pass@1"]
        scores = {"synthetic": metrics["pass_at_1"],
                  **{name: metrics[f"pass_at_1_{name}"] for name in cfg.eval.benchmarks}}
        reg = rec.stage("register", register_task, model_ref=sft, eval_ref=ev["ref"],
                        registered_model=cfg.tracking.registered_model, data_ref=data, tok_ref=tok, scores=scores,
                        alias=cfg.retrain.alias)
    return {"parent_run_id": rec.parent.run_id, "metrics": metrics,
            "refs": {k: v["ref"] for k, v in rec.results.items()}, "registered": reg["summary"]}


@flow(name="lifecycle", log_prints=True)
def lifecycle_flow(config: str | None = "configs/tiny.yaml", overrides: list[str] | None = None,
                   cfg: TrexConfig | None = None) -> dict:
    return run_lifecycle(resolve_config(cfg, config, overrides))
