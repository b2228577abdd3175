"""Bin packing: put every item into the fewest identical bins of a given capacity (binary IP)."""

from __future__ import annotations

import random

from ordata.families.base import Family, Spec, join, model_code
from ordata.ir import Constraint, OptModel, Var
from ordata.params import Param

# (who, bin, item word, unit, capacity choices, size phrase, item names)
SCENARIOS = [
    ("A freight forwarder", "container", "consignment", "tonnes", [20, 24, 26, 30],
     "The {label} consignment weighs {value}.",
     ["machinery", "textiles", "medicine", "electronics", "furniture", "auto parts", "books", "tyres", "paper"]),
    ("An IT department", "backup disk", "data set", "GB", [500, 750, 1000], "The {label} data set takes {value}.",
     ["payroll", "CRM", "website", "email archive", "photos", "source code", "CAD drawings", "logs", "videos"]),
    ("A cloud operator", "server", "virtual machine", "GB of memory", [64, 96, 128],
     "The {label} virtual machine needs {value}.",
     ["auth", "billing", "search", "cache", "analytics", "mail", "database", "queue", "frontend", "reporting"]),
    ("A print shop", "press shift", "print job", "minutes", [420, 480, 540], "The {label} job takes {value}.",
     ["flyers", "posters", "brochures", "menus", "catalogues", "labels", "calendars", "tickets", "banners"]),
]

MATH = (
    "**Sets:** items $i$, bins $b$ (as many bins as items).\n"
    "**Parameters:** size $s_i$, bin capacity $C$.\n"
    "**Variables:** $y_b \\in \\{0,1\\}$ (bin $b$ used), $x_{ib} \\in \\{0,1\\}$ (item $i$ in bin $b$).\n"
    "**Objective:** $\\min \\sum_b y_b$.\n"
    "**Constraints:** $\\sum_b x_{ib} = 1$ for all $i$; $\\sum_i s_i x_{ib} \\le C y_b$ for all $b$; "
    "$y_b \\ge y_{b+1}$ (symmetry breaking).\n"
)
HIGHSPY = (
    "h = highspy.Highs()\nh.silent()\n"
    "N = range(len(size))\n"
    "y = [h.addBinary() for _ in N]\n"
    "x = [[h.addBinary() for _ in N] for _ in N]\n"
    "for i in N:\n"
    "    h.addConstr(sum(x[i][b] for b in N) == 1)\n"
    "for b in N:\n"
    "    h.addConstr(sum(size[i] * x[i][b] for i in N) <= capacity * y[b])\n"
    "for b in range(len(size) - 1):\n"
    "    h.addConstr(y[b] >= y[b + 1])\n"
    "h.minimize(sum(y[b] for b in N))\n"
)
PYOMO = (
    "m = pyo.ConcreteModel()\n"
    "N = range(len(size))\n"
    "m.y = pyo.Var(N, domain=pyo.Binary)\n"
    "m.x = pyo.Var(N, N, domain=pyo.Binary)\n"
    "m.assign = pyo.Constraint(N, rule=lambda m, i: sum(m.x[i, b] for b in N) == 1)\n"
    "m.cap = pyo.Constraint(N, rule=lambda m, b: sum(size[i] * m.x[i, b] for i in N) <= capacity * m.y[b])\n"
    "m.order = pyo.Constraint(range(len(size) - 1), rule=lambda m, b: m.y[b] >= m.y[b + 1])\n"
    "m.obj = pyo.Objective(expr=sum(m.y[b] for b in N), sense=pyo.minimize)\n"
)
GUROBI = (
    "n = len(size)\n"
    "y = m.addVars(n, vtype=GRB.BINARY)\n"
    "x = m.addVars(n, n, vtype=GRB.BINARY)\n"
    "for i in range(n):\n"
    "    m.addConstr(gp.quicksum(x[i, b] for b in range(n)) == 1)\n"
    "for b in range(n):\n"
    "    m.addConstr(gp.quicksum(size[i] * x[i, b] for i in range(n)) <= capacity * y[b])\n"
    "for b in range(n - 1):\n"
    "    m.addConstr(y[b] >= y[b + 1])\n"
    "m.setObjective(gp.quicksum(y[b] for b in range(n)), GRB.MINIMIZE)\n"
)


class BinPacking(Family):
    name = "bin_packing"
    categories = ("IP",)

    def sample(self, rng: random.Random, size: int, category: str | None = None, infeasible: bool = False) -> Spec:
        self._category(rng, category)
        who, bin_word, item_word, unit, caps, phrase, names = rng.choice(SCENARIOS)
        n = size + 3
        items = rng.sample(names, n)
        capacity = rng.choice(caps)
        sizes = [rng.randint(max(1, capacity * 15 // 100), capacity * 60 // 100) for _ in items]
        var = [Var(f"y_{b}", 0, 1, "binary") for b in range(n)]
        var += [Var(f"x_{i}_{b}", 0, 1, "binary") for i in range(n) for b in range(n)]
        cons = [Constraint(f"assign_{i}", {f"x_{i}_{b}": 1 for b in range(n)}, "==", 1) for i in range(n)]
        cons += [Constraint(f"cap_{b}", {**{f"x_{i}_{b}": sizes[i] for i in range(n)}, f"y_{b}": -capacity}, "<=", 0)
                 for b in range(n)]
        cons += [Constraint(f"order_{b}", {f"y_{b}": 1, f"y_{b + 1}": -1}, ">=", 0) for b in range(n - 1)]
        ir = OptModel(self.name, "min", var, {f"y_{b}": 1 for b in range(n)}, cons)
        params = [
            Param("capacity", f"capacity of each {bin_word}", capacity, unit=unit,
                  phrase=f"Each {bin_word} has a capacity of {{value}}."),
            Param("size", "size", sizes, items, unit=unit, phrase=phrase),
        ]
        story = f"{who} must place {n} {item_word}s ({join(items)}) into identical {bin_word}s."
        ask = (f"Each {item_word} goes whole into exactly one {bin_word}, and the total size of the {item_word}s in a "
               f"{bin_word} may not exceed its capacity. What is the minimum number of {bin_word}s needed?")
        code = model_code(HIGHSPY, PYOMO, GUROBI)
        return Spec(self.name, story, params, ask, ir, MATH, code, {"size": item_word})
