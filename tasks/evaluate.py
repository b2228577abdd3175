"""Evaluate task: Pass@1 of a model export on the held-out split (an ``eval`` report reference)."""

from __future__ import annotations

import time
from pathlib import Path

from prefect import task
from prefect.artifacts import create_table_artifact
from prefect.context import get_run_context

from eval.backends import make_backend
from eval.benchmarks import load_benchmark
from eval.harness import evaluate, evaluate_items, read_samples, run_fingerprint
from tasks.common import TASK_OPTIONS, StageContext, log_data_split, plain, stage_dir, stage_key, stage_result
from tasks.plots import pass_at_1_groups, plot_dir, publish_plot
from tasks.progress import stage_progress
from trex.core.config import EvalConfig
from trex.core.refs import fresh_dir, read_manifest, write_manifest
from trex.tracking.plots import pass_at_1_bars
from trex.tracking.runs import start_run


def sample_table(out: Path) -> list[dict]:
    """One row per judged sample, for the MLflow table artifact and the Prefect table artifact."""
    rows = []
    for r in read_samples(out):
        v = r.get("verdicts") or {}
        rows.append({"benchmark": r["benchmark"], "id": str(r["id"]), "category": r.get("category"),
                     "outcome": r["outcome"], "solver": r.get("solver"), "objective": r.get("objective"),
                     "reported": r.get("reported"), "ground_truth": r.get("ground_truth"),
                     "pass_rel": v.get("rel"), "pass_abs": v.get("abs"), "pass_orlm": v.get("orlm"),
                     "side_effects": ", ".join(r.get("side_effects") or []), "repairs": len(r.get("repairs") or []),
                     "first_attempt_outcome": (r.get("first_attempt") or {}).get("outcome", r["outcome"])})
    return rows


def publish_table(key: str, rows: list[dict], description: str) -> None:
    """A Prefect table artifact (ignored outside a flow run)."""
    try:
        get_run_context()
    except Exception:  # noqa: BLE001 - not inside a Prefect run
        return
    create_table_artifact(key=key.lower().replace("_", "-"), table=rows[:1000], description=description)


def _plot(run, report: dict, where: Path, label: str) -> None:
    """Pass@1 per category / representation / family (whatever the report breaks down) as a PNG."""
    groups = pass_at_1_groups(report)
    if groups:
        png = pass_at_1_bars(groups, where / f"pass_at_1_{label}.png",
                             f"{label}: Pass@1 {report['pass@1']:.3f} (n={report['n']})")
        publish_plot(run, png, f"trex-pass-at-1-{label.lower().replace('_', '-')}", f"Pass@1 breakdown ({label})")


def fingerprint_params(fp: dict) -> dict:
    """The run fingerprint as MLflow params: its hash and each readable component."""
    return {"fingerprint": fp["hash"], "fingerprint_components": fp["components"]}


# a curated held-out split -> the benchmark name its rows carry (``synthetic``: the in-distribution split)
HELD_OUT = {"eval": "synthetic", "eval_ood": "synthetic_ood"}


@task(name="evaluate", **TASK_OPTIONS)
def evaluate_task(eval_cfg: EvalConfig, model_ref: dict, data_ref: dict, label: str, ctx: StageContext,
                  split: str = "eval") -> dict:
    """Pass@1 on a curated held-out split: ``eval`` (in distribution) or ``eval_ood`` (out of distribution)."""
    t0 = time.perf_counter()
    read_manifest(model_ref["path"], "model")
    read_manifest(data_ref["path"], "data")
    keys = {"eval": eval_cfg, "model": model_ref["hash"], "data": data_ref["hash"]}
    out = fresh_dir(stage_dir(ctx, "eval", stage_key(**keys, **({} if split == "eval" else {"split": split}))))
    run = start_run(ctx.tracking, f"evaluate-{label}", ctx.parent_run_id, {"stage": "evaluate", "model_label": label},
                    resume_key=f"eval:{out.name}")
    run.params({"eval": plain(eval_cfg), "model_hash": model_ref["hash"], "data_hash": data_ref["hash"],
                "split": split})
    log_data_split(run, data_ref, split, "evaluation")
    with stage_progress(f"evaluate {label}") as progress:
        report = evaluate(Path(model_ref["path"]) / "export", Path(data_ref["path"]) / split, eval_cfg,
                          out, progress, model_hash=model_ref["hash"], benchmark=HELD_OUT[split])
    run.params(fingerprint_params(report["fingerprint"]))
    ref = write_manifest(out, "eval", {"label": label, "model": model_ref, "data": data_ref, "split": split,
                                       "pass@1": report["pass@1"], "n": report["n"],
                                       "fingerprint": report["fingerprint"]})
    run.metrics({"pass_at_1": report["pass@1"], "execution_error_rate": report["execution_error_rate"],
                 "side_effect_rate": report["side_effects"]["rate"],
                 "pass_at_1_first_attempt": report["pass@1_first_attempt"],
                 "repair_fixed": report["repair"]["fixed"],
                 "no_program_rate": report["no_program_rate"], "no_solve_rate": report["no_solve_rate"],
                 "n": report["n"], **interval_metrics(report),
                 **{f"pass_at_1_{rule}": v for rule, v in report["pass@1_by_rule"].items()},
                 **{f"pass_at_1_{k}": v for k, v in report["per_family_pass@1"].items()},
                 **{f"pass_at_1_cat_{k}": v for k, v in report["per_category_pass@1"].items()},
                 **{f"pass_at_1_rep_{k}": v for k, v in report["per_representation_pass@1"].items()},
                 **{f"pass_at_1_tier_{k}": v for k, v in report["per_tier_pass@1"].items()}})
    run.tags({"isolation": str(report["isolation"]), "output_dir": ref["path"]})
    _plot(run, report, plot_dir(ctx, out), label)
    run.artifact(out / "report.json")
    run.artifact(out / "samples.jsonl")
    run.table(sample_table(out), f"eval_samples_{label}.json")
    publish_table(f"eval-{label}", sample_table(out), f"Pass@1 samples ({label})")
    run.finish()
    summary = {"pass@1": report["pass@1"], "pass@1_ci": report["pass@1_ci"], "n": report["n"],
               "per_family": report["per_family_pass@1"], "per_representation": report["per_representation_pass@1"],
               "per_tier": report["per_tier_pass@1"],
               "pass@1_by_rule": report["pass@1_by_rule"], "execution_error_rate": report["execution_error_rate"]}
    return stage_result(ref, summary, t0, run.run_id)


def interval_metrics(report: dict, key: str = "pass_at_1") -> dict[str, float]:
    """``<key>_ci_low`` / ``<key>_ci_high`` (the ends of a report's or summary's Pass@1 interval) and unbiased
    pass@k as MLflow metrics."""
    ci = report.get("pass@1_ci") or {}
    out = {f"{key}_ci_{end}": ci[end] for end in ("low", "high") if end in ci}
    return out | {f"pass_at_{k}": v for k, v in (report.get("pass@k") or {}).items() if k != "1"}


@task(name="evaluate-benchmark", **TASK_OPTIONS)
def benchmark_task(eval_cfg: EvalConfig, model: dict, backend: str, backend_opts: dict, benchmark: str,
                   data: str | None, ctx: StageContext) -> dict:
    """Pass@1 of ``model`` (a model reference, or ``{"path": name}`` for a served model) on one benchmark.

    The output directory is keyed by the inputs and resumed, not wiped: a crashed run continues.
    """
    t0 = time.perf_counter()
    model_dir = model["path"]
    if model.get("kind") == "model":
        read_manifest(model["path"], "model")
        model_dir = str(Path(model["path"]) / "export")
    loaded = load_benchmark(benchmark, data, limit=eval_cfg.benchmark_limit)
    opts = dict(backend_opts)
    if backend in ("native", "hf"):
        opts.setdefault("batch_size", eval_cfg.batch_size)
    engine = make_backend(backend, model_dir, **opts)
    fp = run_fingerprint(engine.describe(), eval_cfg, benchmark, eval_cfg.template, eval_cfg.api,
                         loaded.content_hash, loaded.hashed_files, model.get("hash"))
    # keyed by the fingerprint too: changed weights or benchmark data behind the same paths get a new directory
    out = stage_dir(ctx, "eval-bench", stage_key(eval=eval_cfg, model=model.get("hash") or model["path"],
                                                 backend=backend, opts=backend_opts, benchmark=benchmark,
                                                 data=loaded.source, fingerprint=fp["hash"]))
    out.mkdir(parents=True, exist_ok=True)
    (out / "manifest.json").unlink(missing_ok=True)
    run = start_run(ctx.tracking, f"evaluate-{benchmark}", ctx.parent_run_id, {"stage": "evaluate", "benchmark": benchmark},
                    resume_key=f"eval-bench:{out.name}")
    run.params({"eval": plain(eval_cfg), "model": model.get("hash") or model["path"], "backend": backend,
                "benchmark": benchmark, "benchmark_source": loaded.source, **loaded.counts, **fingerprint_params(fp)})
    if loaded.content_hash:
        local = Path(loaded.source).exists()  # else a hub dataset, by name
        run.dataset(benchmark, loaded.source, loaded.content_hash, "evaluation", rows=len(loaded.items),
                    source=None if local else f"hf://datasets/{loaded.source}")
    with stage_progress(f"evaluate {benchmark}") as progress:
        report = evaluate_items(engine, loaded.items, out, eval_cfg, benchmark, template=eval_cfg.template,
                                api=eval_cfg.api,
                                progress=lambda what, i, n: progress("items", i, n), fingerprint=fp)
    ref = write_manifest(out, "eval", {"label": benchmark, "model": model, "benchmark": benchmark,
                                       "source": loaded.source, "skipped": loaded.skipped,
                                       "pass@1": report["pass@1"], "n": report["n"], "fingerprint": fp})
    run.metrics({"pass_at_1": report["pass@1"], "n": report["n"], "unjudged": report["unjudged"],
                 "side_effect_rate": report["side_effects"]["rate"],
                 "pass_at_1_first_attempt": report["pass@1_first_attempt"],
                 "repair_fixed": report["repair"]["fixed"],
                 **interval_metrics(report),
                 "execution_error_rate": report["execution_error_rate"],
                 **{f"pass_at_1_{rule}": v for rule, v in report["pass@1_by_rule"].items()},
                 **{f"pass_at_1_cat_{k}": v for k, v in report["per_category_pass@1"].items()}})
    run.tags({"isolation": str(report["isolation"]), "output_dir": ref["path"]})
    _plot(run, report, plot_dir(ctx, out), benchmark)
    run.artifact(out / "report.json")
    run.table(sample_table(out), f"eval_samples_{benchmark}.json")
    publish_table(f"eval-{benchmark}", sample_table(out), f"Pass@1 samples ({benchmark})")
    run.finish()
    summary = {"pass@1": report["pass@1"], "pass@1_ci": report["pass@1_ci"], "n": report["n"],
               "pass@1_by_rule": report["pass@1_by_rule"],
               "execution_error_rate": report["execution_error_rate"]}
    return stage_result(ref, summary, t0, run.run_id)
