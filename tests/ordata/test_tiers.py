"""Difficulty tiers (ordata/tiers.py): read off the IR, carried by every curated row, reported per tier."""

from __future__ import annotations

import random
from collections import Counter

from ordata.families import FAMILIES
from ordata.ir import Constraint, OptModel, Var
from ordata.tiers import TIERS, difficulty


def _model(n: int, kind: str = "continuous", link: bool = False) -> OptModel:
    vs = [Var(f"x{i}", kind=kind) for i in range(n)]
    cons = [Constraint(f"c{i}", {f"x{i}": 1, f"x{i + 1}": 1}, "<=", 5) for i in range(n - 1)]
    if link:
        vs.append(Var("y", 0, 1, "binary"))
        cons.append(Constraint("open", {"x0": 1, "y": -10}, "<=", 0))
    return OptModel("t", "max", vs, {v.name: 1 for v in vs}, cons)


def test_scores_and_tiers_by_hand():
    assert difficulty(_model(3)) == {"tier": "easy", "size": 0, "integrality": 0, "coupling": 0}
    assert difficulty(_model(30))["tier"] == "medium"  # big but continuous
    assert difficulty(_model(3, "integer"))["tier"] == "easy"
    assert difficulty(_model(12, "integer"))["tier"] == "medium"
    linked = difficulty(_model(12, link=True))  # continuous flows opened by a binary: a coupling constraint
    assert linked == {"tier": "hard", "size": 1, "integrality": 1, "coupling": 1}
    dense = OptModel("k", "max", [Var(f"y{i}", 0, 1, "binary") for i in range(7)], {f"y{i}": 1 for i in range(7)},
                     [Constraint("cap", {f"y{i}": 2 for i in range(7)}, "<=", 5)])
    assert difficulty(dense) == {"tier": "medium", "size": 0, "integrality": 1, "coupling": 1}


def test_the_families_span_every_tier_and_the_size_knob_moves_it():
    tiers: Counter = Counter()
    for fam in FAMILIES.values():
        for cat in fam.categories:
            small = [difficulty(fam.sample(random.Random(s), 2, cat).ir) for s in range(3)]
            large = [difficulty(fam.sample(random.Random(s), 4, cat).ir) for s in range(3)]
            tiers.update(d["tier"] for d in small + large)
            assert max(d["size"] for d in large) >= max(d["size"] for d in small), fam.name
    assert set(tiers) == set(TIERS), tiers


def test_curated_rows_and_the_report_carry_the_tier():
    from eval.harness import build_report
    from ordata.curate import build_attempts
    from trex.core.config import DataConfig, EvalConfig

    cfg = DataConfig(families=["knapsack", "facility"], min_size=2, max_size=4)
    rows = build_attempts(cfg, "eval", 0, 8)
    assert all(r["tier"] == difficulty(_ir_of(r, cfg))["tier"] for r in rows[:2])
    assert all(r["tier"] in TIERS for r in rows)
    samples = [{"benchmark": "synthetic", "id": r["id"], "sample": 0, "tier": r["tier"], "family": r["family"],
                "category": r["category"], "representation": r["representation"], "outcome": "ok",
                "verdicts": {"rel": i % 2 == 0, "abs": True, "orlm": True}} for i, r in enumerate(rows)]
    report = build_report(samples, EvalConfig())
    assert sum(v["n"] for v in report["per_tier"].values()) == len(rows)
    assert set(report["per_tier_pass@1"]) == {r["tier"] for r in rows}


def _ir_of(row: dict, cfg) -> OptModel:
    """The IR of a built row, sampled again from its attempt's seed (build_attempts is a pure function)."""
    from ordata.curate import _rng, cell_schedule, grid

    attempt = int(row["id"].split("-")[1])
    cells = grid(cfg)
    order, rank = cell_schedule(cfg, cells)
    category, _, fams = cells[order[attempt % len(order)]]
    fam = next(f for f in fams if f.name == row["family"])
    rng = _rng(cfg.seed, "eval", attempt)
    return fam.sample(rng, rng.randint(cfg.min_size, cfg.max_size), category).ir
