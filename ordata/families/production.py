"""Production planning: the most profitable product mix under resource capacities (LP, or IP with whole units)."""

from __future__ import annotations

import random

from ordata.families.base import Family, Spec, join, model_code
from ordata.ir import Constraint, OptModel, Var
from ordata.params import Param

SCENARIOS = [
    ("furniture workshop", ["chairs", "tables", "desks", "shelves", "stools", "cabinets"],
     ["wood (board feet)", "labour (hours)", "finishing (hours)", "varnish (litres)"]),
    ("bakery", ["bread loaves", "cakes", "muffins", "pies", "croissants", "bagels"],
     ["flour (kg)", "sugar (kg)", "oven time (minutes)", "butter (kg)"]),
    ("electronics plant", ["phones", "tablets", "laptops", "routers", "speakers", "cameras"],
     ["assembly (hours)", "testing (hours)", "chips (units)", "packaging (hours)"]),
    ("chemical company", ["solvent A", "solvent B", "cleaner C", "coating D", "resin E", "paint F"],
     ["reactor time (hours)", "raw material (tonnes)", "distillation (hours)", "storage (cubic metres)"]),
]

MATH = (
    "**Sets:** products $p$, resources $r$.\n"
    "**Parameters:** profit $c_p$, usage $a_{rp}$, availability $b_r$.\n"
    "**Variables:** $x_p \\ge 0${integral}, units of product $p$.\n"
    "**Objective:** $\\max \\sum_p c_p x_p$.\n"
    "**Constraints:** $\\sum_p a_{rp} x_p \\le b_r$ for every resource $r$.\n"
)

HIGHSPY = (
    "h = highspy.Highs()\nh.silent()\n"
    "x = [h.addVariable(lb=0{integrality}) for _ in profit]\n"
    "for r in range(len(available)):\n"
    "    h.addConstr(sum(usage[r][p] * x[p] for p in range(len(profit))) <= available[r])\n"
    "h.maximize(sum(profit[p] * x[p] for p in range(len(profit))))\n"
)
PYOMO = (
    "m = pyo.ConcreteModel()\n"
    "P, R = range(len(profit)), range(len(available))\n"
    "m.x = pyo.Var(P, domain=pyo.{domain})\n"
    "m.cap = pyo.Constraint(R, rule=lambda m, r: sum(usage[r][p] * m.x[p] for p in P) <= available[r])\n"
    "m.obj = pyo.Objective(expr=sum(profit[p] * m.x[p] for p in P), sense=pyo.maximize)\n"
)

GUROBI = (
    "x = m.addVars(len(profit), lb=0, vtype={vtype})\n"
    "for r in range(len(available)):\n"
    "    m.addConstr(gp.quicksum(usage[r][p] * x[p] for p in range(len(profit))) <= available[r])\n"
    "m.setObjective(gp.quicksum(profit[p] * x[p] for p in range(len(profit))), GRB.MAXIMIZE)\n"
)

class ProductionPlanning(Family):
    name = "production"
    categories = ("LP", "IP")

    def sample(self, rng: random.Random, size: int, category: str | None = None, infeasible: bool = False) -> Spec:
        cat = self._category(rng, category)
        place, products_all, resources_all = rng.choice(SCENARIOS)
        n_p = size
        n_r = max(2, min(len(resources_all), size - rng.randint(0, 1)))
        products = rng.sample(products_all, n_p)
        resources = rng.sample(resources_all, n_r)
        res_names = [r.split(" (")[0] for r in resources]
        profit = [rng.randint(5, 60) for _ in products]
        usage = [[rng.randint(1, 9) for _ in products] for _ in resources]
        available = [rng.randint(40, 400) for _ in resources]
        kind = "integer" if cat == "IP" else "continuous"
        var = [Var(f"x_{p}", kind=kind) for p in range(n_p)]
        cons = [Constraint(f"cap_{r}", {f"x_{p}": usage[r][p] for p in range(n_p)}, "<=", available[r]) for r in range(n_r)]
        ir = OptModel(self.name, "max", var, {f"x_{p}": profit[p] for p in range(n_p)}, cons)
        params = [
            Param("profit", "profit per unit", profit, products, unit="$",
                  phrase="Each unit of {label} earns a profit of {value}."),
            Param("usage", "resource use per unit", usage, resources, products,
                  phrase="Per unit, the {label} needed is: {values}."),
            Param("available", "amount available", available, resources,
                  phrase="{value} of {label} are available."),
        ]
        whole = cat == "IP"
        ask = ("Only whole units can be made." if whole else "Production quantities may be fractional.") + \
            " How much of each product should be made to maximise total profit?"
        code = model_code(HIGHSPY, PYOMO, GUROBI, whole)
        return Spec(self.name, f"A {place} makes {join(products)} using {join(res_names)}.", params, ask, ir,
                    MATH.replace("{integral}", ", integer" if whole else ""), code,
                    {"profit": "product", "available": "resource"})
