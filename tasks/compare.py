"""Compare task: several models side by side over the benchmarks they were evaluated on (``eval.compare``).

The lifecycle compares the CPT-only base with the SFT model; any flow can compare more. Output: ``compare.md``,
``compare.json`` and ``compare.png`` under ``outputs/compare/<key>/``, logged on the flow's MLflow run (under
``compare/``) and published as the Prefect markdown artifact ``trex-compare``.
"""

from __future__ import annotations

import json

from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from eval.compare import Results, compare, load_results, markdown, promotion
from tasks.common import StageContext, stage_dir, stage_key
from trex.tracking.plots import compare_bars
from trex.tracking.runs import Tracker

COMPARE_KEY = "trex-compare"


def _results(evals: dict[str, dict]) -> Results:
    out: Results = {}
    for ref in evals.values():
        out |= load_results(ref["path"])
    return out


@task(name="compare", cache_policy=NO_CACHE)
def compare_task(models: dict[str, dict[str, dict]], title: str, confidence: float, ctx: StageContext,
                 artifact_dir: str = "compare", promote: tuple[str, str, str] | None = None) -> dict:
    """``models``: ``{label: {benchmark: evaluation reference}}``, the first label the baseline. Returns the
    table (``eval.compare.compare``) with ``markdown`` and ``path`` (the output directory); the files go to
    ``artifact_dir`` of the parent MLflow run. ``promote`` (challenger, benchmark, rule): the table also says
    whether the challenger replaces the baseline (``promotion``: ``promote``, ``why``; :func:`eval.compare.promotion`),
    tagged ``<artifact_dir>_promotion`` on the parent run."""
    table = compare({label: _results(evals) for label, evals in models.items()}, confidence)
    if promote is not None:
        ok, why = promotion(table, *promote)
        table["promotion"] = {"challenger": promote[0], "benchmark": promote[1], "rule": promote[2], "promote": ok,
                              "why": why}
    md = f"# {title}\n\n" + markdown(table)
    if promote is not None:
        md += f"\n\n**Promotion ({promote[2]}):** {table['promotion']['why']}"
    out = stage_dir(ctx, "compare", stage_key(models={k: {b: r["hash"] for b, r in v.items()}
                                                       for k, v in models.items()}, confidence=confidence))
    out.mkdir(parents=True, exist_ok=True)
    (out / "compare.md").write_text(md + "\n")
    (out / "compare.json").write_text(json.dumps(table, indent=2))
    compare_bars(table, out / "compare.png", title)
    parent = Tracker(ctx.tracking["uri"], ctx.parent_run_id, ctx.tracking.get("buffer_dir"))
    if ctx.tracking.get("enabled", True) and ctx.parent_run_id:
        for name in ("compare.md", "compare.json", "compare.png"):
            parent.artifact(out / name, artifact_dir)
        if promote is not None:
            parent.tags({f"{artifact_dir}_promotion": table["promotion"]["why"][:4000]})
    key = COMPARE_KEY if artifact_dir == "compare" else f"trex-{artifact_dir.replace('_', '-')}"
    try:
        create_markdown_artifact(md, key=key, description=title)
    except Exception as e:  # noqa: BLE001 -- never fail a finished evaluation for its artifact
        print(f"could not create the Prefect artifact {key}: {e}")
    return {**table, "markdown": md, "path": str(out)}
