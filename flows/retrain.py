"""Retraining with champion / challenger promotion (the weekly and the data-triggered deployment).

1. Find the champion: the registry version behind ``retrain.alias`` (``tasks/registry.py``). None yet: run the
   whole lifecycle; its registered model becomes the first champion.
2. The data: ``data_dir`` (from a ``trex.dataset.updated`` event) or a fresh curation (the data seed is the
   ISO week's unless given). Same content hash as the champion's data: nothing to learn, stop.
3. The challenger: ``retrain.stages`` (default SFT) continued from the champion's weights on the new data,
   with the champion's tokenizer.
4. Both evaluated on the same benchmarks -- the new held-out split and every benchmark the champion was
   scored on plus ``eval.benchmarks`` -- and compared by ``trex.champion.decide``: promote only if mean Pass@1
   rises by ``retrain.margin`` and no benchmark drops by more than ``retrain.tolerance``.
5. The challenger is registered either way; promotion moves the alias, rejection tags the version with the
   reason. A markdown artifact (Prefect) and a ``champion-vs-challenger`` MLflow run hold the table.
"""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

from prefect import flow

from flows.common import FlowRecorder
from flows.lifecycle import run_lifecycle
from tasks.curate import curate_task
from tasks.evaluate import benchmark_task, evaluate_task
from tasks.register import register_task
from tasks.train import train_task
from trex.core.config import TrexConfig, load_config
from trex.core.refs import ref_of
from trex.tracking.champion import decide
from trex.tracking.registry import champion as find_champion
from trex.tracking.registry import set_alias, tag_version
from trex.tracking.runs import start_run, tracking_settings


def weekly_seed(today: dt.date | None = None) -> int:
    year, week, _ = (today or dt.date.today()).isocalendar()
    return year * 100 + week


def _publish(markdown: str, key: str, description: str) -> None:
    from prefect.artifacts import create_markdown_artifact

    try:
        create_markdown_artifact(markdown, key=key, description=description)
    except Exception as e:  # noqa: BLE001 -- never fail a decided retrain for its artifact
        print(f"could not create the Prefect artifact {key}: {e}")


def _scores(rec: FlowRecorder, c: dict, model_ref: dict, data_ref: dict, label: str, benchmarks: list[str]) -> dict:
    ev = rec.stage(f"evaluate-{label}", evaluate_task, eval_cfg=c["eval"], model_ref=model_ref, data_ref=data_ref,
                   label=label)
    out = {"synthetic": ev["summary"]["pass@1"], "_eval_ref": ev["ref"]}
    for name in benchmarks:
        b = rec.stage(f"evaluate-{label}-{name}", benchmark_task, eval_cfg=c["eval"], model=model_ref,
                      backend="native", backend_opts={}, benchmark=name, data=None)
        out[name] = b["summary"]["pass@1"]
    return out


def run_retrain(cfg: TrexConfig, data_dir: str | None = None) -> dict:
    tracking = tracking_settings(cfg.tracking, cfg.run.state_dir)
    name, alias = cfg.tracking.registered_model, cfg.retrain.alias
    champ = find_champion(tracking, name, alias)
    if champ is None:
        result = run_lifecycle(cfg, "retrain")
        reg = result["registered"]
        md = (f"# Retrain — {cfg.run.name}\n\nNo `{alias}` in `{name}` yet: the lifecycle ran and its model "
              f"(version {reg.get('version')}) is the first champion.")
        _publish(md, "trex-retrain-decision", "champion vs challenger")
        return {"decision": "first-champion", "version": reg.get("version"), "metrics": result["metrics"]}
    rec = FlowRecorder(cfg, "retrain")
    try:
        c = cfg.model_dump(mode="json")
        data = ref_of(data_dir, "data") if data_dir else rec.stage("curate", curate_task, data=c["data"])["ref"]
        if data["hash"] == champ["data_hash"]:
            md = (f"# Retrain — {cfg.run.name}\n\nThe curated data (`{data['hash']}`) is what champion version "
                  f"{champ['version']} was trained on: nothing to retrain.")
            _publish(md, "trex-retrain-decision", "champion vs challenger")
            rec.finish({"retrained": 0.0})
            return {"decision": "unchanged-data", "version": champ["version"]}
        tok = ref_of(champ["tokenizer_dir"], "tokenizer")
        champ_ref = ref_of(champ["model_dir"], "model")
        init = champ_ref
        for stage in cfg.retrain.stages:
            init = rec.stage(stage, train_task, stage=stage, model=cfg.model, train=getattr(cfg.train, stage),
                             seed=cfg.run.seed, data_ref=data, tok_ref=tok, init_ref=init, parallel=cfg.parallel)["ref"]
        benchmarks = sorted((set(champ["scores"]) - {"synthetic"}) | set(cfg.eval.benchmarks))
        chal = _scores(rec, c, init, data, "challenger", benchmarks)
        best = _scores(rec, c, champ_ref, data, "champion", benchmarks)
        chal_eval = chal.pop("_eval_ref")
        best.pop("_eval_ref")
        decision = decide(best, chal, cfg.retrain.margin, cfg.retrain.tolerance)
        reg = rec.stage("register", register_task, model_ref=init, eval_ref=chal_eval, registered_model=name,
                        data_ref=data, tok_ref=tok, scores=chal, promote_if_no_champion=False, alias=alias)
        version = str(reg["summary"].get("version", ""))
        if version and decision.promote:
            set_alias(tracking, name, alias, version)
            tag_version(tracking, name, version, {"trex.challenger": "promoted", "trex.champion_reason": decision.reason,
                                                  "trex.replaced_version": champ["version"]})
            tag_version(tracking, name, champ["version"], {"trex.replaced_by": version})
        elif version:
            tag_version(tracking, name, version, {"trex.challenger": "rejected", "trex.reject_reason": decision.reason,
                                                  "trex.compared_with": champ["version"]})
        md = decision.markdown(f"Retrain — {cfg.run.name}", f"v{champ['version']}", f"v{version or '?'}")
        _log_comparison(rec, decision, md, champ["version"], version)
        _publish(md, "trex-retrain-decision", "champion vs challenger")
    except BaseException:
        rec.finish(failed=True)
        raise
    rec.finish({"promoted": float(decision.promote), "champion_mean_pass_at_1": decision.champion_mean,
                "challenger_mean_pass_at_1": decision.challenger_mean})
    return {"decision": "promoted" if decision.promote else "rejected", "reason": decision.reason,
            "champion_version": champ["version"], "challenger_version": version, "rows": decision.rows}


def _log_comparison(rec: FlowRecorder, decision, markdown: str, champ_version: str, chal_version: str) -> None:
    """An MLflow run ``champion-vs-challenger`` (child of the flow's run): both sides' metrics and the table."""
    run = start_run(rec.ctx.tracking, "champion-vs-challenger", rec.parent.run_id,
                    {"stage": "compare", "champion_version": champ_version, "challenger_version": chal_version,
                     "decision": "promoted" if decision.promote else "rejected"})
    metrics = {"promoted": float(decision.promote), "champion_mean_pass_at_1": decision.champion_mean,
               "challenger_mean_pass_at_1": decision.challenger_mean}
    for r in decision.rows:
        metrics |= {f"champion_pass_at_1_{r['benchmark']}": r["champion"],
                    f"challenger_pass_at_1_{r['benchmark']}": r["challenger"], f"delta_{r['benchmark']}": r["delta"]}
    run.metrics(metrics)
    run.tags({"reason": decision.reason})
    if decision.rows:
        run.table(decision.rows, "champion_vs_challenger.json")
    d = Path(rec.ctx.output_dir) / "decisions" / f"v{champ_version}-vs-v{chal_version}"  # kept: may be buffered
    d.mkdir(parents=True, exist_ok=True)
    (d / "decision.md").write_text(markdown)
    (d / "decision.json").write_text(json.dumps({"promote": decision.promote, "reason": decision.reason,
                                                 "rows": decision.rows}, indent=2))
    run.artifact(d / "decision.md")
    run.artifact(d / "decision.json")
    run.finish()


@flow(name="retrain", log_prints=True, persist_result=True)
def retrain_flow(config: str | None = "configs/tiny.yaml", overrides: list[str] | None = None,
                 data_seed: int | None = None, data_dir: str | None = None) -> dict:
    """``data_dir`` (a curated data directory, e.g. from a ``trex.dataset.updated`` event) skips curation."""
    extra = [] if data_dir else [f"data.seed={data_seed if data_seed is not None else weekly_seed()}"]
    return run_retrain(load_config(config, [*(overrides or []), *extra]), data_dir)
