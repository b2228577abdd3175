import json
import os
import random

import pytest

from eval.sandbox import preload_for, run_programs


def run_batch(programs, api="highspy"):
    return run_programs(programs, 30, 4096, preload=preload_for([api]))
from ordata.families import APIS, FAMILIES, get_family
from ordata.params import REPRESENTATIONS
from ordata.ir import Constraint, OptModel, Var, solve_highs


FULL = [(f, c, r, a) for f, fam in sorted(FAMILIES.items()) for c in fam.categories
        for r in REPRESENTATIONS for a in APIS]


def representative(full: list[tuple[str, str, str, str]]) -> list[tuple[str, str, str, str]]:
    """Two (representation, API) pairs per family x category, rotating, so that every family, category,
    representation, API and representation x API pair runs at least once: ``make test``'s share of the matrix
    (``make test-matrix``, TREX_FULL_MATRIX=1, runs all of it)."""
    cells = sorted({(f, c) for f, c, _, _ in full})
    reps, apis = REPRESENTATIONS, APIS
    return [(f, c, reps[(i + k) % len(reps)], apis[(i + 2 * k + i // len(reps)) % len(apis)])
            for i, (f, c) in enumerate(cells) for k in (0, 1)]


CASES = FULL if os.environ.get("TREX_FULL_MATRIX") else representative(FULL)


def test_the_representative_matrix_covers_every_family_category_representation_and_api():
    sub = representative(FULL)
    for pos in range(4):
        assert {c[pos] for c in sub} == {c[pos] for c in FULL}
    assert {(f, c) for f, c, _, _ in sub} == {(f, c) for f, c, _, _ in FULL}
    assert {(r, a) for _, _, r, a in sub} == {(r, a) for r in REPRESENTATIONS for a in APIS}
    assert set(sub) <= set(FULL) and len(sub) < len(FULL) / 3


@pytest.mark.parametrize("name, category, rep, api", CASES)
def test_every_family_category_representation_and_api_verifies(name, category, rep, api):
    fam = get_family(name)
    specs = [fam.sample(random.Random(s), size, category) for s in range(3) for size in (2, 3)]
    rendered = [s.render(rep, api) for s in specs]
    results = run_batch([{"code": r.program, "files": {k: v.decode() for k, v in r.files.items()}} for r in rendered],
                        api)
    for spec, r, res in zip(specs, rendered, results):
        assert spec.category == category
        sol = solve_highs(spec.ir)
        assert sol.status == "optimal"
        assert res.status == "ok", (res, r.program)
        assert abs(res.objective - sol.objective) / (abs(sol.objective) + 1) <= 1e-6  # the attested solve
        numbers = [x for p in spec.params for x in _flat(p.values)]
        if rep == "DPS":
            assert set(r.files) == {"data.json"} and json.loads(r.files["data.json"]) == spec.data
            assert "data.json" in r.question and 'open("data.json")' in r.program
        else:
            assert not r.files
            for x in numbers:  # every number the program uses is stated in the question
                assert str(x) in r.question
        if rep == "DT":
            assert "|---|" in r.question


def _flat(v):
    if isinstance(v, list):
        for x in v:
            yield from _flat(x)
    else:
        yield v


def test_dps_program_needs_its_data_file():
    spec = get_family("knapsack").sample(random.Random(0), 3)
    r = spec.render("DPS")
    res = run_batch([r.program, {"code": r.program, "files": {k: v.decode() for k, v in r.files.items()}}])
    assert res[0].status == "error" and "data.json" in res[0].stderr_tail
    assert res[1].status == "ok"


def test_family_refuses_a_category_it_cannot_produce():
    with pytest.raises(ValueError, match="cannot produce NLP"):
        get_family("knapsack").sample(random.Random(0), 3, "NLP")
    with pytest.raises(ValueError, match="unknown representation"):
        get_family("knapsack").sample(random.Random(0), 3).render("XX")


def test_ir_categories_and_statuses():
    lp = OptModel("t", "max", [Var("x", 0, 4)], {"x": 1.0}, [])
    assert lp.category == "LP" and solve_highs(lp).objective == 4
    ip = OptModel("t", "max", [Var("x", 0, 1, "binary")], {"x": 1.0}, [])
    assert ip.category == "IP"
    mixed = OptModel("t", "min", [Var("x"), Var("y", kind="integer")], {"x": 1, "y": 1},
                        [Constraint("c", {"x": 1, "y": 1}, ">=", 2.5)])
    assert mixed.category == "MILP" and abs(solve_highs(mixed).objective - 2.5) < 1e-9
    infeasible = OptModel("t", "min", [Var("x", 0, 1)], {"x": 1}, [Constraint("c", {"x": 1}, ">=", 2)])
    assert solve_highs(infeasible).status == "infeasible"
    unbounded = OptModel("t", "max", [Var("x")], {"x": 1}, [])
    assert solve_highs(unbounded).status in ("unbounded", "unbounded or infeasible")


def test_unknown_family():
    with pytest.raises(KeyError, match="unknown problem family 'nope'"):
        get_family("nope")


def test_convex_qp_min_and_max_and_separate_process_solving():
    from ordata.ir import solve_many

    # min x^2 + y^2 - xy  s.t. x + y >= 2  ->  x = y = 1, objective 1
    qp = OptModel("qp", "min", [Var("x"), Var("y")], {}, [Constraint("c", {"x": 1, "y": 1}, ">=", 2)],
                  [("x", "x", 1.0), ("y", "y", 1.0), ("x", "y", -1.0)])
    # max 3x - x^2  ->  x = 1.5, objective 2.25
    concave = OptModel("qp2", "max", [Var("x", 0, 10)], {"x": 3.0}, [], [("x", "x", -1.0)])
    assert qp.category == "NLP"
    a, b = solve_highs(qp), solve_highs(concave)
    assert abs(a.objective - 1.0) < 1e-6 and abs(b.objective - 2.25) < 1e-6 and abs(b.values["x"] - 1.5) < 1e-5
    bad = OptModel("bad", "min", [Var("z", kind="integer")], {}, [], [("z", "z", 1.0)])
    many = solve_many([qp, concave, bad], workers=2)
    assert [r.status for r in many[:2]] == ["optimal", "optimal"] and many[2].status.startswith("error")
    assert abs(many[1].objective - 2.25) < 1e-6


INFEASIBLE_CASES = [(f, c, a) for f, fam in sorted(FAMILIES.items()) if fam.infeasible_variants
                    for c in fam.categories for a in APIS]


def test_infeasible_variants_cover_every_category():
    assert {c for _, c, _ in INFEASIBLE_CASES} == {"LP", "IP", "MILP", "NLP"}


@pytest.mark.parametrize("name, category, api", INFEASIBLE_CASES)
def test_infeasible_variant_is_proven_infeasible_and_its_program_says_so(name, category, api):
    fam = get_family(name)
    specs = [fam.sample(random.Random(s), size, category, infeasible=True) for s in range(3) for size in (2, 3)]
    rendered = [s.render("DPS", api) for s in specs]
    results = run_batch([{"code": r.program, "files": {k: v.decode() for k, v in r.files.items()}} for r in rendered],
                        api)
    for spec, r, res in zip(specs, rendered, results):
        assert solve_highs(spec.ir).status == "infeasible"
        assert res.status == "ok" and res.reported == "infeasible" and res.objective is None, (res, r.program)
