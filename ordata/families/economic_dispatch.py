"""Economic dispatch: the cheapest outputs of units with quadratic costs meeting a demand (convex QP, NLP)."""

from __future__ import annotations

import random

from ordata.families.base import Family, Spec, join, model_code
from ordata.ir import Constraint, OptModel, Var
from ordata.params import Param

# operator, units, names, output unit, remote area and its link, max output, linear and quadratic cost ranges
SCENARIOS = [
    ("power utility", "generators", ["Alder", "Birch", "Cedar", "Elm", "Hazel", "Maple", "Rowan", "Willow"], "MW",
     "the northern area", "tie line", (100, 500), (12, 45), (0.002, 0.03)),
    ("island grid operator", "generators", ["Diesel 1", "Diesel 2", "Gas 1", "Gas 2", "Wind-diesel", "Biogas",
     "Gas 3", "Diesel 3"], "MW", "the neighbouring island", "subsea cable", (10, 80), (40, 110), (0.05, 0.6)),
    ("district heating company", "heat plants", ["Plant A", "Plant B", "Plant C", "Plant D", "Plant E", "Plant F",
     "Plant G", "Plant H"], "MW of heat", "the industrial zone", "transmission pipe", (20, 150), (15, 40), (0.01, 0.2)),
    ("water utility", "treatment works", ["Ashgrove", "Bramley", "Colne", "Dunmore", "Eastfield", "Fernhill",
     "Glenside", "Holloway"], "megalitres per day", "the upland valley", "trunk main", (20, 120), (30, 90),
     (0.05, 0.5)),
]

MATH = (
    "**Sets:** units $g$; remote units $g \\in R$ ($\\rho_g = 1$).\n"
    "**Parameters:** cost coefficients $a_g, b_g$, output limits $P^{min}_g, P^{max}_g$, demand $D$, link limit $F$.\n"
    "**Variables:** $P^{min}_g \\le p_g \\le P^{max}_g$, output of unit $g$.\n"
    "**Objective:** $\\min \\sum_g (a_g p_g^2 + b_g p_g)$.\n"
    "**Constraints:** $\\sum_g p_g = D$; $\\sum_g \\rho_g p_g \\le F$.\n"
)
HIGHSPY = (
    "h = highspy.Highs()\nh.silent()\n"
    "n = len(max_output)\n"
    "p = [h.addVariable(lb=min_output[g], ub=max_output[g], obj=linear_cost[g]) for g in range(n)]\n"
    "h.addConstr(sum(p) == demand)\n"
    "h.addConstr(sum(remote[g] * p[g] for g in range(n)) <= link_limit)\n"
    "# HiGHS minimises c'p + 1/2 p'Qp: Q is diagonal with entries 2 * quadratic_cost\n"
    "hessian = [2 * quadratic_cost[g] for g in range(n)]\n"
    "h.passHessian(n, n, highspy.HessianFormat.kTriangular, list(range(n + 1)), list(range(n)), hessian)\n"
    "h.run()\n"
)
PYOMO = (
    "m = pyo.ConcreteModel()\n"
    "G = range(len(max_output))\n"
    "m.p = pyo.Var(G, bounds=lambda m, g: (min_output[g], max_output[g]))\n"
    "m.meet = pyo.Constraint(expr=sum(m.p[g] for g in G) == demand)\n"
    "m.link = pyo.Constraint(expr=sum(remote[g] * m.p[g] for g in G) <= link_limit)\n"
    "m.obj = pyo.Objective(expr=sum(quadratic_cost[g] * m.p[g] ** 2 + linear_cost[g] * m.p[g] for g in G),\n"
    "                      sense=pyo.minimize)\n"
)
GUROBI = (
    "G = range(len(max_output))\n"
    "p = m.addVars(len(max_output), lb=min_output, ub=max_output)\n"
    "m.addConstr(p.sum() == demand)\n"
    "m.addConstr(gp.quicksum(remote[g] * p[g] for g in G) <= link_limit)\n"
    "m.setObjective(gp.quicksum(quadratic_cost[g] * p[g] * p[g] + linear_cost[g] * p[g] for g in G), GRB.MINIMIZE)\n"
)


class EconomicDispatch(Family):
    name = "economic_dispatch"
    categories = ("NLP",)

    def sample(self, rng: random.Random, size: int, category: str | None = None, infeasible: bool = False) -> Spec:
        self._category(rng, category)
        who, units_word, names, unit, area, link, pmax_r, b_r, a_r = rng.choice(SCENARIOS)
        n = size + 2
        units = rng.sample(names, n)
        remote = [1 if g < max(1, n // 2 - rng.randint(0, 1)) else 0 for g in range(n)]
        rng.shuffle(remote)
        pmax = [rng.randint(*pmax_r) for _ in units]
        pmin = [round(pmax[g] * rng.uniform(0.1, 0.3)) for g in range(n)]
        lin = [round(rng.uniform(*b_r) * (0.7 if remote[g] else 1.0), 2) for g in range(n)]  # remote units are cheaper
        quad = [max(0.001, round(rng.uniform(*a_r), 3)) for _ in units]
        r_min = sum(q for q, r in zip(pmin, remote) if r)
        r_max = sum(q for q, r in zip(pmax, remote) if r)
        limit = rng.randint(r_min + max(1, (r_max - r_min) // 4), r_max - (r_max - r_min) // 4)  # fits remote minimums
        hi = sum(q for q, r in zip(pmax, remote) if not r) + limit
        demand = rng.randint(sum(pmin) + 1, max(sum(pmin) + 1, round(sum(pmin) + 0.9 * (hi - sum(pmin)))))
        G = range(n)
        var = [Var(f"p_{g}", pmin[g], pmax[g]) for g in G]
        cons = [Constraint("meet", {f"p_{g}": 1 for g in G}, "==", demand),
                Constraint("link", {f"p_{g}": 1 for g in G if remote[g]}, "<=", limit)]
        squares = [(f"p_{g}", f"p_{g}", quad[g]) for g in G]
        ir = OptModel(self.name, "min", var, {f"p_{g}": lin[g] for g in G}, cons, squares)
        params = [
            Param("demand", f"total demand ({unit})", demand,
                  phrase=f"The total demand of {{value}} {unit} must be met exactly."),
            Param("min_output", f"minimum output ({unit})", pmin, units,
                  phrase=f"{{label}} must produce at least {{value}} {unit}."),
            Param("max_output", f"maximum output ({unit})", pmax, units,
                  phrase=f"{{label}} can produce at most {{value}} {unit}."),
            Param("linear_cost", "linear cost coefficient b", lin, units, unit="$",
                  phrase="The linear cost coefficient b of {label} is {value}."),
            Param("quadratic_cost", "quadratic cost coefficient a", quad, units, unit="$",
                  phrase="The quadratic cost coefficient a of {label} is {value}."),
            Param("remote", f"in {area} (1 = yes)", remote, units,
                  phrase=f"{{label}} lies in {area}: {{value}} (1 = yes, 0 = no)."),
            Param("link_limit", f"{link} limit ({unit})", limit,
                  phrase=f"The {link} from {area} carries at most {{value}} {unit} in total."),
        ]
        story = (f"A {who} dispatches its {units_word} {join(units)}. Producing an output of p {unit} at a unit costs "
                 f"a * p^2 + b * p dollars, with the coefficients a and b of that unit; every unit runs between its "
                 f"minimum and maximum output. Units in {area} reach the demand only through the {link}.")
        ask = "Outputs may be fractional. What is the minimum total cost of meeting the demand?"
        code = model_code(HIGHSPY, PYOMO, GUROBI, pyomo_solver="highs")  # appsi_highs has no QP
        return Spec(self.name, story, params, ask, ir, MATH, code, {"min_output": "unit"})
