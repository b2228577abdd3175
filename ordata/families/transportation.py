"""Transportation: ship from supply points to demand points at minimum cost (LP, or IP in whole units)."""

from __future__ import annotations

import random

from ordata.families.base import Family, Spec, join, model_code
from ordata.ir import Constraint, OptModel, Var
from ordata.params import Param

SCENARIOS = [("warehouses", "stores", "pallets"), ("factories", "distribution centres", "tonnes"),
             ("farms", "markets", "crates"), ("refineries", "depots", "kilolitres")]
CITIES = ["Aston", "Bayview", "Cedar", "Dover", "Elmira", "Fairfax", "Glenwood", "Hampton", "Irvine", "Jasper"]

MATH = (
    "**Sets:** sources $i$, destinations $j$.\n"
    "**Parameters:** supply $s_i$, demand $d_j$, unit cost $c_{ij}$.\n"
    "**Variables:** $x_{ij} \\ge 0${integral}, amount shipped from $i$ to $j$.\n"
    "**Objective:** $\\min \\sum_{i,j} c_{ij} x_{ij}$.\n"
    "**Constraints:** $\\sum_j x_{ij} \\le s_i$ for all $i$; $\\sum_i x_{ij} \\ge d_j$ for all $j$.\n"
)
HIGHSPY = (
    "h = highspy.Highs()\nh.silent()\n"
    "x = [[h.addVariable(lb=0{integrality}) for _ in demand] for _ in supply]\n"
    "for i in range(len(supply)):\n"
    "    h.addConstr(sum(x[i]) <= supply[i])\n"
    "for j in range(len(demand)):\n"
    "    h.addConstr(sum(x[i][j] for i in range(len(supply))) >= demand[j])\n"
    "h.minimize(sum(cost[i][j] * x[i][j] for i in range(len(supply)) for j in range(len(demand))))\n"
)
PYOMO = (
    "m = pyo.ConcreteModel()\n"
    "S, D = range(len(supply)), range(len(demand))\n"
    "m.x = pyo.Var(S, D, domain=pyo.{domain})\n"
    "m.out = pyo.Constraint(S, rule=lambda m, i: sum(m.x[i, j] for j in D) <= supply[i])\n"
    "m.inn = pyo.Constraint(D, rule=lambda m, j: sum(m.x[i, j] for i in S) >= demand[j])\n"
    "m.obj = pyo.Objective(expr=sum(cost[i][j] * m.x[i, j] for i in S for j in D), sense=pyo.minimize)\n"
)

GUROBI = (
    "x = m.addVars(len(supply), len(demand), lb=0, vtype={vtype})\n"
    "for i in range(len(supply)):\n"
    "    m.addConstr(gp.quicksum(x[i, j] for j in range(len(demand))) <= supply[i])\n"
    "for j in range(len(demand)):\n"
    "    m.addConstr(gp.quicksum(x[i, j] for i in range(len(supply))) >= demand[j])\n"
    "m.setObjective(gp.quicksum(cost[i][j] * x[i, j] for i in range(len(supply)) for j in range(len(demand))), GRB.MINIMIZE)\n"
)

class Transportation(Family):
    name = "transportation"
    categories = ("LP", "IP")
    infeasible_variants = True

    def sample(self, rng: random.Random, size: int, category: str | None = None, infeasible: bool = False) -> Spec:
        cat = self._category(rng, category)
        src, dst, unit = rng.choice(SCENARIOS)
        n_s, n_d = max(2, size - 1), size
        names = rng.sample(CITIES, n_s + n_d)
        sources, sinks = names[:n_s], names[n_s:]
        demand = [rng.randint(20, 120) for _ in sinks]
        weights = [rng.uniform(0.5, 1.5) for _ in sources]
        slack = rng.uniform(1.05, 1.4)
        if infeasible:  # total supply falls 10-35% short of total demand
            slack = 0.65 + (slack - 1.05)
        supply = [max(1, round(sum(demand) * slack * w / sum(weights))) for w in weights]
        cost = [[rng.randint(2, 25) for _ in sinks] for _ in sources]
        whole = cat == "IP"
        kind = "integer" if whole else "continuous"
        var = [Var(f"x_{i}_{j}", kind=kind) for i in range(n_s) for j in range(n_d)]
        cons = [Constraint(f"supply_{i}", {f"x_{i}_{j}": 1 for j in range(n_d)}, "<=", supply[i]) for i in range(n_s)]
        cons += [Constraint(f"demand_{j}", {f"x_{i}_{j}": 1 for i in range(n_s)}, ">=", demand[j]) for j in range(n_d)]
        ir = OptModel(self.name, "min", var, {f"x_{i}_{j}": cost[i][j] for i in range(n_s) for j in range(n_d)}, cons)
        params = [
            Param("supply", f"supply ({unit})", supply, sources, phrase="{label} can supply {value}."),
            Param("demand", f"demand ({unit})", demand, sinks, phrase="{label} needs {value}."),
            Param("cost", "cost per unit shipped", cost, sources, [f"to {s}" for s in sinks], unit="$",
                  phrase="Shipping from {label} costs per unit: {values}."),
        ]
        story = (f"A company ships {unit} from {n_s} {src} ({join(sources)}) to {n_d} {dst} ({join(sinks)}).")
        ask = ("Only whole units can be shipped. " if whole else "") + \
            "Every demand must be met without exceeding any supply. What is the minimum total shipping cost?"
        code = model_code(HIGHSPY, PYOMO, GUROBI, whole)
        return Spec(self.name, story, params, ask, ir, MATH.replace("{integral}", ", integer" if whole else ""), code,
                    {"supply": "source", "demand": "destination"})
