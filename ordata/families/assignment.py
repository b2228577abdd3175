"""Assignment: one task per worker at minimum total cost (binary IP)."""

from __future__ import annotations

import random

from ordata.families.base import Family, Spec, join, model_code
from ordata.ir import Constraint, OptModel, Var
from ordata.params import Param

SCENARIOS = [("technicians", "repair jobs", "hours"), ("nurses", "wards", "hours of overtime"),
             ("trucks", "routes", "litres of fuel"), ("translators", "documents", "hours")]
PEOPLE = ["Ana", "Ben", "Chen", "Dina", "Eli", "Fay", "Gus", "Hana"]
JOBS = ["J1", "J2", "J3", "J4", "J5", "J6", "J7", "J8"]

MATH = (
    "**Sets:** workers $i$, tasks $j$.\n"
    "**Parameters:** cost $c_{ij}$.\n"
    "**Variables:** $x_{ij} \\in \\{0,1\\}$, 1 if worker $i$ does task $j$.\n"
    "**Objective:** $\\min \\sum_{i,j} c_{ij} x_{ij}$.\n"
    "**Constraints:** $\\sum_j x_{ij} = 1$ for all $i$; $\\sum_i x_{ij} = 1$ for all $j$.\n"
)
HIGHSPY = (
    "h = highspy.Highs()\nh.silent()\n"
    "n = len(cost)\n"
    "x = [[h.addBinary() for _ in range(n)] for _ in range(n)]\n"
    "for i in range(n):\n"
    "    h.addConstr(sum(x[i][j] for j in range(n)) == 1)\n"
    "for j in range(n):\n"
    "    h.addConstr(sum(x[i][j] for i in range(n)) == 1)\n"
    "h.minimize(sum(cost[i][j] * x[i][j] for i in range(n) for j in range(n)))\n"
)
PYOMO = (
    "m = pyo.ConcreteModel()\n"
    "N = range(len(cost))\n"
    "m.x = pyo.Var(N, N, domain=pyo.Binary)\n"
    "m.worker = pyo.Constraint(N, rule=lambda m, i: sum(m.x[i, j] for j in N) == 1)\n"
    "m.task = pyo.Constraint(N, rule=lambda m, j: sum(m.x[i, j] for i in N) == 1)\n"
    "m.obj = pyo.Objective(expr=sum(cost[i][j] * m.x[i, j] for i in N for j in N), sense=pyo.minimize)\n"
)

GUROBI = (
    "n = len(cost)\n"
    "x = m.addVars(n, n, vtype=GRB.BINARY)\n"
    "m.addConstrs(gp.quicksum(x[i, j] for j in range(n)) == 1 for i in range(n))\n"
    "m.addConstrs(gp.quicksum(x[i, j] for i in range(n)) == 1 for j in range(n))\n"
    "m.setObjective(gp.quicksum(cost[i][j] * x[i, j] for i in range(n) for j in range(n)), GRB.MINIMIZE)\n"
)

class Assignment(Family):
    name = "assignment"
    categories = ("IP",)

    def sample(self, rng: random.Random, size: int, category: str | None = None, infeasible: bool = False) -> Spec:
        self._category(rng, category)
        who, what, unit = rng.choice(SCENARIOS)
        n = size + 1
        people, jobs = rng.sample(PEOPLE, n), JOBS[:n]
        cost = [[rng.randint(3, 40) for _ in jobs] for _ in people]
        var = [Var(f"x_{i}_{j}", 0, 1, "binary") for i in range(n) for j in range(n)]
        cons = [Constraint(f"w_{i}", {f"x_{i}_{j}": 1 for j in range(n)}, "==", 1) for i in range(n)]
        cons += [Constraint(f"t_{j}", {f"x_{i}_{j}": 1 for i in range(n)}, "==", 1) for j in range(n)]
        ir = OptModel(self.name, "min", var, {f"x_{i}_{j}": cost[i][j] for i in range(n) for j in range(n)}, cons)
        params = [Param("cost", f"cost ({unit})", cost, people, jobs,
                        phrase=f"{{label}} would need, in {unit}: {{values}}.")]
        story = f"A manager assigns {n} {who} ({join(people)}) to {n} {what} ({join(jobs)}), one each."
        ask = f"Every {what[:-1]} needs exactly one of the {who}. What is the minimum total cost in {unit}?"
        code = model_code(HIGHSPY, PYOMO, GUROBI)
        return Spec(self.name, story, params, ask, ir, MATH, code)
