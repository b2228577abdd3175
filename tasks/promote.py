"""Champion / challenger tasks of retraining (``flows/retrain.py``): find the champion, decide and move the
registry alias, record the comparison.

The rule is ``trex.tracking.champion.decide``; the alias and the version tags are
``trex.tracking.registry.promote`` / ``reject``. None of these tasks is cached: each reads or changes the
registry as it is now.
"""

from __future__ import annotations

import json
from pathlib import Path

from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from eval.harness import problem_verdicts, read_samples
from tasks.common import StageContext
from trex.core.config import RetrainConfig, TrackingConfig
from trex.tracking.champion import Decision, decide
from trex.tracking.registry import champion, promote, reject
from trex.tracking.runs import start_run, tracking_settings

DECISION_KEY = "trex-retrain-decision"  # the Prefect markdown artifact with the decision


@task(name="champion", cache_policy=NO_CACHE)
def champion_task(tracking: TrackingConfig, state_dir: str, alias: str) -> dict | None:
    """The registry version behind ``alias`` with its lineage (``trex.tracking.registry.champion``), or None."""
    return champion(tracking_settings(tracking, state_dir), tracking.registered_model, alias)


def evals_verdicts(evals: dict[str, dict]) -> dict[str, dict[str, list[bool]]]:
    """``{benchmark: {problem id: verdicts}}`` from each benchmark's evaluation reference (its ``samples.jsonl``)."""
    return {b: problem_verdicts(read_samples(ref["path"])) for b, ref in evals.items()}


@task(name="promote", cache_policy=NO_CACHE)
def promote_task(champ: dict, champion_scores: dict[str, float], challenger_scores: dict[str, float],
                 challenger_version: str, retrain: RetrainConfig, registered_model: str,
                 champion_evals: dict[str, dict] | None, challenger_evals: dict[str, dict] | None,
                 confidence: float, ctx: StageContext) -> Decision:
    """Decide on the same benchmarks (``retrain.margin``, ``retrain.tolerance``, ``retrain.ood``; with both sides' evaluation
    references, on the paired comparison of their per-problem verdicts at ``confidence``); a promoted
    challenger takes the alias, a rejected one is tagged with the reason. Without a registered version
    (tracking was offline) the decision is only returned."""
    verdicts = None
    if champion_evals is not None and challenger_evals is not None:
        verdicts = (evals_verdicts(champion_evals), evals_verdicts(challenger_evals))
    decision = decide(champion_scores, challenger_scores, retrain.margin, retrain.tolerance, verdicts, confidence,
                      retrain.ood)
    if challenger_version and decision.promote:
        promote(ctx.tracking, registered_model, retrain.alias, challenger_version, decision.reason,
                replaced=champ["version"])
    elif challenger_version:
        reject(ctx.tracking, registered_model, challenger_version, decision.reason, compared_with=champ["version"])
    return decision


@task(name="compare", cache_policy=NO_CACHE)
def compare_task(decision: Decision, title: str, champion_version: str, challenger_version: str,
                 ctx: StageContext) -> str:
    """The comparison as an MLflow run ``champion-vs-challenger`` (a child of the flow's run: both sides'
    metrics, the deltas, the table, ``decision.md`` / ``decision.json``) and as the Prefect artifact
    ``trex-retrain-decision``; returns the markdown."""
    markdown = decision.markdown(title, f"v{champion_version}", f"v{challenger_version or '?'}")
    run = start_run(ctx.tracking, "champion-vs-challenger", ctx.parent_run_id,
                    {"stage": "compare", "champion_version": champion_version,
                     "challenger_version": challenger_version,
                     "decision": "promoted" if decision.promote else "rejected"})
    metrics = {"promoted": float(decision.promote), "champion_mean_pass_at_1": decision.champion_mean,
               "challenger_mean_pass_at_1": decision.challenger_mean}
    if decision.paired is not None:
        metrics |= {"paired_gain": decision.paired.difference, "paired_gain_ci_low": decision.paired.low,
                    "paired_gain_ci_high": decision.paired.high, "paired_p_not_better": decision.paired.p_not_better}
    for r in decision.rows:
        metrics |= {f"champion_pass_at_1_{r['benchmark']}": r["champion"],
                    f"challenger_pass_at_1_{r['benchmark']}": r["challenger"], f"delta_{r['benchmark']}": r["delta"]}
    run.metrics(metrics)
    run.tags({"reason": decision.reason})
    if decision.rows:
        run.table(decision.rows, "champion_vs_challenger.json")
    d = Path(ctx.output_dir) / "decisions" / f"v{champion_version}-vs-v{challenger_version}"  # kept: may be buffered
    d.mkdir(parents=True, exist_ok=True)
    (d / "decision.md").write_text(markdown)
    (d / "decision.json").write_text(json.dumps({"promote": decision.promote, "reason": decision.reason,
                                                 "rows": decision.rows, "paired": decision.paired and
                                                 decision.paired.as_dict()}, indent=2))
    run.artifact(d / "decision.md")
    run.artifact(d / "decision.json")
    run.finish()
    publish_decision(markdown)
    return markdown


def publish_decision(markdown: str) -> None:
    """The Prefect markdown artifact ``trex-retrain-decision`` (also for the runs that decide nothing)."""
    try:
        create_markdown_artifact(markdown, key=DECISION_KEY, description="champion vs challenger")
    except Exception as e:  # noqa: BLE001 -- never fail a decided retrain for its artifact
        print(f"could not create the Prefect artifact {DECISION_KEY}: {e}")
