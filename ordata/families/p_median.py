"""p-median: open exactly p sites and assign each demand point to one, minimising weighted distance (IP)."""

from __future__ import annotations

import math
import random

from ordata.families.base import Family, Spec, join, model_code
from ordata.ir import Constraint, OptModel, Var
from ordata.params import Param

# (operator, site word, demand word, demand unit, distance unit)
SCENARIOS = [
    ("regional health authority", "ambulance station", "villages", "emergency calls per week", "km"),
    ("retail chain", "warehouse", "stores", "deliveries per month", "km"),
    ("city council", "library branch", "neighbourhoods", "hundred residents", "minutes of travel"),
    ("postal service", "parcel locker hub", "districts", "parcels per day", "km"),
    ("school board", "school", "housing estates", "pupils", "minutes by bus"),
]
SITES = ["Northgate", "Southbank", "Eastfield", "Westwood", "Central", "Riverside", "Hilltop", "Lakeside"]
POINTS = ["Abbey", "Bramley", "Colby", "Dunmore", "Elsworth", "Farley", "Glenby", "Hartley", "Ivybridge",
          "Kingsley", "Langton", "Milford", "Norton", "Oakham"]

MATH = (
    "**Sets:** demand points $i$, candidate sites $j$.\n"
    "**Parameters:** demand $w_i$, distance $d_{ij}$, number of sites to open $p$.\n"
    "**Variables:** $y_j \\in \\{0,1\\}$ (open site $j$), $x_{ij} \\in \\{0,1\\}$ (assign $i$ to $j$).\n"
    "**Objective:** $\\min \\sum_{i,j} w_i d_{ij} x_{ij}$.\n"
    "**Constraints:** $\\sum_j x_{ij} = 1$ for all $i$; $x_{ij} \\le y_j$ for all $i, j$; $\\sum_j y_j = p$.\n"
)
HIGHSPY = (
    "h = highspy.Highs()\nh.silent()\n"
    "D, S = range(len(demand)), range(len(distance[0]))\n"
    "y = [h.addBinary() for _ in S]\n"
    "x = [[h.addBinary() for _ in S] for _ in D]\n"
    "for i in D:\n"
    "    h.addConstr(sum(x[i][j] for j in S) == 1)\n"
    "    for j in S:\n"
    "        h.addConstr(x[i][j] <= y[j])\n"
    "h.addConstr(sum(y[j] for j in S) == p)\n"
    "h.minimize(sum(demand[i] * distance[i][j] * x[i][j] for i in D for j in S))\n"
)
PYOMO = (
    "m = pyo.ConcreteModel()\n"
    "D, S = range(len(demand)), range(len(distance[0]))\n"
    "m.y = pyo.Var(S, domain=pyo.Binary)\n"
    "m.x = pyo.Var(D, S, domain=pyo.Binary)\n"
    "m.one = pyo.Constraint(D, rule=lambda m, i: sum(m.x[i, j] for j in S) == 1)\n"
    "m.open = pyo.Constraint(D, S, rule=lambda m, i, j: m.x[i, j] <= m.y[j])\n"
    "m.count = pyo.Constraint(expr=sum(m.y[j] for j in S) == p)\n"
    "m.obj = pyo.Objective(expr=sum(demand[i] * distance[i][j] * m.x[i, j] for i in D for j in S),\n"
    "                      sense=pyo.minimize)\n"
)
GUROBI = (
    "D, S = range(len(demand)), range(len(distance[0]))\n"
    "y = m.addVars(len(distance[0]), vtype=GRB.BINARY)\n"
    "x = m.addVars(len(demand), len(distance[0]), vtype=GRB.BINARY)\n"
    "for i in D:\n"
    "    m.addConstr(gp.quicksum(x[i, j] for j in S) == 1)\n"
    "    for j in S:\n"
    "        m.addConstr(x[i, j] <= y[j])\n"
    "m.addConstr(gp.quicksum(y[j] for j in S) == p)\n"
    "m.setObjective(gp.quicksum(demand[i] * distance[i][j] * x[i, j] for i in D for j in S), GRB.MINIMIZE)\n"
)


class PMedian(Family):
    name = "p_median"
    categories = ("IP",)

    def sample(self, rng: random.Random, size: int, category: str | None = None, infeasible: bool = False) -> Spec:
        self._category(rng, category)
        who, site, points_word, d_unit, unit = rng.choice(SCENARIOS)
        n_s, n_d = size + 2, 2 * size + 2
        sites, points = rng.sample(SITES, n_s), rng.sample(POINTS, n_d)
        p = rng.randint(2, max(2, n_s // 2))
        loc = {name: (rng.uniform(0, 60), rng.uniform(0, 60)) for name in sites + points}
        distance = [[max(1, round(math.dist(loc[a], loc[b]))) for b in sites] for a in points]
        demand = [rng.randint(2, 40) for _ in points]
        var = [Var(f"y_{j}", 0, 1, "binary") for j in range(n_s)]
        var += [Var(f"x_{i}_{j}", 0, 1, "binary") for i in range(n_d) for j in range(n_s)]
        cons = [Constraint(f"one_{i}", {f"x_{i}_{j}": 1 for j in range(n_s)}, "==", 1) for i in range(n_d)]
        cons += [Constraint(f"open_{i}_{j}", {f"x_{i}_{j}": 1, f"y_{j}": -1}, "<=", 0)
                 for i in range(n_d) for j in range(n_s)]
        cons.append(Constraint("count", {f"y_{j}": 1 for j in range(n_s)}, "==", p))
        obj = {f"x_{i}_{j}": demand[i] * distance[i][j] for i in range(n_d) for j in range(n_s)}
        ir = OptModel(self.name, "min", var, obj, cons)
        params = [
            Param("p", f"number of {site}s to open", p, phrase=f"Exactly {{value}} {site}s must be opened."),
            Param("demand", f"demand ({d_unit})", demand, points, phrase=f"{{label}} has {{value}} {d_unit}."),
            Param("distance", f"distance ({unit})", distance, points, [f"to {s}" for s in sites],
                  phrase=f"From {{label}}, the distances in {unit} are: {{values}}."),
        ]
        story = (f"A {who} will open {site}s at some of {n_s} candidate sites ({join(sites)}) to serve "
                 f"{n_d} {points_word} ({join(points)}). Each of the {points_word} is served entirely by exactly "
                 f"one open {site}, and a closed site serves nothing; sites have no capacity limit.")
        ask = (f"Which {site}s should be opened, and which of the {points_word} should each serve, to minimise the "
               f"total demand-weighted distance (the sum over the {points_word} of demand times distance to the "
               f"assigned {site})? What is the minimum total?")
        code = model_code(HIGHSPY, PYOMO, GUROBI)
        return Spec(self.name, story, params, ask, ir, MATH, code, {"demand": points_word[:-1]})
