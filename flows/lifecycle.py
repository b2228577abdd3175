"""The whole lifecycle: curate -> tokenizer -> [import model.init_from] -> CPT -> SFT -> evaluate (base and
SFT; the SFT model also on the out-of-distribution split when ``data.ood`` draws one) -> [export to the published
layout] -> register. Curation is one stage, or several with LLM stages (``flows/curate.py: curate_stages``).

With ``model.init_from`` the run starts from that checkpoint (its architecture, tokenizer and chat format);
``train.cpt.enabled=false`` starts SFT from it directly; ``model.export_format`` (hub-fp8 / hub-bf16) hands
the registered model back in the published layout.

Run it with ``trex lifecycle --config configs/tiny.yaml``, ``python -m trex lifecycle ...`` or as
the ``lifecycle`` Prefect deployment. Stages exchange references only; a second run with the same
inputs reuses every finished stage from Prefect's cache.

The configuration: ``cfg`` (parsed by the CLI) or ``config`` + ``overrides`` (a deployment run), see
``flows/common.py: resolve_config``; tasks get its typed sections.
"""

from __future__ import annotations

from prefect import flow

from flows.common import FlowRecorder, resolve_config
from flows.curate import curate_stages
from tasks.checkpoint import export_task, import_task
from tasks.compare import compare_task
from tasks.evaluate import benchmark_task, evaluate_task, interval_metrics
from tasks.register import register_task
from tasks.tokenizer import tokenizer_task
from tasks.train import train_task
from trex.core.config import TrexConfig


def run_lifecycle(cfg: TrexConfig, flow_name: str = "lifecycle") -> dict:
    arch = cfg.model.architecture()  # the YAML's model keys; an init checkpoint's config.json gives the rest
    with FlowRecorder(cfg, flow_name, sandbox=("data", "eval")) as rec:
        metrics = rec.metrics
        data = curate_stages(rec, cfg)["ref"]
        tok = rec.stage("tokenizer", tokenizer_task, tok=cfg.tokenizer, data_ref=data)["ref"]
        base = rec.stage("import", import_task, path=cfg.model.init_from, model=arch)["ref"] \
            if cfg.model.init_from else None
        if cfg.train.cpt.enabled:
            base = rec.stage("cpt", train_task, stage="cpt", model=arch, train=cfg.train.cpt, seed=cfg.run.seed,
                             data_ref=data, tok_ref=tok, init_ref=base, parallel=cfg.parallel)["ref"]
        sft = rec.stage("sft", train_task, stage="sft", model=arch, train=cfg.train.sft,
                        seed=cfg.run.seed, data_ref=data, tok_ref=tok, init_ref=base, parallel=cfg.parallel)["ref"]
        if cfg.eval.evaluate_base and base is not None:
            base_eval = rec.stage("evaluate-base", evaluate_task, eval_cfg=cfg.eval, model_ref=base, data_ref=data,
                                  label="base")
            metrics["pass_at_1_base"] = base_eval["summary"]["pass@1"]
            metrics |= interval_metrics(base_eval["summary"], "pass_at_1_base")
        ev = rec.stage("evaluate-sft", evaluate_task, eval_cfg=cfg.eval, model_ref=sft, data_ref=data, label="sft")
        metrics["pass_at_1"] = ev["summary"]["pass@1"]
        metrics |= interval_metrics(ev["summary"])
        if "pass_at_1_base" in metrics:
            metrics["pass_at_1_gain"] = metrics["pass_at_1"] - metrics["pass_at_1_base"]
        evals = {"synthetic": ev["ref"]}
        if cfg.data.ood.problems:  # the out-of-distribution held-out split (data.ood): withheld families and styles
            ood = rec.stage("evaluate-sft-ood", evaluate_task, eval_cfg=cfg.eval, model_ref=sft, data_ref=data,
                            label="sft-ood", split="eval_ood")
            metrics["pass_at_1_ood"] = ood["summary"]["pass@1"]
            metrics |= interval_metrics(ood["summary"], "pass_at_1_ood")
        for name in cfg.eval.benchmarks:  # public benchmarks (opt-in: eval.benchmarks)
            b = rec.stage(f"evaluate-{name}", benchmark_task, eval_cfg=cfg.eval, model=sft, backend="native",
                          backend_opts={}, benchmark=name, data=None)
            metrics[f"pass_at_1_{name}"] = b["summary"]["pass@1"]
            evals[name] = b["ref"]
        if "pass_at_1_base" in metrics:  # base and SFT side by side, with intervals and the paired gain
            compare_task({"base": {"synthetic": base_eval["ref"]}, "sft": evals}, f"{cfg.run.name}: base vs SFT",
                         cfg.eval.confidence, ctx=rec.ctx)
        scores = {"synthetic": metrics["pass_at_1"],
                  **{name: metrics[f"pass_at_1_{name}"] for name in cfg.eval.benchmarks}}
        final = sft
        if cfg.model.export_format != "hf":  # the registered model in the published layout
            final = rec.stage("export", export_task, model_ref=sft, fmt=cfg.model.export_format,
                              scheme=cfg.model.export_scheme, like=cfg.model.init_from)["ref"]
        reg = rec.stage("register", register_task, model_ref=final, eval_ref=ev["ref"],
                        registered_model=cfg.tracking.registered_model, data_ref=data, tok_ref=tok, scores=scores,
                        alias=cfg.retrain.alias)
    return {"parent_run_id": rec.parent.run_id, "metrics": metrics,
            "refs": {k: v["ref"] for k, v in rec.results.items()}, "registered": reg["summary"]}


@flow(name="lifecycle", log_prints=True)
def lifecycle_flow(config: str | None = "configs/tiny.yaml", overrides: list[str] | None = None,
                   cfg: TrexConfig | None = None) -> dict:
    return run_lifecycle(resolve_config(cfg, config, overrides))
