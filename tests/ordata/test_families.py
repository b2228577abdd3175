import random

import pytest

from eval.sandbox import run_batch
from ordata.families import FAMILIES, get_family
from ordata.ir import Constraint, LinearModel, Var, solve_highs


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_family_renders_solves_and_program_reproduces_optimum(name):
    fam = get_family(name)
    insts = [fam.sample(random.Random(s), size) for s in range(4) for size in (2, 4)]
    results = run_batch([i.program for i in insts])
    for inst, res in zip(insts, results):
        sol = solve_highs(inst.ir)
        assert sol.status == "optimal"
        assert inst.category in fam.categories
        assert res["status"] == "ok", res
        assert abs(res["objective"] - sol.objective) / (abs(sol.objective) + 1) <= 1e-6
        # every number in the program's data appears in the question
        for v in inst.data.values():
            flat = [x for row in v for x in (row if isinstance(row, list) else [row])] if isinstance(v, list) else [v]
            for x in flat:
                if isinstance(x, (int, float)):
                    assert str(x) in inst.question


def test_ir_categories_and_statuses():
    lp = LinearModel("t", "max", [Var("x", 0, 4)], {"x": 1.0}, [])
    assert lp.category == "LP" and solve_highs(lp).objective == 4
    ip = LinearModel("t", "max", [Var("x", 0, 1, "binary")], {"x": 1.0}, [])
    assert ip.category == "IP"
    mixed = LinearModel("t", "min", [Var("x"), Var("y", kind="integer")], {"x": 1, "y": 1},
                        [Constraint("c", {"x": 1, "y": 1}, ">=", 2.5)])
    assert mixed.category == "MILP" and abs(solve_highs(mixed).objective - 2.5) < 1e-9
    infeasible = LinearModel("t", "min", [Var("x", 0, 1)], {"x": 1}, [Constraint("c", {"x": 1}, ">=", 2)])
    assert solve_highs(infeasible).status == "infeasible"
    unbounded = LinearModel("t", "max", [Var("x")], {"x": 1}, [])
    assert solve_highs(unbounded).status in ("unbounded", "unbounded or infeasible")


def test_unknown_family():
    with pytest.raises(KeyError, match="unknown problem family 'nope'"):
        get_family("nope")
