"""Champion / challenger decision for scheduled retraining (plain Python: no MLflow, no Prefect).

A challenger replaces the champion only if, on the *same* benchmarks, no benchmark drops by more than
``tolerance`` (absolute Pass@1) and its mean Pass@1 gain clears ``margin``. With both models' per-problem
verdicts (the retrain flow has them), "clears" means the **lower end of the gain's confidence interval**
exceeds the margin: the paired bootstrap over the problems both models were scored on, within each benchmark
(``eval.stats.stratified_paired_difference``), so a gain that noise alone could produce does not replace a
champion. Without verdicts (bare scores), the point gain must reach the margin. Benchmarks that only one side
was scored on are not compared (and named in the reason).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from eval.stats import DEFAULT_CONFIDENCE, PairedDifference, paired_scores, stratified_paired_difference

Verdicts = dict[str, dict[str, Sequence[bool]]]  # benchmark -> problem id -> the verdicts of its samples


@dataclass
class Decision:
    promote: bool
    reason: str
    champion_mean: float
    challenger_mean: float
    rows: list[dict] = field(default_factory=list)  # benchmark, champion, challenger, delta
    paired: PairedDifference | None = None  # the gain's paired comparison, when verdicts were given

    def markdown(self, title: str, champion_label: str, challenger_label: str) -> str:
        verdict = "promoted to champion" if self.promote else "rejected"
        lines = [f"# {title}", "", f"**Challenger {verdict}**: {self.reason}", "",
                 f"| benchmark | champion ({champion_label}) | challenger ({challenger_label}) | Δ |",
                 "|---|---:|---:|---:|"]
        for r in self.rows:
            lines.append(f"| {r['benchmark']} | {r['champion']:.4f} | {r['challenger']:.4f} | {r['delta']:+.4f} |")
        lines.append(f"| **mean** | {self.champion_mean:.4f} | {self.challenger_mean:.4f} | "
                     f"{self.challenger_mean - self.champion_mean:+.4f} |")
        if self.paired is not None:
            p = self.paired
            lines += ["", f"Paired gain on {p.problems} problems: {p.difference:+.4f}, {p.confidence:.0%} interval "
                      f"[{p.low:+.4f}, {p.high:+.4f}]; share of resamples with no gain {p.p_not_better:.3f} "
                      f"({p.method})."]
        return "\n".join(lines)


def decide(champion: dict[str, float], challenger: dict[str, float], margin: float, tolerance: float,
           verdicts: tuple[Verdicts, Verdicts] | None = None, confidence: float = DEFAULT_CONFIDENCE) -> Decision:
    """Compare Pass@1 per benchmark (``{benchmark: pass@1}``) and decide; ``verdicts``: (champion's,
    challenger's) per-problem verdicts, which make the gain a paired comparison with its interval."""
    common = sorted(set(champion) & set(challenger))
    if not common:
        return Decision(False, "no benchmark scored for both models", 0.0, 0.0)
    rows = [{"benchmark": b, "champion": champion[b], "challenger": challenger[b],
             "delta": challenger[b] - champion[b]} for b in common]
    champ_mean = sum(champion[b] for b in common) / len(common)
    chall_mean = sum(challenger[b] for b in common) / len(common)
    gain = chall_mean - champ_mean
    only = sorted(set(champion) ^ set(challenger))
    note = f" (not compared, scored for one side only: {', '.join(only)})" if only else ""
    paired = _paired(common, verdicts, confidence) if verdicts is not None else None
    regressions = [r for r in rows if r["delta"] < -tolerance]
    if regressions:
        worst = min(regressions, key=lambda r: r["delta"])
        return Decision(False, f"{worst['benchmark']} regressed by {-worst['delta']:.4f} > tolerance {tolerance:.4f}"
                        + note, champ_mean, chall_mean, rows, paired)
    if paired is not None:
        interval = f"{paired.confidence:.0%} interval [{paired.low:+.4f}, {paired.high:+.4f}]"
        if not paired.low > margin:
            return Decision(False, f"mean Pass@1 gain {paired.difference:+.4f}, {interval}: its lower end is not above "
                            f"the margin {margin:.4f} (< margin {margin:.4f} with {paired.confidence:.0%} "
                            f"confidence)" + note, champ_mean, chall_mean, rows, paired)
        return Decision(True, f"mean Pass@1 gain {paired.difference:+.4f}, {interval} above the margin {margin:.4f}; "
                        f"no benchmark regressed more than {tolerance:.4f}" + note, champ_mean, chall_mean, rows,
                        paired)
    if gain < margin:
        return Decision(False, f"mean Pass@1 gain {gain:+.4f} < margin {margin:.4f}" + note, champ_mean, chall_mean,
                        rows)
    return Decision(True, f"mean Pass@1 gain {gain:+.4f} >= margin {margin:.4f}, no benchmark regressed more than "
                    f"{tolerance:.4f}" + note, champ_mean, chall_mean, rows)


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
