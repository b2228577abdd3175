"""Aircraft landing: time single-runway landings in their windows at least penalty (Beasley style, MILP)."""

from __future__ import annotations

import random

from ordata.families.base import Family, Spec, join, model_code
from ordata.ir import Constraint, OptModel, Var
from ordata.params import Param

SCENARIOS = [  # (place, vehicle, verb, names, classes, separation (leader x follower), clock)
    ("airport with a single runway", "flight", "land", ["BA117", "LH402", "AF226", "KL655", "IB310", "EI154",
     "SK903", "TP881"], ["heavy", "medium", "light"], [[4, 5, 6], [3, 3, 5], [3, 3, 3]], "06:00"),
    ("hospital helipad", "helicopter", "land", ["Rescue 1", "Rescue 2", "Medic 3", "Medic 4", "Air 5", "Air 6",
     "Air 7", "Air 8"], ["twin", "single", "light"], [[5, 6, 7], [4, 4, 5], [3, 3, 4]], "08:00"),
    ("canal with a single lock", "ship", "enter the lock", ["Aurora", "Baltic", "Corsair", "Delta", "Elbe", "Fjord",
     "Gull", "Hansa"], ["large", "medium", "small"], [[8, 9, 10], [6, 6, 7], [5, 5, 5]], "07:00"),
    ("drone delivery hub with one landing pad", "drone", "land", ["D-01", "D-02", "D-03", "D-04", "D-05", "D-06",
     "D-07", "D-08"], ["heavy-lift", "standard", "mini"], [[3, 4, 5], [3, 3, 4], [3, 3, 3]], "09:00"),
]

MATH = (
    "**Sets:** vehicles $i, j$.\n"
    "**Parameters:** window $[E_i, L_i]$, target $T_i$, penalties $g_i, h_i$ per minute early / late, separation "
    "$S_{ij}$; $M = \\max_i L_i - \\min_i E_i + \\max_{ij} S_{ij}$.\n"
    "**Variables:** time $x_i \\in [E_i, L_i]$, earliness $a_i \\ge 0$, lateness $b_i \\ge 0$, "
    "$d_{ij} \\in \\{0,1\\}$ ($i$ before $j$, $i < j$).\n"
    "**Objective:** $\\min \\sum_i (g_i a_i + h_i b_i)$.\n"
    "**Constraints:** $x_i + a_i - b_i = T_i$; $x_j \\ge x_i + S_{ij} - M(1 - d_{ij})$ and "
    "$x_i \\ge x_j + S_{ji} - M d_{ij}$ for $i < j$.\n"
)
HIGHSPY = (
    "h = highspy.Highs()\nh.silent()\n"
    "P = range(len(target))\n"
    "big_m = max(latest) - min(earliest) + max(max(row) for row in separation)\n"
    "x = [h.addVariable(lb=earliest[i], ub=latest[i]) for i in P]\n"
    "early = [h.addVariable(lb=0) for _ in P]\n"
    "late = [h.addVariable(lb=0) for _ in P]\n"
    "for i in P:\n"
    "    h.addConstr(x[i] + early[i] - late[i] == target[i])\n"
    "    for j in P:\n"
    "        if i < j:\n"
    "            d = h.addBinary()\n"
    "            h.addConstr(x[j] >= x[i] + separation[i][j] - big_m * (1 - d))\n"
    "            h.addConstr(x[i] >= x[j] + separation[j][i] - big_m * d)\n"
    "h.minimize(sum(early_penalty[i] * early[i] + late_penalty[i] * late[i] for i in P))\n"
)
PYOMO = (
    "m = pyo.ConcreteModel()\n"
    "P = range(len(target))\n"
    "big_m = max(latest) - min(earliest) + max(max(row) for row in separation)\n"
    "pairs = [(i, j) for i in P for j in P if i < j]\n"
    "m.x = pyo.Var(P, bounds=lambda m, i: (earliest[i], latest[i]))\n"
    "m.early = pyo.Var(P, domain=pyo.NonNegativeReals)\n"
    "m.late = pyo.Var(P, domain=pyo.NonNegativeReals)\n"
    "m.d = pyo.Var(pairs, domain=pyo.Binary)\n"
    "m.dev = pyo.Constraint(P, rule=lambda m, i: m.x[i] + m.early[i] - m.late[i] == target[i])\n"
    "m.ij = pyo.Constraint(pairs, rule=lambda m, i, j: m.x[j] >= m.x[i] + separation[i][j] - big_m * (1 - m.d[i, j]))\n"
    "m.ji = pyo.Constraint(pairs, rule=lambda m, i, j: m.x[i] >= m.x[j] + separation[j][i] - big_m * m.d[i, j])\n"
    "m.obj = pyo.Objective(expr=sum(early_penalty[i] * m.early[i] + late_penalty[i] * m.late[i] for i in P),\n"
    "                      sense=pyo.minimize)\n"
)
GUROBI = (
    "P = range(len(target))\n"
    "big_m = max(latest) - min(earliest) + max(max(row) for row in separation)\n"
    "x = [m.addVar(lb=earliest[i], ub=latest[i]) for i in P]\n"
    "early = m.addVars(len(target), lb=0)\n"
    "late = m.addVars(len(target), lb=0)\n"
    "d = m.addVars([(i, j) for i in P for j in P if i < j], vtype=GRB.BINARY)\n"
    "for i in P:\n"
    "    m.addConstr(x[i] + early[i] - late[i] == target[i])\n"
    "for i, j in d:\n"
    "    m.addConstr(x[j] >= x[i] + separation[i][j] - big_m * (1 - d[i, j]))\n"
    "    m.addConstr(x[i] >= x[j] + separation[j][i] - big_m * d[i, j])\n"
    "m.setObjective(gp.quicksum(early_penalty[i] * early[i] + late_penalty[i] * late[i] for i in P), GRB.MINIMIZE)\n"
)


class AircraftLanding(Family):
    name = "aircraft_landing"
    categories = ("MILP",)

    def sample(self, rng: random.Random, size: int, category: str | None = None, infeasible: bool = False) -> Spec:
        self._category(rng, category)
        place, who, verb, names_all, classes, table, clock = rng.choice(SCENARIOS)
        n = size + 2
        P = range(n)
        cls = [rng.randrange(3) for _ in P]
        sep = [[0 if i == j else table[cls[i]][cls[j]] + rng.randint(0, 1) for j in P] for i in P]
        target = [rng.randint(12, 20)]
        target.append(target[0] + rng.randint(0, 2))  # closer than any separation: not every target can be met
        for _ in range(n - 2):
            target.append(target[-1] + rng.randint(2, 10))
        order = sorted(P, key=lambda i: target[i])  # a feasible sequence by target: the windows are built around it
        when: dict[int, int] = {}
        for k in order:
            when[k] = max([target[k]] + [when[p] + sep[p][k] for p in when])
        perm = rng.sample(list(P), n)  # state the vehicles in random order
        target, cls = [target[i] for i in perm], [cls[i] for i in perm]
        sep = [[sep[i][j] for j in perm] for i in perm]
        latest = [when[i] + rng.randint(5, 15) for i in perm]
        earliest = [t - rng.randint(3, 10) for t in target]
        g, hl = [rng.randint(2, 12) * 5 for _ in P], [rng.randint(3, 20) * 5 for _ in P]
        names = [f"{nm} ({classes[c]})" for nm, c in zip(rng.sample(names_all, n), cls)]
        big_m = max(latest) - min(earliest) + max(max(row) for row in sep)
        pairs = [(i, j) for i in P for j in P if i < j]
        var = [Var(f"x_{i}", earliest[i], latest[i]) for i in P] + [Var(f"a_{i}") for i in P]
        var += [Var(f"b_{i}") for i in P] + [Var(f"d_{i}_{j}", 0, 1, "binary") for i, j in pairs]
        cons = [Constraint(f"dev_{i}", {f"x_{i}": 1, f"a_{i}": 1, f"b_{i}": -1}, "==", target[i]) for i in P]
        for i, j in pairs:
            xi, xj, d = f"x_{i}", f"x_{j}", f"d_{i}_{j}"
            cons.append(Constraint(f"ij_{i}_{j}", {xi: 1, xj: -1, d: big_m}, "<=", big_m - sep[i][j]))
            cons.append(Constraint(f"ji_{i}_{j}", {xj: 1, xi: -1, d: -big_m}, "<=", -sep[j][i]))
        obj = {**{f"a_{i}": g[i] for i in P}, **{f"b_{i}": hl[i] for i in P}}
        ir = OptModel(self.name, "min", var, obj, cons)
        params = [
            Param("earliest", "earliest time (minutes)", earliest, names,
                  phrase=f"{{label}} can {verb} from minute {{value}}."),
            Param("target", "target time (minutes)", target, names,
                  phrase=f"{{label}} should {verb} at minute {{value}}."),
            Param("latest", "latest time (minutes)", latest, names,
                  phrase=f"{{label}} must {verb} by minute {{value}}."),
            Param("early_penalty", "penalty per minute early", g, names, unit="$",
                  phrase="Each minute {label} is early costs {value}."),
            Param("late_penalty", "penalty per minute late", hl, names, unit="$",
                  phrase="Each minute {label} is late costs {value}."),
            Param("separation", "minimum separation (minutes)", sep, names, [f"then {nm}" for nm in names],
                  phrase="If {label} goes first, the wait in minutes before each later one is: {values}."),
        ]
        story = (f"A {place} schedules {n} arriving {who}s ({join(names)}); only one {who} can {verb} at a time. "
                 f"Times are in minutes after {clock}; each {who} must {verb} within its window and pays a penalty "
                 f"per minute it is earlier or later than its target. Whenever one {who} goes before another (not "
                 "only directly before), the second must follow at least the separation time for that ordered pair "
                 "(the diagonal entries are 0 and unused). Times may be fractional.")
        ask = f"What is the minimum total earliness and lateness penalty in dollars over all {who}s?"
        code = model_code(HIGHSPY, PYOMO, GUROBI)
        return Spec(self.name, story, params, ask, ir, MATH, code, {"earliest": who})
