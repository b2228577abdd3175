"""Judging one executed program against the ground truth, under three rules reported side by side.

- ``rel`` (T-Rex's rule): ``|p - g| / (|g| + 1) <= 1e-6`` — scale-aware, exact to solver precision for large
  and small objectives alike;
- ``abs`` (the reference system's rule): ``|p - g| <= 1e-6`` — strict for large objectives (an optimum of
  1e7 printed with 7 significant digits fails), lenient for tiny ones;
- ``orlm`` (ORLM-style): both rounded to 2 decimals, then ``|p - g| <= 0.05 * |g|`` (exact when ``g == 0``)
  — forgiving (a 5 % error passes), as published numbers with that rule are.

A problem whose ground truth is "infeasible" passes only when the last attested solve proved infeasibility
(``infeasible_or_unbounded`` does not pass). Timeouts, errors, limits and programs that solved nothing
fail under every rule. Items whose truth is unknown are not judged (counted separately).
"""

from __future__ import annotations

import math

RULES = ("rel", "abs", "orlm")
# bumped whenever a rule (or how a pass is decided) changes; part of every run fingerprint
SCORING_VERSION = 1
REL_TOL = 1e-6
ABS_TOL = 1e-6
ORLM_TOL = 0.05


def objective_passes(pred: float | None, truth: float, rule: str, tol: float | None = None) -> bool:
    if pred is None or not math.isfinite(pred):
        return False
    if rule == "rel":
        return abs(pred - truth) / (abs(truth) + 1.0) <= (REL_TOL if tol is None else tol)
    if rule == "abs":
        return abs(pred - truth) <= (ABS_TOL if tol is None else tol)
    if rule == "orlm":
        p, g = round(pred, 2), round(truth, 2)
        return p == g if g == 0 else abs(p - g) <= (ORLM_TOL if tol is None else tol) * abs(g)
    raise ValueError(f"unknown rule {rule!r}: choose {', '.join(RULES)}")


def verdicts(objective: float | None, reported: str | None, truth: float | None, truth_status: str,
             rel_tol: float = REL_TOL) -> dict[str, bool] | None:
    """``{rule: passed}`` for one executed program, or None when the truth is unknown (not judged)."""
    if truth_status == "infeasible":
        ok = reported == "infeasible"
        return {r: ok for r in RULES}
    if truth_status != "optimal" or truth is None:
        return None
    if reported != "optimal":
        return {r: False for r in RULES}
    return {r: objective_passes(objective, truth, r, rel_tol if r == "rel" else None) for r in RULES}


def is_pass(pred: float | None, truth: float, rel_tol: float) -> bool:
    return objective_passes(pred, truth, "rel", rel_tol)


def is_correct(objective: float | None, reported: str | None, truth: float | None, truth_status: str,
               rel_tol: float) -> bool:
    """An optimal problem needs the optimum within ``rel_tol``; an infeasible one needs 'infeasible' reported."""
    v = verdicts(objective, reported, truth, truth_status, rel_tol)
    return bool(v and v["rel"])
