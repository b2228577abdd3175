"""Capacitated facility location: which sites to open and how to serve customers (MILP)."""

from __future__ import annotations

import random

from ordata.families.base import Family, Spec, join, model_code
from ordata.ir import Constraint, OptModel, Var
from ordata.params import Param

SCENARIOS = [("warehouse", "retail outlets", "pallets per week"), ("distribution centre", "supermarkets", "tonnes per month"),
             ("data centre", "regions", "TB per day"), ("clinic", "villages", "patients per week")]
SITES = ["North", "South", "East", "West", "Central", "Harbour", "Airport", "Hillside"]
CUSTOMERS = ["Ashby", "Brook", "Carlton", "Denton", "Easton", "Fulton", "Garston", "Halton", "Ilford"]

MATH = (
    "**Sets:** candidate sites $i$, customers $j$.\n"
    "**Parameters:** fixed cost $f_i$, capacity $u_i$, demand $d_j$, unit cost $c_{ij}$.\n"
    "**Variables:** $y_i \\in \\{0,1\\}$ (open site $i$), $x_{ij} \\ge 0$ (amount sent from $i$ to $j$).\n"
    "**Objective:** $\\min \\sum_i f_i y_i + \\sum_{i,j} c_{ij} x_{ij}$.\n"
    "**Constraints:** $\\sum_i x_{ij} \\ge d_j$ for all $j$; $\\sum_j x_{ij} \\le u_i y_i$ for all $i$.\n"
)
HIGHSPY = (
    "h = highspy.Highs()\nh.silent()\n"
    "S, C = range(len(fixed_cost)), range(len(demand))\n"
    "y = [h.addBinary() for _ in S]\n"
    "x = [[h.addVariable(lb=0) for _ in C] for _ in S]\n"
    "for j in C:\n"
    "    h.addConstr(sum(x[i][j] for i in S) >= demand[j])\n"
    "for i in S:\n"
    "    h.addConstr(sum(x[i][j] for j in C) <= capacity[i] * y[i])\n"
    "h.minimize(sum(fixed_cost[i] * y[i] for i in S) + sum(cost[i][j] * x[i][j] for i in S for j in C))\n"
)
PYOMO = (
    "m = pyo.ConcreteModel()\n"
    "S, C = range(len(fixed_cost)), range(len(demand))\n"
    "m.y = pyo.Var(S, domain=pyo.Binary)\n"
    "m.x = pyo.Var(S, C, domain=pyo.NonNegativeReals)\n"
    "m.serve = pyo.Constraint(C, rule=lambda m, j: sum(m.x[i, j] for i in S) >= demand[j])\n"
    "m.cap = pyo.Constraint(S, rule=lambda m, i: sum(m.x[i, j] for j in C) <= capacity[i] * m.y[i])\n"
    "m.obj = pyo.Objective(expr=sum(fixed_cost[i] * m.y[i] for i in S)\n"
    "                      + sum(cost[i][j] * m.x[i, j] for i in S for j in C), sense=pyo.minimize)\n"
)

GUROBI = (
    "S, C = range(len(fixed_cost)), range(len(demand))\n"
    "y = m.addVars(len(fixed_cost), vtype=GRB.BINARY)\n"
    "x = m.addVars(len(fixed_cost), len(demand), lb=0)\n"
    "for j in C:\n"
    "    m.addConstr(gp.quicksum(x[i, j] for i in S) >= demand[j])\n"
    "for i in S:\n"
    "    m.addConstr(gp.quicksum(x[i, j] for j in C) <= capacity[i] * y[i])\n"
    "m.setObjective(gp.quicksum(fixed_cost[i] * y[i] for i in S)\n"
    "               + gp.quicksum(cost[i][j] * x[i, j] for i in S for j in C), GRB.MINIMIZE)\n"
)

class FacilityLocation(Family):
    name = "facility"
    categories = ("MILP",)

    def sample(self, rng: random.Random, size: int, category: str | None = None, infeasible: bool = False) -> Spec:
        self._category(rng, category)
        kind, customers_word, unit = rng.choice(SCENARIOS)
        n_s, n_c = size, size + 1
        sites = rng.sample(SITES, n_s)
        customers = rng.sample(CUSTOMERS, n_c)
        demand = [rng.randint(10, 60) for _ in customers]
        capacity = [rng.randint(max(demand), sum(demand)) for _ in sites]
        while sum(capacity) < sum(demand):
            capacity[rng.randrange(n_s)] += 20
        fixed_cost = [rng.randint(20, 90) * 10 for _ in sites]
        cost = [[rng.randint(1, 20) for _ in customers] for _ in sites]
        var = [Var(f"y_{i}", 0, 1, "binary") for i in range(n_s)]
        var += [Var(f"x_{i}_{j}") for i in range(n_s) for j in range(n_c)]
        cons = [Constraint(f"serve_{j}", {f"x_{i}_{j}": 1 for i in range(n_s)}, ">=", demand[j]) for j in range(n_c)]
        cons += [Constraint(f"cap_{i}", {**{f"x_{i}_{j}": 1 for j in range(n_c)}, f"y_{i}": -capacity[i]}, "<=", 0)
                 for i in range(n_s)]
        obj = {f"y_{i}": fixed_cost[i] for i in range(n_s)}
        obj.update({f"x_{i}_{j}": cost[i][j] for i in range(n_s) for j in range(n_c)})
        ir = OptModel(self.name, "min", var, obj, cons)
        params = [
            Param("fixed_cost", "fixed cost of opening", fixed_cost, sites, unit="$",
                  phrase="Opening a {label} site costs {value}."),
            Param("capacity", f"capacity ({unit})", capacity, sites, phrase="The {label} site can handle {value}."),
            Param("demand", f"demand ({unit})", demand, customers, phrase="{label} needs {value}."),
            Param("cost", "cost per unit served", cost, sites, [f"to {c}" for c in customers], unit="$",
                  phrase="Serving from {label} costs per unit: {values}."),
        ]
        story = (f"A company may open a {kind} at any of {n_s} candidate sites ({join(sites)}) "
                 f"to serve {n_c} {customers_word} ({join(customers)}).")
        ask = ("A closed site serves nothing; amounts may be fractional. Which sites should be opened, and how "
               "should demand be served, to minimise the total fixed and service cost?")
        code = model_code(HIGHSPY, PYOMO, GUROBI)
        return Spec(self.name, story, params, ask, ir, MATH, code, {"fixed_cost": "site", "demand": "customer"})
