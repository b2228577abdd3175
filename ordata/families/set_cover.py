"""Set cover: the cheapest choice of sites covering every demand point (binary IP, optional multi-cover)."""

from __future__ import annotations

import random

from ordata.families.base import Family, Spec, join, model_code
from ordata.ir import Constraint, OptModel, Var
from ordata.params import Param

# (who, chosen thing, point word, "reaches", cost range and step, candidate names, point names)
SCENARIOS = [
    ("A city fire service builds fire stations", "station", "neighbourhood", "would reach", (20, 90, 10000),
     ["Northgate", "Riverside", "Old Town", "Hilltop", "Market Square", "Parkside", "Docklands", "Westfield",
      "Quayside"],
     ["Ashby", "Brook", "Carlton", "Denton", "Easton", "Fulton", "Garston", "Halton", "Ilford", "Kenton", "Lydford",
      "Marston", "Norton", "Oakley"]),
    ("A telecom operator erects radio masts", "mast", "village", "would serve", (30, 120, 1000),
     ["Beacon Hill", "Crag Top", "Windy Ridge", "Lookout", "Pine Knoll", "Stony Peak", "High Moor", "Cairn Point",
      "Eagle Rock"],
     ["Alder", "Bramley", "Colby", "Dunham", "Elstow", "Felton", "Glaston", "Hawley", "Ickford", "Kelby", "Langley",
      "Milton", "Newby", "Orton"]),
    ("A festival organiser hires security teams", "team", "zone", "patrols", (8, 30, 100),
     ["Alpha", "Bravo", "Charlie", "Delta", "Echo", "Foxtrot", "Golf", "Hotel", "India"],
     ["main stage", "north gate", "south gate", "food court", "car park", "VIP area", "first-aid tent", "bar",
      "camping field", "merch stand", "backstage", "east entrance", "west entrance", "ticket office"]),
    ("A start-up hires contractors", "contractor", "skill", "offers", (20, 90, 50),
     ["Apex", "Bright", "Cobalt", "Dynamo", "Ember", "Fable", "Granite", "Helix", "Indigo"],
     ["Python", "SQL", "design", "testing", "cloud", "security", "data analysis", "networking", "mobile",
      "copywriting", "marketing", "accounting", "legal", "translation"]),
]

MATH = (
    "**Sets:** candidates $i$, points $j$.\n"
    "**Parameters:** cost $c_i$, coverage $a_{ij} \\in \\{0,1\\}${need_par}.\n"
    "**Variables:** $x_i \\in \\{0,1\\}$, 1 if candidate $i$ is chosen.\n"
    "**Objective:** $\\min \\sum_i c_i x_i$.\n"
    "**Constraints:** $\\sum_i a_{ij} x_i \\ge {need_math}$ for every point $j$.\n"
)
HIGHSPY = (
    "h = highspy.Highs()\nh.silent()\n"
    "S, P = range(len(cost)), range(len(covers[0]))\n"
    "x = [h.addBinary() for _ in S]\n"
    "for j in P:\n"
    "    h.addConstr(sum(covers[i][j] * x[i] for i in S) >= {need})\n"
    "h.minimize(sum(cost[i] * x[i] for i in S))\n"
)
PYOMO = (
    "m = pyo.ConcreteModel()\n"
    "S, P = range(len(cost)), range(len(covers[0]))\n"
    "m.x = pyo.Var(S, domain=pyo.Binary)\n"
    "m.cover = pyo.Constraint(P, rule=lambda m, j: sum(covers[i][j] * m.x[i] for i in S) >= {need})\n"
    "m.obj = pyo.Objective(expr=sum(cost[i] * m.x[i] for i in S), sense=pyo.minimize)\n"
)
GUROBI = (
    "S, P = range(len(cost)), range(len(covers[0]))\n"
    "x = m.addVars(len(cost), vtype=GRB.BINARY)\n"
    "for j in P:\n"
    "    m.addConstr(gp.quicksum(covers[i][j] * x[i] for i in S) >= {need})\n"
    "m.setObjective(gp.quicksum(cost[i] * x[i] for i in S), GRB.MINIMIZE)\n"
)


class SetCover(Family):
    name = "set_cover"
    categories = ("IP",)

    def sample(self, rng: random.Random, size: int, category: str | None = None, infeasible: bool = False) -> Spec:
        self._category(rng, category)
        who, thing, point, verb, (lo, hi, step), site_names, point_names = rng.choice(SCENARIOS)
        n_s, n_p = size + 3, 2 * size + 2
        sites, points = rng.sample(site_names, n_s), rng.sample(point_names, n_p)
        multi = rng.random() < 0.5
        required = [rng.choice([1, 2]) for _ in points] if multi else [1] * n_p
        if multi and max(required) == 1:
            required[rng.randrange(n_p)] = 2
        cost = [rng.randint(lo, hi) * step for _ in sites]
        covers = [[int(rng.random() < 0.35) for _ in points] for _ in sites]
        for j in range(n_p):  # every point coverable as often as required
            while sum(row[j] for row in covers) < required[j]:
                rng.choice([row for row in covers if not row[j]])[j] = 1
        for row in covers:  # every candidate covers something
            if not any(row):
                row[rng.randrange(n_p)] = 1
        var = [Var(f"x_{i}", 0, 1, "binary") for i in range(n_s)]
        cons = [Constraint(f"cover_{j}", {f"x_{i}": 1 for i in range(n_s) if covers[i][j]}, ">=", required[j])
                for j in range(n_p)]
        ir = OptModel(self.name, "min", var, {f"x_{i}": cost[i] for i in range(n_s)}, cons)
        params = [
            Param("cost", f"cost per {thing}", cost, sites, unit="$",
                  phrase=f"Choosing the {{label}} {thing} costs {{value}}."),
            Param("covers", f"{verb} (1 = yes)", covers, sites, points,
                  phrase=f"The {{label}} {thing} {verb} (1 = yes, 0 = no): {{values}}."),
        ]
        if multi:
            params.append(Param("required", f"{thing}s required", required, points,
                                phrase=f"The {point} {{label}} needs at least {{value}} {thing}(s)."))
        story = (f"{who}: it may choose any of {n_s} candidate {thing}s ({join(sites)}) to cover {n_p} "
                 f"{point}s ({join(points)}).")
        rule = (f"each {point} must be covered by at least its required number of chosen {thing}s" if multi
                else f"each {point} must be covered by at least one chosen {thing}")
        ask = (f"A chosen {thing} covers exactly the {point}s marked 1 for it; {rule}. "
               f"Each {thing} is chosen at most once. What is the minimum total cost?")
        need = "required[j]" if multi else "1"
        math = MATH.replace("{need_par}", ", requirement $r_j$" if multi else "")
        math = math.replace("{need_math}", "r_j" if multi else "1")
        code = model_code(HIGHSPY.replace("{need}", need), PYOMO.replace("{need}", need),
                          GUROBI.replace("{need}", need))
        return Spec(self.name, story, params, ask, ir, math, code, {"cost": thing, "required": point})
