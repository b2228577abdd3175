"""Cutting stock: cut ordered pieces from the fewest stock rolls (Kantorovich formulation; IP)."""

from __future__ import annotations

import random

from ordata.families.base import Family, Spec, join, model_code
from ordata.ir import Constraint, OptModel, Var
from ordata.params import Param

# (story, stock word, piece word, stock size choices, size phrase, demand phrase, labels); sizes in cm
SCENARIOS = [
    ("A paper mill cuts reels for {n} customers ({labels})", "jumbo reel", "reel", [200, 250, 300],
     "The reels for {label} are {value} wide.", "The number of reels ordered by {label} is {value}.",
     ["Acme", "Bolton", "Crest", "Dunmore", "Everly", "Fairway", "Granton"]),
    ("A steel fabricator cuts {n} kinds of pieces ({labels})", "stock bar", "piece", [600, 800, 1000],
     "A {label} piece is {value} long.", "The number of {label} pieces needed is {value}.",
     ["bracket", "strut", "rail", "post", "brace", "rung", "beam"]),
    ("A carpentry shop cuts {n} kinds of pieces ({labels})", "board", "piece", [240, 300, 360],
     "A {label} piece is {value} long.", "The number of {label} pieces needed is {value}.",
     ["shelf", "leg", "slat", "rail", "panel", "batten", "stile"]),
    ("A textile factory cuts {n} kinds of strips ({labels})", "fabric roll", "strip", [150, 180, 200],
     "A {label} strip is {value} wide.", "The number of {label} strips needed is {value}.",
     ["curtain", "tablecloth", "sheet", "towel", "napkin", "banner", "apron"]),
]

MATH = (
    "**Sets:** piece types $i$, rolls $k = 1..K$, $K = \\sum_i d_i$ (one roll per piece always suffices).\n"
    "**Parameters:** roll size $W$, piece size $w_i$, demand $d_i$.\n"
    "**Variables:** $y_k \\in \\{0,1\\}$ (roll $k$ used), "
    "$x_{ik} \\in \\mathbb{Z}_{\\ge 0}$ (pieces $i$ cut from roll $k$).\n"
    "**Objective:** $\\min \\sum_k y_k$.\n"
    "**Constraints:** $\\sum_i w_i x_{ik} \\le W y_k$ for all $k$; $\\sum_k x_{ik} \\ge d_i$ for all $i$; "
    "$y_k \\ge y_{k+1}$ (symmetry breaking).\n"
)
HIGHSPY = (
    "h = highspy.Highs()\nh.silent()\n"
    "P, K = range(len(piece_size)), range(sum(demand))\n"
    "y = [h.addBinary() for _ in K]\n"
    "x = [[h.addIntegral(lb=0) for _ in K] for _ in P]\n"
    "for k in K:\n"
    "    h.addConstr(sum(piece_size[i] * x[i][k] for i in P) <= stock_size * y[k])\n"
    "for i in P:\n"
    "    h.addConstr(sum(x[i][k] for k in K) >= demand[i])\n"
    "for k in range(len(K) - 1):\n"
    "    h.addConstr(y[k] >= y[k + 1])\n"
    "h.minimize(sum(y[k] for k in K))\n"
)
PYOMO = (
    "m = pyo.ConcreteModel()\n"
    "P, K = range(len(piece_size)), range(sum(demand))\n"
    "m.y = pyo.Var(K, domain=pyo.Binary)\n"
    "m.x = pyo.Var(P, K, domain=pyo.NonNegativeIntegers)\n"
    "m.cut = pyo.Constraint(K, rule=lambda m, k: sum(piece_size[i] * m.x[i, k] for i in P) <= stock_size * m.y[k])\n"
    "m.meet = pyo.Constraint(P, rule=lambda m, i: sum(m.x[i, k] for k in K) >= demand[i])\n"
    "m.order = pyo.Constraint(range(len(K) - 1), rule=lambda m, k: m.y[k] >= m.y[k + 1])\n"
    "m.obj = pyo.Objective(expr=sum(m.y[k] for k in K), sense=pyo.minimize)\n"
)
GUROBI = (
    "P, K = range(len(piece_size)), range(sum(demand))\n"
    "y = m.addVars(len(K), vtype=GRB.BINARY)\n"
    "x = m.addVars(len(P), len(K), lb=0, vtype=GRB.INTEGER)\n"
    "for k in K:\n"
    "    m.addConstr(gp.quicksum(piece_size[i] * x[i, k] for i in P) <= stock_size * y[k])\n"
    "for i in P:\n"
    "    m.addConstr(gp.quicksum(x[i, k] for k in K) >= demand[i])\n"
    "for k in range(len(K) - 1):\n"
    "    m.addConstr(y[k] >= y[k + 1])\n"
    "m.setObjective(gp.quicksum(y[k] for k in K), GRB.MINIMIZE)\n"
)


class CuttingStock(Family):
    name = "cutting_stock"
    categories = ("IP",)

    def sample(self, rng: random.Random, size: int, category: str | None = None, infeasible: bool = False) -> Spec:
        self._category(rng, category)
        story, stock_word, piece_word, stocks, size_phrase, demand_phrase, names = rng.choice(SCENARIOS)
        n = size + 1
        labels = rng.sample(names, n)
        stock = rng.choice(stocks)
        piece = rng.sample(range(stock * 12 // 100, stock * 45 // 100), n)
        demand = [rng.randint(1, 4 if size <= 3 else 3 if size == 4 else 2) for _ in labels]
        rolls = sum(demand)
        var = [Var(f"y_{k}", 0, 1, "binary") for k in range(rolls)]
        var += [Var(f"x_{i}_{k}", kind="integer") for i in range(n) for k in range(rolls)]
        cons = [Constraint(f"cut_{k}", {**{f"x_{i}_{k}": piece[i] for i in range(n)}, f"y_{k}": -stock}, "<=", 0)
                for k in range(rolls)]
        cons += [Constraint(f"meet_{i}", {f"x_{i}_{k}": 1 for k in range(rolls)}, ">=", demand[i]) for i in range(n)]
        cons += [Constraint(f"order_{k}", {f"y_{k}": 1, f"y_{k + 1}": -1}, ">=", 0) for k in range(rolls - 1)]
        ir = OptModel(self.name, "min", var, {f"y_{k}": 1 for k in range(rolls)}, cons)
        params = [
            Param("stock_size", f"size of each {stock_word}", stock, unit="cm",
                  phrase=f"Each {stock_word} measures {{value}}."),
            Param("piece_size", f"{piece_word} size", piece, labels, unit="cm", phrase=size_phrase),
            Param("demand", f"{piece_word}s required", demand, labels, phrase=demand_phrase),
        ]
        story = story.format(n=n, labels=join(labels)) + f" from identical {stock_word}s."
        ask = (f"Each {piece_word} is cut whole from a single {stock_word}, the total size of the {piece_word}s "
               f"cut from one {stock_word} may not exceed the {stock_word}'s size, and at least the required "
               f"number of {piece_word}s of each kind must be cut. What is the minimum number of {stock_word}s to cut?")
        code = model_code(HIGHSPY, PYOMO, GUROBI)
        return Spec(self.name, story, params, ask, ir, MATH, code, {"piece_size": "kind"})
