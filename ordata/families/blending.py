"""Blending: the cheapest mix of ingredients meeting quality limits (LP)."""

from __future__ import annotations

import random

from ordata.families.base import Family, Spec, join, model_code
from ordata.ir import Constraint, OptModel, Var
from ordata.params import Param

SCENARIOS = [
    ("feed mill", "animal feed", ["corn", "soybean meal", "barley", "fish meal", "wheat bran"], ["protein", "fibre"]),
    ("refinery", "fuel", ["crude A", "crude B", "crude C", "naphtha", "reformate"], ["octane rating", "sulphur content"]),
    ("foundry", "alloy", ["scrap steel", "pig iron", "ferro-silicon", "nickel scrap", "copper scrap"], ["carbon content", "silicon content"]),
]

MATH = (
    "**Sets:** ingredients $i$, properties $k$.\n"
    "**Parameters:** cost $c_i$, property value $a_{ki}$, minimum $l_k$, maximum $u_k$, batch size $D$.\n"
    "**Variables:** $x_i \\ge 0$, tonnes of ingredient $i$.\n"
    "**Objective:** $\\min \\sum_i c_i x_i$.\n"
    "**Constraints:** $\\sum_i x_i = D$; $l_k D \\le \\sum_i a_{ki} x_i \\le u_k D$ for every property $k$.\n"
)
HIGHSPY = (
    "h = highspy.Highs()\nh.silent()\n"
    "I, K = range(len(cost)), range(len(minimum))\n"
    "x = [h.addVariable(lb=0) for _ in I]\n"
    "h.addConstr(sum(x) == batch)\n"
    "for k in K:\n"
    "    h.addConstr(sum(quality[k][i] * x[i] for i in I) >= minimum[k] * batch)\n"
    "    h.addConstr(sum(quality[k][i] * x[i] for i in I) <= maximum[k] * batch)\n"
    "h.minimize(sum(cost[i] * x[i] for i in I))\n"
)
PYOMO = (
    "m = pyo.ConcreteModel()\n"
    "I, K = range(len(cost)), range(len(minimum))\n"
    "m.x = pyo.Var(I, domain=pyo.NonNegativeReals)\n"
    "m.total = pyo.Constraint(expr=sum(m.x[i] for i in I) == batch)\n"
    "m.low = pyo.Constraint(K, rule=lambda m, k: sum(quality[k][i] * m.x[i] for i in I) >= minimum[k] * batch)\n"
    "m.high = pyo.Constraint(K, rule=lambda m, k: sum(quality[k][i] * m.x[i] for i in I) <= maximum[k] * batch)\n"
    "m.obj = pyo.Objective(expr=sum(cost[i] * m.x[i] for i in I), sense=pyo.minimize)\n"
)

GUROBI = (
    "I, K = range(len(cost)), range(len(minimum))\n"
    "x = m.addVars(len(cost), lb=0)\n"
    "m.addConstr(x.sum() == batch)\n"
    "for k in K:\n"
    "    m.addConstr(gp.quicksum(quality[k][i] * x[i] for i in I) >= minimum[k] * batch)\n"
    "    m.addConstr(gp.quicksum(quality[k][i] * x[i] for i in I) <= maximum[k] * batch)\n"
    "m.setObjective(gp.quicksum(cost[i] * x[i] for i in I), GRB.MINIMIZE)\n"
)

class Blending(Family):
    name = "blending"
    categories = ("LP",)

    def sample(self, rng: random.Random, size: int, category: str | None = None, infeasible: bool = False) -> Spec:
        self._category(rng, category)
        plant, product, ingredients_all, props = rng.choice(SCENARIOS)
        n = size + 1
        ingredients = rng.sample(ingredients_all, n)
        cost = [rng.randint(80, 400) for _ in ingredients]
        quality = [[rng.randint(1, 30) for _ in ingredients] for _ in props]
        minimum, maximum = [], []
        for row in quality:
            lo, hi = min(row), max(row)
            a = rng.randint(lo, (lo + hi) // 2)
            minimum.append(a)
            maximum.append(rng.randint(max(a + 1, (lo + hi) // 2), hi + 1))
        batch = rng.randint(5, 50) * 10
        var = [Var(f"x_{i}") for i in range(n)]
        cons = [Constraint("total", {f"x_{i}": 1 for i in range(n)}, "==", batch)]
        for k in range(len(props)):
            row = {f"x_{i}": quality[k][i] for i in range(n)}
            cons += [Constraint(f"low_{k}", row, ">=", minimum[k] * batch), Constraint(f"high_{k}", row, "<=", maximum[k] * batch)]
        ir = OptModel(self.name, "min", var, {f"x_{i}": cost[i] for i in range(n)}, cons)
        params = [
            Param("cost", "cost per tonne", cost, ingredients, unit="$", phrase="{label} costs {value} per tonne."),
            Param("quality", "property per tonne", quality, props, ingredients, phrase="The {label} of each ingredient is: {values}."),
            Param("minimum", "minimum average", minimum, props, phrase="The blend's average {label} must be at least {value}."),
            Param("maximum", "maximum average", maximum, props, phrase="The blend's average {label} must be at most {value}."),
            Param("batch", "batch size (tonnes)", batch, phrase="A batch of {value} tonnes is needed."),
        ]
        story = f"A {plant} blends {product} from {join(ingredients)}; properties mix in proportion to weight."
        ask = "What is the minimum cost of the batch?"
        code = model_code(HIGHSPY, PYOMO, GUROBI)
        return Spec(self.name, story, params, ask, ir, MATH, code, {"cost": "ingredient", "minimum": "property"})
