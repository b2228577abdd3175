"""Several models side by side over benchmarks: Pass@1 with intervals and paired differences to a baseline.

Input: each model's evaluation results -- a directory holding ``samples.jsonl`` (one benchmark, e.g. a
lifecycle ``eval/<key>/`` stage directory) or a directory of such directories (``trex eval run --out OUT``
writes ``OUT/<benchmark>/``). Rows are read as the harness wrote them (:func:`eval.harness.read_samples`);
each benchmark's Pass@1 is the mean over problems of their share of correct samples, with the interval of
:func:`eval.stats.pass_rate`. A model is compared with the baseline (the first model) on the problems both
were judged on, per benchmark and over the benchmarks' mean (:func:`eval.stats.paired_difference`,
:func:`eval.stats.stratified_paired_difference`).

The column order follows the reference report's results table (NL4OPT, OptiBench, B4O-Feasible,
B4O-ORGEval), then any other benchmark, alphabetically.
"""

from __future__ import annotations

from pathlib import Path

from eval.harness import SAMPLES, problem_verdicts, read_samples
from eval.stats import DEFAULT_CONFIDENCE, paired_difference, paired_scores, pass_rate, stratified_paired_difference

REFERENCE_ORDER = ("nl4opt", "optibench", "b4o-feasible", "b4o-orgeval")
OOD = "synthetic_ood"  # the out-of-distribution held-out split: its own column, not in the mean (a guard)
Results = dict[str, dict[str, list[bool]]]  # benchmark -> problem id -> verdicts of its samples


def load_results(path: str | Path) -> Results:
    """``{benchmark: {problem id: verdicts}}`` of one model's results directory (see the module docstring)."""
    root = Path(path)
    if (root / SAMPLES).is_file():
        dirs = [root]
    else:
        dirs = sorted(d for d in root.iterdir() if (d / SAMPLES).is_file()) if root.is_dir() else []
    if not dirs:
        raise FileNotFoundError(f"{root}: no {SAMPLES} here or in its subdirectories")
    out: Results = {}
    for d in dirs:
        rows = read_samples(d)
        for bench in sorted({r["benchmark"] for r in rows}):
            verdicts = {k.split("/", 1)[1]: v for k, v in
                        problem_verdicts([r for r in rows if r["benchmark"] == bench]).items()}
            if bench in out:
                raise ValueError(f"{d}: benchmark {bench!r} appears in two result directories of {root}")
            out[bench] = verdicts
    return out


def merge_results(a: Results, b: Results, where: str) -> Results:
    """One model's results from two directories (e.g. a lifecycle's held-out and out-of-distribution evaluations);
    a benchmark in both is an error naming ``where``."""
    both = sorted(set(a) & set(b))
    if both:
        raise ValueError(f"{where}: benchmark {both[0]!r} is already in this model's other results")
    return {**a, **b}


def benchmark_order(names: set[str]) -> list[str]:
    """The reference's columns first, then the others alphabetically; the out-of-distribution split last."""
    ood = [OOD] if OOD in names else []
    names = names - {OOD}
    return [b for b in REFERENCE_ORDER if b in names] + sorted(names - set(REFERENCE_ORDER)) + ood


def compare(models: dict[str, Results], confidence: float = DEFAULT_CONFIDENCE) -> dict:
    """The comparison table: per model and benchmark the Pass@1 estimate; per model after the first, the paired
    difference to the first on each benchmark both have and on their mean."""
    if not models:
        raise ValueError("compare: no models")
    names = list(models)
    baseline = names[0]
    benches = benchmark_order({b for r in models.values() for b in r})
    table: dict = {"baseline": baseline, "benchmarks": benches, "confidence": confidence, "models": {}}
    for name in names:
        res = models[name]
        cells = {b: pass_rate(list(res[b].values()), confidence).as_dict() for b in benches if res.get(b)}
        in_dist = [c["value"] for b, c in cells.items() if b != OOD] or [c["value"] for c in cells.values()]
        row: dict = {"pass@1": cells, "mean": sum(in_dist) / len(in_dist) if in_dist else None}
        if name != baseline:
            base = models[baseline]
            common = [b for b in benches if res.get(b) and base.get(b)]
            diffs, groups = {}, {}
            for b in common:
                ids, a, c = paired_scores(res[b], base[b])
                if ids:
                    diffs[b] = paired_difference(a, c, confidence).as_dict()
                    groups[b] = (a, c)
            if len(groups) > 1:  # the mean's paired difference, like the mean, is over the in-distribution ones
                groups.pop(OOD, None)
            row["vs_baseline"] = diffs
            row["mean_vs_baseline"] = stratified_paired_difference(groups, confidence).as_dict() if groups else None
        table["models"][name] = row
    return table


def _pct(x: float) -> str:
    return f"{100 * x:.1f}"


def markdown(table: dict) -> str:
    """The table as Markdown: ``Pass@1 [low, high]`` in percent per cell; below, each model's paired
    difference to the baseline (points, with its interval)."""
    benches, conf = table["benchmarks"], table["confidence"]
    title = f"Pass@1 (%) with {conf:.0%} intervals"
    if OOD in benches and len(benches) > 1:
        title += f"; mean over the in-distribution benchmarks ({OOD}: out of distribution, not in the mean)"
    lines = [title, "",
             "| model | " + " | ".join(benches) + " | mean |", "|---|" + "---:|" * (len(benches) + 1)]
    for name, row in table["models"].items():
        cells = [f"{_pct(c['value'])} [{_pct(c['low'])}, {_pct(c['high'])}]" if (c := row["pass@1"].get(b)) else "–"
                 for b in benches]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {_pct(row['mean']) if row['mean'] is not None else '–'} |")
    others = [(n, r) for n, r in table["models"].items() if n != table["baseline"]]
    if others:
        lines += ["", f"Paired difference to {table['baseline']} (points, {conf:.0%} interval; problems both were "
                  "judged on)", "", "| model | " + " | ".join(benches) + " | mean |",
                  "|---|" + "---:|" * (len(benches) + 1)]
        for name, row in others:
            cells = [_diff(row["vs_baseline"].get(b)) for b in benches]
            lines.append(f"| {name} | " + " | ".join(cells) + f" | {_diff(row['mean_vs_baseline'])} |")
    return "\n".join(lines)


def _diff(d: dict | None) -> str:
    if not d:
        return "–"
    mark = " *" if d["low"] > 0 or d["high"] < 0 else ""  # the interval excludes 0
    return f"{100 * d['difference']:+.1f} [{100 * d['low']:+.1f}, {100 * d['high']:+.1f}]{mark}"


def promotion(table: dict, challenger: str, benchmark: str, rule: str) -> tuple[bool, str]:
    """Whether ``challenger`` replaces the table's baseline by the paired comparison on ``benchmark``: ``not_worse``
    (its interval's upper end is not below 0: not significantly worse), ``better`` (its lower end is above 0) or
    ``always``; and why, with the difference and its interval."""
    base = table["baseline"]
    d = (table["models"][challenger].get("vs_baseline") or {}).get(benchmark)
    if rule == "always":
        return True, "promote=always"
    if d is None:
        return False, f"no paired comparison of {challenger} and {base} on {benchmark}: {base} kept"
    what = (f"{challenger} - {base} on {benchmark}: {d['difference']:+.3f} [{d['low']:+.3f}, {d['high']:+.3f}] "
            f"({d['problems']} problems, {d['confidence']:.0%})")
    if rule == "better":
        return (True, f"{what}: significantly better") if d["low"] > 0 else (False, f"{what}: not significantly better")
    if rule == "not_worse":
        return (True, f"{what}: not significantly worse") if d["high"] >= 0 else (False, f"{what}: significantly worse")
    raise ValueError(f"unknown promotion rule {rule!r}: not_worse, better or always")
