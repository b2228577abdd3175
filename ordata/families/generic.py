"""Generic LP / MIP in algebraic form: objective coefficients, constraint matrix, right-hand sides."""

from __future__ import annotations

import random

from ordata.families.base import Family, Spec, model_code
from ordata.ir import Constraint, OptModel, Var
from ordata.params import Param

MATH = (
    "**Sets:** variables $j$, constraints $i$.\n"
    "**Parameters:** objective $c_j$, coefficients $a_{ij}$, right-hand side $b_i$.\n"
    "**Variables:** $x_j \\ge 0${integral}.\n"
    "**Objective:** $\\max \\sum_j c_j x_j$.\n"
    "**Constraints:** $\\sum_j a_{ij} x_j \\le b_i$ for every $i$.\n"
)
HIGHSPY = (
    "h = highspy.Highs()\nh.silent()\n"
    "J = range(len(objective))\n"
    "x = [h.addVariable(lb=0, type=highspy.HighsVarType.kInteger if integer[j] else highspy.HighsVarType.kContinuous)\n"
    "     for j in J]\n"
    "for row, limit in zip(coefficients, rhs):\n"
    "    h.addConstr(sum(row[j] * x[j] for j in J) <= limit)\n"
    "h.maximize(sum(objective[j] * x[j] for j in J))\n"
)
PYOMO = (
    "m = pyo.ConcreteModel()\n"
    "J, I = range(len(objective)), range(len(rhs))\n"
    "m.x = pyo.Var(J, domain=lambda m, j: pyo.NonNegativeIntegers if integer[j] else pyo.NonNegativeReals)\n"
    "m.c = pyo.Constraint(I, rule=lambda m, i: sum(coefficients[i][j] * m.x[j] for j in J) <= rhs[i])\n"
    "m.obj = pyo.Objective(expr=sum(objective[j] * m.x[j] for j in J), sense=pyo.maximize)\n"
)

GUROBI = (
    "J = range(len(objective))\n"
    "x = m.addVars(len(objective), lb=0, vtype=[GRB.INTEGER if integer[j] else GRB.CONTINUOUS for j in J])\n"
    "for row, limit in zip(coefficients, rhs):\n"
    "    m.addConstr(gp.quicksum(row[j] * x[j] for j in J) <= limit)\n"
    "m.setObjective(gp.quicksum(objective[j] * x[j] for j in J), GRB.MAXIMIZE)\n"
)

class Generic(Family):
    name = "generic"
    categories = ("LP", "MILP")

    def sample(self, rng: random.Random, size: int, category: str | None = None, infeasible: bool = False) -> Spec:
        cat = self._category(rng, category)
        n, m = size + 1, size
        names = [f"x{j + 1}" for j in range(n)]
        c = [rng.randint(1, 20) for _ in names]
        a = [[rng.randint(1, 12) for _ in names] for _ in range(m)]
        b = [rng.randint(20, 120) for _ in range(m)]
        if cat == "MILP":
            integer = [1 if j % 2 == 0 else 0 for j in range(n)]
        else:
            integer = [0] * n
        var = [Var(f"x_{j}", kind="integer" if integer[j] else "continuous") for j in range(n)]
        cons = [Constraint(f"c_{i}", {f"x_{j}": a[i][j] for j in range(n)}, "<=", b[i]) for i in range(m)]
        ir = OptModel(self.name, "max", var, {f"x_{j}": c[j] for j in range(n)}, cons)
        rows = [f"constraint {i + 1}" for i in range(m)]
        params = [
            Param("objective", "objective coefficient", c, names),
            Param("coefficients", "constraint coefficients", a, rows, names, phrase="In {label} the coefficients are: {values}."),
            Param("rhs", "right-hand side (upper limit)", b, rows),
            Param("integer", "integrality flag (1: integer)", integer, names),
        ]
        story = f"Consider a linear program in {n} non-negative variables {', '.join(names)} with {m} '<=' constraints."
        ask = "Variables flagged 1 must take integer values. What is the maximum objective value?"
        code = model_code(HIGHSPY, PYOMO, GUROBI)
        return Spec(self.name, story, params, ask, ir, MATH.replace("{integral}", ", some integer" if cat == "MILP" else ""),
                    code, {"objective": "variable"})
