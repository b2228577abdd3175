"""Problem families: random, realistic OR instances rendered as question, math model and program.

A family samples its data from a scenario catalogue, builds the IR (solved for the ground truth),
and renders three views of the same data: the natural-language question, a LaTeX-flavoured
mathematical model and a reference Python program (highspy modelling API) that prints its optimum.
Add a family by subclassing :class:`Family` and registering it in :data:`FAMILIES`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, ClassVar

from ordata.ir import Constraint, LinearModel, Var

PROGRAM_FOOTER = 'print("Optimal objective:", h.getInfo().objective_function_value)\n'


@dataclass
class Instance:
    family: str
    data: dict[str, Any]
    ir: LinearModel
    question: str
    math_model: str
    program: str

    @property
    def category(self) -> str:
        return self.ir.category


def _fmt_list(xs: list) -> str:
    return "[" + ", ".join(str(x) for x in xs) + "]"


def _fmt_matrix(rows: list[list]) -> str:
    return "[" + ", ".join(_fmt_list(r) for r in rows) + "]"


def _join(words: list[str]) -> str:
    return ", ".join(words[:-1]) + " and " + words[-1] if len(words) > 1 else words[0]


class Family:
    name: ClassVar[str]
    categories: ClassVar[tuple[str, ...]]

    def sample(self, rng: random.Random, size: int) -> Instance:
        raise NotImplementedError


# --------------------------------------------------------------------------------------------------
class ProductionPlanning(Family):
    """Maximise profit of a product mix under resource capacities (LP)."""

    name = "production"
    categories = ("LP",)
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

    def sample(self, rng: random.Random, size: int) -> Instance:
        place, products_all, resources_all = rng.choice(self.SCENARIOS)
        n_p = size
        n_r = max(2, min(len(resources_all), size - rng.randint(0, 1)))
        products = rng.sample(products_all, n_p)
        resources = rng.sample(resources_all, n_r)
        profit = [rng.randint(5, 60) for _ in products]
        usage = [[rng.randint(1, 9) for _ in products] for _ in resources]
        available = [rng.randint(40, 400) for _ in resources]
        data = {"products": products, "resources": resources, "profit": profit, "usage": usage, "available": available}
        var = [Var(f"x_{p}") for p in range(n_p)]
        cons = [Constraint(f"cap_{r}", {f"x_{p}": usage[r][p] for p in range(n_p)}, "<=", available[r]) for r in range(n_r)]
        ir = LinearModel(self.name, "max", var, {f"x_{p}": profit[p] for p in range(n_p)}, cons)

        lines = [f"A {place} makes {_join(products)}."]
        lines += [f"Each unit of {products[p]} earns a profit of ${profit[p]}." for p in range(n_p)]
        for r, res in enumerate(resources):
            name, unit = res.split(" (")
            per = ", ".join(f"{usage[r][p]} for {products[p]}" for p in range(n_p))
            lines.append(f"Per unit, the {name} needed ({unit[:-1]}) is {per}; {available[r]} are available.")
        lines.append("Production quantities may be fractional. How much of each should be made to maximise total profit?")
        question = " ".join(lines)
        math_model = (
            "**Sets:** products $p$, resources $r$.\n"
            "**Parameters:** profit $c_p$, usage $a_{rp}$, availability $b_r$.\n"
            "**Variables:** $x_p \\ge 0$, units of product $p$.\n"
            "**Objective:** $\\max \\sum_p c_p x_p$.\n"
            "**Constraints:** $\\sum_p a_{rp} x_p \\le b_r$ for every resource $r$.\n"
        )
        pairs = ", ".join(f"({_fmt_list(usage[r])}, {available[r]})" for r in range(n_r))
        program = (
            "import highspy\n\n"
            f"profit = {_fmt_list(profit)}\n"
            f"resources = [{pairs}]  # (usage per unit of each product, amount available)\n\n"
            "h = highspy.Highs()\nh.silent()\n"
            "x = [h.addVariable(lb=0) for _ in profit]\n"
            "for usage, available in resources:\n"
            "    h.addConstr(sum(u * xp for u, xp in zip(usage, x)) <= available)\n"
            "h.maximize(sum(c * xp for c, xp in zip(profit, x)))\n" + PROGRAM_FOOTER
        )
        return Instance(self.name, data, ir, question, math_model, program)


# --------------------------------------------------------------------------------------------------
class Knapsack(Family):
    """Select items under a capacity to maximise value (binary IP)."""

    name = "knapsack"
    categories = ("IP",)
    SCENARIOS = [
        ("hiker", "backpack", "kg", ["tent", "stove", "camera", "water filter", "lamp", "rope", "first-aid kit", "jacket"]),
        ("cargo airline", "aircraft", "tonnes", ["machinery", "textiles", "medicine", "electronics", "food", "auto parts", "books", "paper"]),
        ("investment fund", "budget", "million dollars", ["solar farm", "bridge", "school", "hospital", "data centre", "rail link", "port", "wind farm"]),
        ("delivery van", "van", "cubic metres", ["fridges", "sofas", "mattresses", "bicycles", "boxes", "desks", "lamps", "washers"]),
    ]

    def sample(self, rng: random.Random, size: int) -> Instance:
        who, holder, unit, items_all = rng.choice(self.SCENARIOS)
        n = size + 1
        items = rng.sample(items_all, n)
        weight = [rng.randint(2, 30) for _ in items]
        value = [rng.randint(5, 90) for _ in items]
        capacity = max(max(weight), int(sum(weight) * rng.uniform(0.35, 0.65)))
        data = {"items": items, "weight": weight, "value": value, "capacity": capacity}
        var = [Var(f"y_{i}", 0, 1, "binary") for i in range(n)]
        cons = [Constraint("capacity", {f"y_{i}": weight[i] for i in range(n)}, "<=", capacity)]
        ir = LinearModel(self.name, "max", var, {f"y_{i}": value[i] for i in range(n)}, cons)

        desc = "; ".join(f"{items[i]}: {weight[i]} {unit}, value {value[i]}" for i in range(n))
        question = (
            f"A {who} must choose what to put in the {holder}, which has a capacity of {capacity} {unit}. "
            f"The candidates (size and value) are: {desc}. Each candidate is taken whole or not at all. "
            "Which selection maximises the total value?"
        )
        math_model = (
            "**Sets:** items $i$.\n"
            "**Parameters:** size $w_i$, value $v_i$, capacity $C$.\n"
            "**Variables:** $y_i \\in \\{0,1\\}$, 1 if item $i$ is selected.\n"
            "**Objective:** $\\max \\sum_i v_i y_i$.\n"
            "**Constraints:** $\\sum_i w_i y_i \\le C$.\n"
        )
        pairs = ", ".join(f"({weight[i]}, {value[i]})" for i in range(n))
        program = (
            "import highspy\n\n"
            f"capacity = {capacity}\n"
            f"items = [{pairs}]  # (size, value)\n\n"
            "h = highspy.Highs()\nh.silent()\n"
            "take = [h.addBinary() for _ in items]\n"
            "h.addConstr(sum(size * t for (size, value), t in zip(items, take)) <= capacity)\n"
            "h.maximize(sum(value * t for (size, value), t in zip(items, take)))\n" + PROGRAM_FOOTER
        )
        return Instance(self.name, data, ir, question, math_model, program)


# --------------------------------------------------------------------------------------------------
class Transportation(Family):
    """Ship from supply points to demand points at minimum cost (LP)."""

    name = "transportation"
    categories = ("LP",)
    SCENARIOS = [
        ("warehouses", "stores", "pallets"),
        ("factories", "distribution centres", "tonnes"),
        ("farms", "markets", "crates"),
        ("refineries", "depots", "kilolitres"),
    ]
    CITIES = ["Aston", "Bayview", "Cedar", "Dover", "Elmira", "Fairfax", "Glenwood", "Hampton", "Irvine", "Jasper"]

    def sample(self, rng: random.Random, size: int) -> Instance:
        src, dst, unit = rng.choice(self.SCENARIOS)
        n_s = max(2, size - 1)
        n_d = size
        names = rng.sample(self.CITIES, n_s + n_d)
        sources, sinks = names[:n_s], names[n_s:]
        demand = [rng.randint(20, 120) for _ in sinks]
        total = sum(demand)
        weights = [rng.uniform(0.5, 1.5) for _ in sources]
        slack = rng.uniform(1.05, 1.4)
        supply = [max(1, round(total * slack * w / sum(weights))) for w in weights]
        cost = [[rng.randint(2, 25) for _ in sinks] for _ in sources]
        data = {"sources": sources, "sinks": sinks, "supply": supply, "demand": demand, "cost": cost}
        var = [Var(f"x_{i}_{j}") for i in range(n_s) for j in range(n_d)]
        cons = [Constraint(f"supply_{i}", {f"x_{i}_{j}": 1 for j in range(n_d)}, "<=", supply[i]) for i in range(n_s)]
        cons += [Constraint(f"demand_{j}", {f"x_{i}_{j}": 1 for i in range(n_s)}, ">=", demand[j]) for j in range(n_d)]
        ir = LinearModel(self.name, "min", var, {f"x_{i}_{j}": cost[i][j] for i in range(n_s) for j in range(n_d)}, cons)

        lines = [f"A company ships {unit} from {n_s} {src} ({_join(sources)}) to {n_d} {dst} ({_join(sinks)})."]
        lines.append("Supplies: " + ", ".join(f"{sources[i]} {supply[i]}" for i in range(n_s)) + ".")
        lines.append("Demands: " + ", ".join(f"{sinks[j]} {demand[j]}" for j in range(n_d)) + ".")
        for i in range(n_s):
            lines.append(f"Cost per unit from {sources[i]}: " + ", ".join(f"to {sinks[j]} ${cost[i][j]}" for j in range(n_d)) + ".")
        lines.append("Every demand must be met without exceeding any supply. What is the minimum total shipping cost?")
        question = " ".join(lines)
        math_model = (
            "**Sets:** sources $i$, destinations $j$.\n"
            "**Parameters:** supply $s_i$, demand $d_j$, unit cost $c_{ij}$.\n"
            "**Variables:** $x_{ij} \\ge 0$, amount shipped from $i$ to $j$.\n"
            "**Objective:** $\\min \\sum_{i,j} c_{ij} x_{ij}$.\n"
            "**Constraints:** $\\sum_j x_{ij} \\le s_i$ for all $i$; $\\sum_i x_{ij} \\ge d_j$ for all $j$.\n"
        )
        program = (
            "import highspy\n\n"
            f"supply = {_fmt_list(supply)}\n"
            f"demand = {_fmt_list(demand)}\n"
            f"cost = {_fmt_matrix(cost)}\n\n"
            "h = highspy.Highs()\nh.silent()\n"
            "x = [[h.addVariable(lb=0) for _ in demand] for _ in supply]\n"
            "for i in range(len(supply)):\n"
            "    h.addConstr(sum(x[i]) <= supply[i])\n"
            "for j in range(len(demand)):\n"
            "    h.addConstr(sum(x[i][j] for i in range(len(supply))) >= demand[j])\n"
            "h.minimize(sum(cost[i][j] * x[i][j] for i in range(len(supply)) for j in range(len(demand))))\n"
            + PROGRAM_FOOTER
        )
        return Instance(self.name, data, ir, question, math_model, program)


FAMILIES: dict[str, Family] = {f.name: f for f in (ProductionPlanning(), Knapsack(), Transportation())}


def get_family(name: str) -> Family:
    if name not in FAMILIES:
        raise KeyError(f"unknown problem family {name!r}; known: {', '.join(sorted(FAMILIES))}")
    return FAMILIES[name]
