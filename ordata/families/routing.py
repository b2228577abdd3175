"""Routing: the shortest tour visiting every location once (TSP, MTZ subtour elimination; IP)."""

from __future__ import annotations

import math
import random

from ordata.families.base import Family, Spec, join, model_code
from ordata.ir import Constraint, OptModel, Var
from ordata.params import Param

SCENARIOS = [("delivery driver", "customers", "km"), ("technician", "sites", "km"), ("drone", "inspection points", "minutes")]
PLACES = ["depot", "Ash", "Birch", "Cedar", "Dale", "Elm", "Fern", "Gale"]

MATH = (
    "**Sets:** locations $i, j$ ($0$ is the start).\n"
    "**Parameters:** distance $d_{ij}$.\n"
    "**Variables:** $x_{ij} \\in \\{0,1\\}$ (travel $i \\to j$), order $u_i \\in \\{1..n-1\\}$ for $i \\ge 1$.\n"
    "**Objective:** $\\min \\sum_{i \\ne j} d_{ij} x_{ij}$.\n"
    "**Constraints:** leave and enter every location once; $u_i - u_j + (n-1) x_{ij} \\le n - 2$ for $i, j \\ge 1$, $i \\ne j$ "
    "(Miller-Tucker-Zemlin subtour elimination).\n"
)
HIGHSPY = (
    "h = highspy.Highs()\nh.silent()\n"
    "n = len(distance)\n"
    "x = [[h.addBinary() for _ in range(n)] for _ in range(n)]\n"
    "u = [h.addIntegral(lb=1, ub=n - 1) for _ in range(n)]\n"
    "for i in range(n):\n"
    "    h.addConstr(x[i][i] == 0)\n"
    "    h.addConstr(sum(x[i][j] for j in range(n)) == 1)\n"
    "    h.addConstr(sum(x[j][i] for j in range(n)) == 1)\n"
    "for i in range(1, n):\n"
    "    for j in range(1, n):\n"
    "        if i != j:\n"
    "            h.addConstr(u[i] - u[j] + (n - 1) * x[i][j] <= n - 2)\n"
    "h.minimize(sum(distance[i][j] * x[i][j] for i in range(n) for j in range(n) if i != j))\n"
)
PYOMO = (
    "m = pyo.ConcreteModel()\n"
    "n = len(distance)\n"
    "N = range(n)\n"
    "m.x = pyo.Var(N, N, domain=pyo.Binary)\n"
    "m.u = pyo.Var(N, domain=pyo.Integers, bounds=(1, n - 1))\n"
    "m.stay = pyo.Constraint(N, rule=lambda m, i: m.x[i, i] == 0)\n"
    "m.out = pyo.Constraint(N, rule=lambda m, i: sum(m.x[i, j] for j in N) == 1)\n"
    "m.inn = pyo.Constraint(N, rule=lambda m, i: sum(m.x[j, i] for j in N) == 1)\n"
    "m.mtz = pyo.Constraint(N, N, rule=lambda m, i, j: m.u[i] - m.u[j] + (n - 1) * m.x[i, j] <= n - 2\n"
    "                       if i >= 1 and j >= 1 and i != j else pyo.Constraint.Skip)\n"
    "m.obj = pyo.Objective(expr=sum(distance[i][j] * m.x[i, j] for i in N for j in N if i != j), sense=pyo.minimize)\n"
)

GUROBI = (
    "n = len(distance)\n"
    "x = m.addVars(n, n, vtype=GRB.BINARY)\n"
    "u = m.addVars(n, lb=1, ub=n - 1, vtype=GRB.INTEGER)\n"
    "for i in range(n):\n"
    "    m.addConstr(x[i, i] == 0)\n"
    "    m.addConstr(gp.quicksum(x[i, j] for j in range(n)) == 1)\n"
    "    m.addConstr(gp.quicksum(x[j, i] for j in range(n)) == 1)\n"
    "for i in range(1, n):\n"
    "    for j in range(1, n):\n"
    "        if i != j:\n"
    "            m.addConstr(u[i] - u[j] + (n - 1) * x[i, j] <= n - 2)\n"
    "m.setObjective(gp.quicksum(distance[i][j] * x[i, j] for i in range(n) for j in range(n) if i != j), GRB.MINIMIZE)\n"
)

class Routing(Family):
    name = "routing"
    categories = ("IP",)

    def sample(self, rng: random.Random, size: int, category: str | None = None, infeasible: bool = False) -> Spec:
        self._category(rng, category)
        who, stops, unit = rng.choice(SCENARIOS)
        n = size + 2
        places = ["depot"] + rng.sample(PLACES[1:], n - 1)
        pts = [(rng.uniform(0, 50), rng.uniform(0, 50)) for _ in places]
        dist = [[0 if i == j else max(1, round(math.dist(pts[i], pts[j]))) for j in range(n)] for i in range(n)]
        var = [Var(f"x_{i}_{j}", 0, 1, "binary") for i in range(n) for j in range(n)]
        var += [Var(f"u_{i}", 1, n - 1, "integer") for i in range(n)]
        cons = [Constraint(f"stay_{i}", {f"x_{i}_{i}": 1}, "==", 0) for i in range(n)]
        cons += [Constraint(f"out_{i}", {f"x_{i}_{j}": 1 for j in range(n)}, "==", 1) for i in range(n)]
        cons += [Constraint(f"in_{i}", {f"x_{j}_{i}": 1 for j in range(n)}, "==", 1) for i in range(n)]
        cons += [Constraint(f"mtz_{i}_{j}", {f"u_{i}": 1, f"u_{j}": -1, f"x_{i}_{j}": n - 1}, "<=", n - 2)
                 for i in range(1, n) for j in range(1, n) if i != j]
        obj = {f"x_{i}_{j}": dist[i][j] for i in range(n) for j in range(n) if i != j}
        ir = OptModel(self.name, "min", var, obj, cons)
        params = [Param("distance", f"travel distance ({unit})", dist, places, [f"to {p}" for p in places],
                        phrase=f"From {{label}}, the distances in {unit} are: {{values}}.")]
        story = f"A {who} leaves the depot, visits {n - 1} {stops} ({join(places[1:])}) once each and returns."
        ask = f"What is the length in {unit} of the shortest such tour?"
        code = model_code(HIGHSPY, PYOMO, GUROBI)
        return Spec(self.name, story, params, ask, ir, MATH, code)
