"""Diet: the cheapest combination of foods meeting nutrient minimums (LP, or IP in whole servings)."""

from __future__ import annotations

import random

from ordata.families.base import Family, Spec, join, model_code
from ordata.ir import Constraint, OptModel, Var
from ordata.params import Param

FOODS = ["oats", "rice", "beans", "milk", "eggs", "lentils", "bread", "peanuts", "spinach", "tofu"]
NUTRIENTS = ["protein (g)", "fibre (g)", "iron (mg)", "calcium (mg)", "vitamin C (mg)"]
SCENARIOS = ["A hospital kitchen", "A school canteen", "An expedition planner", "A shelter"]

MATH = (
    "**Sets:** foods $f$, nutrients $n$.\n"
    "**Parameters:** cost $c_f$, content $a_{nf}$, requirement $b_n$.\n"
    "**Variables:** $x_f \\ge 0${integral}, servings of food $f$.\n"
    "**Objective:** $\\min \\sum_f c_f x_f$.\n"
    "**Constraints:** $\\sum_f a_{nf} x_f \\ge b_n$ for every nutrient $n$.\n"
)
HIGHSPY = (
    "h = highspy.Highs()\nh.silent()\n"
    "x = [h.addVariable(lb=0{integrality}) for _ in cost]\n"
    "for n in range(len(requirement)):\n"
    "    h.addConstr(sum(content[n][f] * x[f] for f in range(len(cost))) >= requirement[n])\n"
    "h.minimize(sum(cost[f] * x[f] for f in range(len(cost))))\n"
)
PYOMO = (
    "m = pyo.ConcreteModel()\n"
    "F, N = range(len(cost)), range(len(requirement))\n"
    "m.x = pyo.Var(F, domain=pyo.{domain})\n"
    "m.need = pyo.Constraint(N, rule=lambda m, n: sum(content[n][f] * m.x[f] for f in F) >= requirement[n])\n"
    "m.obj = pyo.Objective(expr=sum(cost[f] * m.x[f] for f in F), sense=pyo.minimize)\n"
)

GUROBI = (
    "x = m.addVars(len(cost), lb=0, vtype={vtype})\n"
    "for n in range(len(requirement)):\n"
    "    m.addConstr(gp.quicksum(content[n][f] * x[f] for f in range(len(cost))) >= requirement[n])\n"
    "m.setObjective(gp.quicksum(cost[f] * x[f] for f in range(len(cost))), GRB.MINIMIZE)\n"
)

class Diet(Family):
    name = "diet"
    categories = ("LP", "IP")

    def sample(self, rng: random.Random, size: int, category: str | None = None, infeasible: bool = False) -> Spec:
        cat = self._category(rng, category)
        foods = rng.sample(FOODS, size + 1)
        nutrients = rng.sample(NUTRIENTS, max(2, size))
        cost = [round(rng.uniform(0.2, 3.0), 2) for _ in foods]
        content = [[rng.randint(0, 20) for _ in foods] for _ in nutrients]
        for row in content:
            if max(row) == 0:
                row[rng.randrange(len(foods))] = rng.randint(5, 20)
        requirement = [rng.randint(20, 80) for _ in nutrients]
        whole = cat == "IP"
        var = [Var(f"x_{f}", kind="integer" if whole else "continuous") for f in range(len(foods))]
        cons = [Constraint(f"need_{n}", {f"x_{f}": content[n][f] for f in range(len(foods))}, ">=", requirement[n])
                for n in range(len(nutrients))]
        ir = OptModel(self.name, "min", var, {f"x_{f}": cost[f] for f in range(len(foods))}, cons)
        params = [
            Param("cost", "cost per serving", cost, foods, unit="$", phrase="A serving of {label} costs {value}."),
            Param("content", "nutrient content per serving", content, nutrients, foods,
                  phrase="The {label} per serving is: {values}."),
            Param("requirement", "daily minimum", requirement, nutrients, phrase="At least {value} of {label} is required."),
        ]
        story = f"{rng.choice(SCENARIOS)} plans a daily menu from {join(foods)}."
        ask = ("Servings must be whole numbers. " if whole else "Servings may be fractional. ") + \
            "What is the minimum daily cost of a menu that meets every requirement?"
        code = model_code(HIGHSPY, PYOMO, GUROBI, whole)
        return Spec(self.name, story, params, ask, ir, MATH.replace("{integral}", ", integer" if whole else ""), code,
                    {"cost": "food", "requirement": "nutrient"})
