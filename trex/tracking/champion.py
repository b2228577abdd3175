"""Champion / challenger decision for scheduled retraining (plain Python: no MLflow, no Prefect).

A challenger replaces the champion only if, on the *same* benchmarks, its mean Pass@1 is higher by at least
``margin`` and no benchmark drops by more than ``tolerance`` (absolute Pass@1). Benchmarks that only one side
was scored on are not compared (and named in the reason).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Decision:
    promote: bool
    reason: str
    champion_mean: float
    challenger_mean: float
    rows: list[dict] = field(default_factory=list)  # benchmark, champion, challenger, delta

    def markdown(self, title: str, champion_label: str, challenger_label: str) -> str:
        verdict = "promoted to champion" if self.promote else "rejected"
        lines = [f"# {title}", "", f"**Challenger {verdict}**: {self.reason}", "",
                 f"| benchmark | champion ({champion_label}) | challenger ({challenger_label}) | Δ |",
                 "|---|---:|---:|---:|"]
        for r in self.rows:
            lines.append(f"| {r['benchmark']} | {r['champion']:.4f} | {r['challenger']:.4f} | {r['delta']:+.4f} |")
        lines.append(f"| **mean** | {self.champion_mean:.4f} | {self.challenger_mean:.4f} | "
                     f"{self.challenger_mean - self.champion_mean:+.4f} |")
        return "\n".join(lines)


def decide(champion: dict[str, float], challenger: dict[str, float], margin: float, tolerance: float) -> Decision:
    """Compare Pass@1 per benchmark (``{benchmark: pass@1}``) and decide."""
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
    regressions = [r for r in rows if r["delta"] < -tolerance]
    if regressions:
        worst = min(regressions, key=lambda r: r["delta"])
        return Decision(False, f"{worst['benchmark']} regressed by {-worst['delta']:.4f} > tolerance {tolerance:.4f}"
                        + note, champ_mean, chall_mean, rows)
    if gain < margin:
        return Decision(False, f"mean Pass@1 gain {gain:+.4f} < margin {margin:.4f}" + note, champ_mean, chall_mean,
                        rows)
    return Decision(True, f"mean Pass@1 gain {gain:+.4f} >= margin {margin:.4f}, no benchmark regressed more than "
                    f"{tolerance:.4f}" + note, champ_mean, chall_mean, rows)
