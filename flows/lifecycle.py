"""The whole lifecycle: curate -> tokenizer -> [import model.init_from] -> CPT -> SFT -> [RL] -> evaluate (base,
SFT and RL, each also on the out-of-distribution split when ``data.ood`` draws one) -> [export to the
published layout] -> register. Curation is one stage, or several with LLM stages (``flows/curate.py:
curate_stages``). With ``train.rl.enabled`` the RL model is compared with the SFT model, paired on the held-out
problems, and registered only when ``train.rl.promote`` says so (default: not significantly worse); the parent
run's ``pass_at_1`` is the registered model's, beside ``pass_at_1_sft`` and ``pass_at_1_rl``.

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
from tasks.rl import rl_task
from tasks.tokenizer import tokenizer_task
from tasks.train import train_task
from trex.core.config import TrexConfig


def held_out(rec: FlowRecorder, cfg: TrexConfig, model: dict, data: dict, label: str) -> dict[str, dict]:
    """Evaluate ``model`` on the held-out split and, where ``data.ood`` draws one, the out-of-distribution split:
    ``{"synthetic": result, "synthetic_ood": result}``."""
    out = {"synthetic": rec.stage(f"evaluate-{label}", evaluate_task, eval_cfg=cfg.eval, model_ref=model,
                                  data_ref=data, label=label)}
    if cfg.data.ood.problems:  # withheld families and representations
        out["synthetic_ood"] = rec.stage(f"evaluate-{label}-ood", evaluate_task, eval_cfg=cfg.eval, model_ref=model,
                                         data_ref=data, label=f"{label}-ood", split="eval_ood")
    return out


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
        rl = rec.stage("rl", rl_task, rl=cfg.train.rl, eval_cfg=cfg.eval, seed=cfg.run.seed, init_ref=sft,
                       data_ref=data, tok_ref=tok)["ref"] if cfg.train.rl.enabled else None
        if cfg.eval.evaluate_base and base is not None:  # on both splits: what SFT changes out of distribution too
            base_evals = held_out(rec, cfg, base, data, "base")
            metrics["pass_at_1_base"] = base_evals["synthetic"]["summary"]["pass@1"]
            metrics |= interval_metrics(base_evals["synthetic"]["summary"], "pass_at_1_base")
            if "synthetic_ood" in base_evals:
                metrics["pass_at_1_base_ood"] = base_evals["synthetic_ood"]["summary"]["pass@1"]
        final, evals = sft, held_out(rec, cfg, sft, data, "sft")
        if "pass_at_1_base" in metrics:  # base and SFT side by side on both splits, with intervals and paired gains
            metrics["pass_at_1_sft"] = evals["synthetic"]["summary"]["pass@1"]
            if "synthetic_ood" in evals:
                metrics["pass_at_1_sft_ood"] = evals["synthetic_ood"]["summary"]["pass@1"]
            compare_task({"base": {k: v["ref"] for k, v in base_evals.items()},
                          "sft": {k: v["ref"] for k, v in evals.items()}},
                         f"{cfg.run.name}: base vs SFT", cfg.eval.confidence, ctx=rec.ctx)
        if rl is not None:  # RL beside SFT on both splits: it becomes the model only by the paired rule
            rl_evals = held_out(rec, cfg, rl, data, "rl")
            metrics |= {f"pass_at_1_{who}{'_ood' if split.endswith('ood') else ''}": e["summary"]["pass@1"]
                        for who, ev in (("sft", evals), ("rl", rl_evals)) for split, e in ev.items()}
            metrics |= interval_metrics(rl_evals["synthetic"]["summary"], "pass_at_1_rl")
            table = compare_task({"sft": {k: v["ref"] for k, v in evals.items()},
                                  "rl": {k: v["ref"] for k, v in rl_evals.items()}}, f"{cfg.run.name}: SFT vs RL",
                                 cfg.eval.confidence, ctx=rec.ctx, artifact_dir="compare_rl",
                                 promote=("rl", "synthetic", cfg.train.rl.promote))
            metrics |= {"pass_at_1_rl_gain": metrics["pass_at_1_rl"] - metrics["pass_at_1_sft"],
                        "rl_promoted": float(table["promotion"]["promote"])}
            if table["promotion"]["promote"]:
                final, evals = rl, rl_evals
        metrics["pass_at_1"] = evals["synthetic"]["summary"]["pass@1"]  # the registered model's
        metrics |= interval_metrics(evals["synthetic"]["summary"])
        if "synthetic_ood" in evals:
            metrics["pass_at_1_ood"] = evals["synthetic_ood"]["summary"]["pass@1"]
            metrics |= interval_metrics(evals["synthetic_ood"]["summary"], "pass_at_1_ood")
        if "pass_at_1_base" in metrics:
            metrics["pass_at_1_gain"] = metrics["pass_at_1"] - metrics["pass_at_1_base"]
        for name in cfg.eval.benchmarks:  # public benchmarks (opt-in: eval.benchmarks), of the registered model
            b = rec.stage(f"evaluate-{name}", benchmark_task, eval_cfg=cfg.eval, model=final, backend="native",
                          backend_opts={}, benchmark=name, data=None)
            metrics[f"pass_at_1_{name}"] = b["summary"]["pass@1"]
        scores = {"synthetic": metrics["pass_at_1"],
                  **({"synthetic_ood": metrics["pass_at_1_ood"]} if "pass_at_1_ood" in metrics else {}),
                  **{name: metrics[f"pass_at_1_{name}"] for name in cfg.eval.benchmarks}}
        final_eval = evals["synthetic"]
        if cfg.model.export_format != "hf":  # the registered model in the published layout
            final = rec.stage("export", export_task, model_ref=final, fmt=cfg.model.export_format,
                              scheme=cfg.model.export_scheme, like=cfg.model.init_from)["ref"]
        reg = rec.stage("register", register_task, model_ref=final, eval_ref=final_eval["ref"],
                        registered_model=cfg.tracking.registered_model, data_ref=data, tok_ref=tok, scores=scores,
                        alias=cfg.retrain.alias)
    return {"parent_run_id": rec.parent.run_id, "metrics": metrics,
            "refs": {k: v["ref"] for k, v in rec.results.items()}, "registered": reg["summary"]}


@flow(name="lifecycle", log_prints=True)
def lifecycle_flow(config: str | None = "configs/tiny.yaml", overrides: list[str] | None = None,
                   cfg: TrexConfig | None = None, rl: bool | None = None) -> dict:
    """``rl``: run the RL stage (True) or not (False) whatever ``train.rl.enabled`` says (None: as it says)."""
    cfg = resolve_config(cfg, config, overrides)
    if rl is not None:
        cfg = cfg.model_copy(update={"train": cfg.train.model_copy(
            update={"rl": cfg.train.rl.model_copy(update={"enabled": rl})})})
    return run_lifecycle(cfg)
