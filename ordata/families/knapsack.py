"""Knapsack: choose items under a capacity to maximise value (binary IP)."""

from __future__ import annotations

import random

from ordata.families.base import Family, Spec, model_code
from ordata.ir import Constraint, OptModel, Var
from ordata.params import Param

SCENARIOS = [
    ("hiker", "backpack", "kg", ["tent", "stove", "camera", "water filter", "lamp", "rope", "first-aid kit", "jacket"]),
    ("cargo airline", "aircraft", "tonnes", ["machinery", "textiles", "medicine", "electronics", "food", "auto parts", "books", "paper"]),
    ("investment fund", "budget", "million dollars", ["solar farm", "bridge", "school", "hospital", "data centre", "rail link", "port", "wind farm"]),
    ("delivery van", "van", "cubic metres", ["fridges", "sofas", "mattresses", "bicycles", "boxes", "desks", "lamps", "washers"]),
]

MATH = (
    "**Sets:** items $i$.\n"
    "**Parameters:** size $w_i$, value $v_i$, capacity $C$.\n"
    "**Variables:** $y_i \\in \\{0,1\\}$, 1 if item $i$ is selected.\n"
    "**Objective:** $\\max \\sum_i v_i y_i$.\n"
    "**Constraints:** $\\sum_i w_i y_i \\le C$.\n"
)
HIGHSPY = (
    "h = highspy.Highs()\nh.silent()\n"
    "take = [h.addBinary() for _ in size]\n"
    "h.addConstr(sum(size[i] * take[i] for i in range(len(size))) <= capacity)\n"
    "h.maximize(sum(value[i] * take[i] for i in range(len(size))))\n"
)
PYOMO = (
    "m = pyo.ConcreteModel()\n"
    "I = range(len(size))\n"
    "m.take = pyo.Var(I, domain=pyo.Binary)\n"
    "m.cap = pyo.Constraint(expr=sum(size[i] * m.take[i] for i in I) <= capacity)\n"
    "m.obj = pyo.Objective(expr=sum(value[i] * m.take[i] for i in I), sense=pyo.maximize)\n"
)

GUROBI = (
    "take = m.addVars(len(size), vtype=GRB.BINARY)\n"
    "m.addConstr(gp.quicksum(size[i] * take[i] for i in range(len(size))) <= capacity)\n"
    "m.setObjective(gp.quicksum(value[i] * take[i] for i in range(len(size))), GRB.MAXIMIZE)\n"
)

class Knapsack(Family):
    name = "knapsack"
    categories = ("IP",)

    def sample(self, rng: random.Random, size: int, category: str | None = None, infeasible: bool = False) -> Spec:
        self._category(rng, category)
        who, holder, unit, items_all = rng.choice(SCENARIOS)
        n = size + 1
        items = rng.sample(items_all, n)
        weight = [rng.randint(2, 30) for _ in items]
        value = [rng.randint(5, 90) for _ in items]
        capacity = max(max(weight), int(sum(weight) * rng.uniform(0.35, 0.65)))
        var = [Var(f"y_{i}", 0, 1, "binary") for i in range(n)]
        cons = [Constraint("capacity", {f"y_{i}": weight[i] for i in range(n)}, "<=", capacity)]
        ir = OptModel(self.name, "max", var, {f"y_{i}": value[i] for i in range(n)}, cons)
        params = [
            Param("capacity", f"capacity of the {holder}", capacity, unit=unit,
                  phrase=f"The {holder} holds at most {{value}}."),
            Param("size", "size", weight, items, unit=unit),
            Param("value", "value", value, items),
        ]
        story = f"A {who} must choose which of these candidates to put in the {holder}: {', '.join(items)}."
        ask = "Each candidate is taken whole or not at all. Which selection maximises the total value?"
        code = model_code(HIGHSPY, PYOMO, GUROBI)
        return Spec(self.name, story, params, ask, ir, MATH, code, {"size": "candidate"})
