"""Capacitated lot sizing: produce to meet demand over periods with set-up costs (MILP)."""

from __future__ import annotations

import random

from ordata.families.base import Family, Spec, model_code
from ordata.ir import Constraint, OptModel, Var
from ordata.params import Param

PRODUCTS = ["valves", "pumps", "gearboxes", "filters", "bicycles", "printers"]
PERIOD_WORDS = [("week", "Week"), ("month", "Month")]

MATH = (
    "**Sets:** periods $t = 1..T$.\n"
    "**Parameters:** demand $d_t$, set-up cost $s_t$, unit cost $c$, holding cost $h$, capacity $C$.\n"
    "**Variables:** $x_t \\ge 0$ produced, $I_t \\ge 0$ stock at the end of $t$ ($I_0 = 0$), $y_t \\in \\{0,1\\}$ set-up.\n"
    "**Objective:** $\\min \\sum_t (s_t y_t + c x_t + h I_t)$.\n"
    "**Constraints:** $I_{t-1} + x_t - I_t = d_t$; $x_t \\le C y_t$.\n"
)
HIGHSPY = (
    "h = highspy.Highs()\nh.silent()\n"
    "T = range(len(demand))\n"
    "x = [h.addVariable(lb=0) for _ in T]\n"
    "stock = [h.addVariable(lb=0) for _ in T]\n"
    "y = [h.addBinary() for _ in T]\n"
    "for t in T:\n"
    "    previous = stock[t - 1] if t > 0 else 0\n"
    "    h.addConstr(previous + x[t] - stock[t] == demand[t])\n"
    "    h.addConstr(x[t] <= capacity * y[t])\n"
    "h.minimize(sum(setup_cost[t] * y[t] + unit_cost * x[t] + holding_cost * stock[t] for t in T))\n"
)
PYOMO = (
    "m = pyo.ConcreteModel()\n"
    "T = range(len(demand))\n"
    "m.x = pyo.Var(T, domain=pyo.NonNegativeReals)\n"
    "m.stock = pyo.Var(T, domain=pyo.NonNegativeReals)\n"
    "m.y = pyo.Var(T, domain=pyo.Binary)\n"
    "m.balance = pyo.Constraint(T, rule=lambda m, t: (m.stock[t - 1] if t > 0 else 0) + m.x[t] - m.stock[t] == demand[t])\n"
    "m.setup = pyo.Constraint(T, rule=lambda m, t: m.x[t] <= capacity * m.y[t])\n"
    "m.obj = pyo.Objective(expr=sum(setup_cost[t] * m.y[t] + unit_cost * m.x[t] + holding_cost * m.stock[t] for t in T),\n"
    "                      sense=pyo.minimize)\n"
)

GUROBI = (
    "T = range(len(demand))\n"
    "x = m.addVars(len(demand), lb=0)\n"
    "stock = m.addVars(len(demand), lb=0)\n"
    "y = m.addVars(len(demand), vtype=GRB.BINARY)\n"
    "for t in T:\n"
    "    previous = stock[t - 1] if t > 0 else 0\n"
    "    m.addConstr(previous + x[t] - stock[t] == demand[t])\n"
    "    m.addConstr(x[t] <= capacity * y[t])\n"
    "m.setObjective(gp.quicksum(setup_cost[t] * y[t] + unit_cost * x[t] + holding_cost * stock[t] for t in T), GRB.MINIMIZE)\n"
)

class LotSizing(Family):
    name = "lot_sizing"
    categories = ("MILP",)
    infeasible_variants = True

    def sample(self, rng: random.Random, size: int, category: str | None = None, infeasible: bool = False) -> Spec:
        self._category(rng, category)
        product = rng.choice(PRODUCTS)
        word, title = rng.choice(PERIOD_WORDS)
        n = size + 1
        periods = [f"{title} {t + 1}" for t in range(n)]
        demand = [rng.randint(10, 80) for _ in periods]
        capacity = rng.randint(max(demand), max(demand) + 60)
        if infeasible:  # the horizon's total capacity falls short of its total demand
            capacity = max(1, int(sum(demand) / n * (0.75 + (capacity - max(demand)) / 600)))
        setup = [rng.randint(50, 300) for _ in periods]
        unit_cost, holding = rng.randint(2, 9), rng.randint(1, 4)
        var = [Var(f"x_{t}") for t in range(n)] + [Var(f"I_{t}") for t in range(n)]
        var += [Var(f"y_{t}", 0, 1, "binary") for t in range(n)]
        cons = []
        for t in range(n):
            coeffs = {f"x_{t}": 1.0, f"I_{t}": -1.0}
            if t > 0:
                coeffs[f"I_{t - 1}"] = 1.0
            cons.append(Constraint(f"bal_{t}", coeffs, "==", demand[t]))
            cons.append(Constraint(f"cap_{t}", {f"x_{t}": 1.0, f"y_{t}": -capacity}, "<=", 0))
        obj = {**{f"y_{t}": setup[t] for t in range(n)}, **{f"x_{t}": unit_cost for t in range(n)},
               **{f"I_{t}": holding for t in range(n)}}
        ir = OptModel(self.name, "min", var, obj, cons)
        params = [
            Param("demand", "demand (units)", demand, periods, phrase="{label} demand is {value} units."),
            Param("setup_cost", "set-up cost", setup, periods, unit="$", phrase="Setting up in {label} costs {value}."),
            Param("unit_cost", "production cost per unit", unit_cost, unit="$", phrase="Each unit costs {value} to make."),
            Param("holding_cost", f"holding cost per unit per {word}", holding, unit="$",
                  phrase=f"Keeping a unit in stock for a {word} costs {{value}}."),
            Param("capacity", f"production capacity per {word} (units)", capacity,
                  phrase=f"At most {{value}} units can be made in a {word}, and only in a {word} with a set-up."),
        ]
        story = f"A plant makes {product} for the next {n} {word}s, starting with no stock."
        ask = f"Demand must be met on time from production or stock. What is the minimum total cost over the {n} {word}s?"
        code = model_code(HIGHSPY, PYOMO, GUROBI)
        return Spec(self.name, story, params, ask, ir, MATH, code, {"demand": "period"})
