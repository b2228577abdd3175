"""Champion / challenger decision for scheduled retraining (plain Python: no MLflow, no Prefect).

A challenger replaces the champion only if, on the *same* benchmarks, no benchmark drops by more than
``tolerance`` (absolute Pass@1) and its mean Pass@1 gain clears ``margin``. With both models' per-problem
verdicts (the retrain flow has them), "clears" means the **lower end of the gain's confidence interval**
exceeds the margin: the paired bootstrap over the problems both models were scored on, within each benchmark
(``eval.stats.stratified_paired_difference``), so a gain that noise alone could produce does not replace a
champion. Without verdicts (bare scores), the point gain must reach the margin. Benchmarks that only one side
was scored on are not compared (and named in the reason).

The out-of-distribution split (``synthetic_ood``: families and representations no training set has) is not part
of the mean: it is a guard of its own (``ood``). ``not_worse`` (the default) rejects a challenger that is
significantly worse there -- the upper end of the paired difference's interval below 0 (without verdicts: a drop of
more than ``tolerance``), whatever it gains in distribution; ``ignore`` leaves it out of the decision (it is still
shown).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from eval.stats import DEFAULT_CONFIDENCE, PairedDifference, paired_scores, stratified_paired_difference

Verdicts = dict[str, dict[str, Sequence[bool]]]  # benchmark -> problem id -> the verdicts of its samples
OOD_BENCHMARK = "synthetic_ood"
OOD_RULES = ("not_worse", "ignore")


@dataclass
class Decision:
    promote: bool
    reason: str
    champion_mean: float
    challenger_mean: float
    rows: list[dict] = field(default_factory=list)  # benchmark, champion, challenger, delta
    paired: PairedDifference | None = None  # the gain's paired comparison, when verdicts were given
    ood: PairedDifference | None = None  # challenger - champion on the out-of-distribution split (with verdicts)

    def markdown(self, title: str, champion_label: str, challenger_label: str) -> str:
        verdict = "promoted to champion" if self.promote else "rejected"
        lines = [f"# {title}", "", f"**Challenger {verdict}**: {self.reason}", "",
                 f"| benchmark | champion ({champion_label}) | challenger ({challenger_label}) | Δ |",
                 "|---|---:|---:|---:|"]
        for r in self.rows:
            if r["benchmark"] != OOD_BENCHMARK:
                lines.append(f"| {r['benchmark']} | {r['champion']:.4f} | {r['challenger']:.4f} | {r['delta']:+.4f} |")
        lines.append(f"| **mean** | {self.champion_mean:.4f} | {self.challenger_mean:.4f} | "
                     f"{self.challenger_mean - self.champion_mean:+.4f} |")
        for r in self.rows:  # the guard, below the mean it is not part of
            if r["benchmark"] == OOD_BENCHMARK:
                lines.append(f"| {r['benchmark']} (guard) | {r['champion']:.4f} | {r['challenger']:.4f} | "
                             f"{r['delta']:+.4f} |")
        if self.paired is not None:
            p = self.paired
            lines += ["", f"Paired gain on {p.problems} problems: {p.difference:+.4f}, {p.confidence:.0%} interval "
                      f"[{p.low:+.4f}, {p.high:+.4f}]; share of resamples with no gain {p.p_not_better:.3f} "
                      f"({p.method})."]
        if self.ood is not None:
            o = self.ood
            lines += ["", f"Out of distribution ({OOD_BENCHMARK}, {o.problems} problems): {o.difference:+.4f}, "
                      f"{o.confidence:.0%} interval [{o.low:+.4f}, {o.high:+.4f}]."]
        return "\n".join(lines)


def decide(champion: dict[str, float], challenger: dict[str, float], margin: float, tolerance: float,
           verdicts: tuple[Verdicts, Verdicts] | None = None, confidence: float = DEFAULT_CONFIDENCE,
           ood: str = "not_worse") -> Decision:
    """Compare Pass@1 per benchmark (``{benchmark: pass@1}``) and decide; ``verdicts``: (champion's,
    challenger's) per-problem verdicts, which make the gain a paired comparison with its interval; ``ood``: the
    out-of-distribution guard (module docstring)."""
    if ood not in OOD_RULES:
        raise ValueError(f"unknown out-of-distribution rule {ood!r}: {' or '.join(OOD_RULES)}")
    both = sorted(set(champion) & set(challenger))
    common = [b for b in both if b != OOD_BENCHMARK]
    if not common:
        return Decision(False, "no in-distribution benchmark scored for both models", 0.0, 0.0)
    rows = [{"benchmark": b, "champion": champion[b], "challenger": challenger[b],
             "delta": challenger[b] - champion[b]} for b in both]
    champ_mean = sum(champion[b] for b in common) / len(common)
    chall_mean = sum(challenger[b] for b in common) / len(common)
    gain = chall_mean - champ_mean
    only = sorted(set(champion) ^ set(challenger))
    note = f" (not compared, scored for one side only: {', '.join(only)})" if only else ""
    paired = _paired(common, verdicts, confidence) if verdicts is not None else None
    ood_diff = _paired([OOD_BENCHMARK], verdicts, confidence) \
        if verdicts is not None and OOD_BENCHMARK in both else None

    def done(promote: bool, reason: str) -> Decision:
        return Decision(promote, reason + note, champ_mean, chall_mean, rows, paired, ood_diff)

    regressions = [r for r in rows if r["delta"] < -tolerance and r["benchmark"] != OOD_BENCHMARK]
    if regressions:
        worst = min(regressions, key=lambda r: r["delta"])
        return done(False, f"{worst['benchmark']} regressed by {-worst['delta']:.4f} > tolerance {tolerance:.4f}")
    if ood == "not_worse" and OOD_BENCHMARK in both:
        if ood_diff is not None and ood_diff.high < 0:
            return done(False, f"significantly worse out of distribution ({OOD_BENCHMARK} {ood_diff.difference:+.4f}, "
                               f"{ood_diff.confidence:.0%} interval [{ood_diff.low:+.4f}, {ood_diff.high:+.4f}])")
        drop = champion[OOD_BENCHMARK] - challenger[OOD_BENCHMARK]
        if verdicts is None and drop > tolerance:
            return done(False, f"{OOD_BENCHMARK} dropped by {drop:.4f} > tolerance {tolerance:.4f}")
    if paired is not None:
        interval = f"{paired.confidence:.0%} interval [{paired.low:+.4f}, {paired.high:+.4f}]"
        if not paired.low > margin:
            return done(False, f"mean Pass@1 gain {paired.difference:+.4f}, {interval}: its lower end is not above "
                               f"the margin {margin:.4f} (< margin {margin:.4f} with {paired.confidence:.0%} confidence)")
        return done(True, f"mean Pass@1 gain {paired.difference:+.4f}, {interval} above the margin {margin:.4f}; "
                          f"no benchmark regressed more than {tolerance:.4f}")
    if gain < margin:
        return done(False, f"mean Pass@1 gain {gain:+.4f} < margin {margin:.4f}")
    return done(True, f"mean Pass@1 gain {gain:+.4f} >= margin {margin:.4f}, no benchmark regressed more than "
                      f"{tolerance:.4f}")


def _paired(common: list[str], verdicts: tuple[Verdicts, Verdicts], confidence: float) -> PairedDifference | None:
    """The stratified paired comparison over the benchmarks whose problems both models were judged on (None when
    there is none: every problem unjudged, e.g. unknown ground truths; the point rule then decides)."""
    champ_v, chall_v = verdicts
    groups = {}
    for b in common:
        if b not in champ_v or b not in chall_v:
            raise ValueError(f"paired comparison: no per-problem verdicts of benchmark {b!r} for "
                             f"{'the champion' if b not in champ_v else 'the challenger'}")
        ids, a, c = paired_scores(chall_v[b], champ_v[b])
        if ids:
            groups[b] = (a, c)
    return stratified_paired_difference(groups, confidence) if groups else None
