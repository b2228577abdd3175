"""Retraining with champion / challenger promotion (the weekly and the data-triggered deployment).

1. Find the champion: the registry version behind ``retrain.alias`` (``tasks/promote.py: champion_task``). None yet: run the
   whole lifecycle; its registered model becomes the first champion.
2. The data: ``data_dir`` (from a ``trex.dataset.updated`` event) or a fresh curation (the data seed is the
   ISO week's unless given). Same content hash as the champion's data: nothing to learn, stop.
3. The challenger: ``retrain.stages`` (default SFT) continued from the champion's weights on the new data,
   with the champion's tokenizer.
4. Both evaluated on the same benchmarks -- the new held-out split and every benchmark the champion was
   scored on plus ``eval.benchmarks``, and the out-of-distribution split where ``data.ood`` draws one -- and
   compared by ``trex.champion.decide``: promote only if mean Pass@1 rises by ``retrain.margin``, no benchmark
   drops by more than ``retrain.tolerance`` and (``retrain.ood: not_worse``) the challenger is not significantly
   worse out of distribution.
5. The challenger is registered either way; promotion moves the alias, rejection tags the version with the
   reason (``promote_task``). A markdown artifact (Prefect) and a ``champion-vs-challenger`` MLflow run hold the
   table (``compare_task``).

The configuration: ``cfg`` (parsed by the CLI) or ``config`` + ``overrides`` (a deployment run or the
``trex.dataset.updated`` trigger), see ``flows/common.py: resolve_config``; without ``data_dir`` the data seed
is then set to ``data_seed`` (default: the ISO week's).
"""

from __future__ import annotations

import datetime as dt

from prefect import flow

from flows.common import FlowRecorder, resolve_config
from flows.curate import curate_stages
from flows.lifecycle import held_out, run_lifecycle
from tasks.evaluate import HELD_OUT, benchmark_task
from tasks.promote import champion_task, compare_task, promote_task, publish_decision
from tasks.register import register_task
from tasks.train import train_task
from trex.core.config import TrexConfig
from trex.core.refs import ref_of


def weekly_seed(today: dt.date | None = None) -> int:
    year, week, _ = (today or dt.date.today()).isocalendar()
    return year * 100 + week


def _scores(rec: FlowRecorder, model_ref: dict, data_ref: dict, label: str, benchmarks: list[str]
            ) -> tuple[dict, dict]:
    """Pass@1 of one side on the held-out splits and on ``benchmarks``: ``({benchmark: pass@1}, {benchmark: eval
    ref})`` (``synthetic``: the held-out split; ``synthetic_ood``: the out-of-distribution one, where ``data.ood``
    draws it -- the decision's guard)."""
    cfg = rec.cfg
    evals = held_out(rec, cfg, model_ref, data_ref, label)
    scores = {b: e["summary"]["pass@1"] for b, e in evals.items()}
    refs = {b: e["ref"] for b, e in evals.items()}
    for name in benchmarks:
        b = rec.stage(f"evaluate-{label}-{name}", benchmark_task, eval_cfg=cfg.eval, model=model_ref,
                      backend="native", backend_opts={}, benchmark=name, data=None)
        scores[name], refs[name] = b["summary"]["pass@1"], b["ref"]
    return scores, refs


def run_retrain(cfg: TrexConfig, data_dir: str | None = None) -> dict:
    name, alias = cfg.tracking.registered_model, cfg.retrain.alias
    champ = champion_task(cfg.tracking, cfg.run.state_dir, alias)
    if champ is None:
        result = run_lifecycle(cfg, "retrain")
        reg = result["registered"]
        publish_decision(f"# Retrain — {cfg.run.name}\n\nNo `{alias}` in `{name}` yet: the lifecycle ran and its "
                         f"model (version {reg.get('version')}) is the first champion.")
        return {"decision": "first-champion", "version": reg.get("version"), "metrics": result["metrics"]}
    with FlowRecorder(cfg, "retrain", sandbox=("data", "eval")) as rec:
        data = ref_of(data_dir, "data") if data_dir else curate_stages(rec, cfg)["ref"]
        if data["hash"] == champ["data_hash"]:
            publish_decision(f"# Retrain — {cfg.run.name}\n\nThe curated data (`{data['hash']}`) is what champion "
                             f"version {champ['version']} was trained on: nothing to retrain.")
            rec.metrics["retrained"] = 0.0
            return {"decision": "unchanged-data", "version": champ["version"]}
        tok = ref_of(champ["tokenizer_dir"], "tokenizer")
        champ_ref = ref_of(champ["model_dir"], "model")
        init = champ_ref
        for stage in cfg.retrain.stages:
            init = rec.stage(stage, train_task, stage=stage, model=cfg.model.architecture(),
                             train=getattr(cfg.train, stage),
                             seed=cfg.run.seed, data_ref=data, tok_ref=tok, init_ref=init, parallel=cfg.parallel)["ref"]
        benchmarks = sorted((set(champ["scores"]) - set(HELD_OUT.values())) | set(cfg.eval.benchmarks))
        chal, chal_evals = _scores(rec, init, data, "challenger", benchmarks)
        best, best_evals = _scores(rec, champ_ref, data, "champion", benchmarks)
        reg = rec.stage("register", register_task, model_ref=init, eval_ref=chal_evals["synthetic"],
                        registered_model=name, data_ref=data, tok_ref=tok, scores=chal, promote_if_no_champion=False,
                        alias=alias)
        version = str(reg["summary"].get("version", ""))
        decision = promote_task(champ, best, chal, version, cfg.retrain, name, best_evals, chal_evals,
                                cfg.eval.confidence, ctx=rec.ctx)
        compare_task(decision, f"Retrain — {cfg.run.name}", champ["version"], version, ctx=rec.ctx)
        rec.metrics.update({"promoted": float(decision.promote), "champion_mean_pass_at_1": decision.champion_mean,
                            "challenger_mean_pass_at_1": decision.challenger_mean})
    return {"decision": "promoted" if decision.promote else "rejected", "reason": decision.reason,
            "champion_version": champ["version"], "challenger_version": version, "rows": decision.rows}


def with_data_seed(cfg: TrexConfig, seed: int) -> TrexConfig:
    """A copy of ``cfg`` curating with ``data.seed = seed`` (the caller's configuration is left as it is)."""
    return cfg.model_copy(update={"data": cfg.data.model_copy(update={"seed": seed})})


@flow(name="retrain", log_prints=True, persist_result=True)
def retrain_flow(config: str | None = "configs/tiny.yaml", overrides: list[str] | None = None,
                 data_seed: int | None = None, data_dir: str | None = None, cfg: TrexConfig | None = None) -> dict:
    """``data_dir`` (a curated data directory, e.g. from a ``trex.dataset.updated`` event) skips curation."""
    cfg = resolve_config(cfg, config, overrides)
    if not data_dir:
        cfg = with_data_seed(cfg, data_seed if data_seed is not None else weekly_seed())
    return run_retrain(cfg, data_dir)
