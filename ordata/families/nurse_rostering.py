"""Nurse rostering: assign staff to daily shifts covering every requirement at minimum cost (IP)."""

from __future__ import annotations

import random

from ordata.families.base import Family, Spec, join, model_code
from ordata.ir import Constraint, OptModel, Var
from ordata.params import Param

# (ward, staff word, shifts in order from earliest to latest, cost wording, cost unit, staff names)
SCENARIOS = [
    ("a hospital ward", "nurses", ["early", "late", "night"], "preference penalty", "points",
     ["Ada", "Ben", "Cora", "Dev", "Eve", "Finn", "Gita", "Hugo", "Iris", "Jon", "Kim", "Leo", "Mia", "Noor"]),
    ("a care home", "carers", ["morning", "evening"], "wage", "$",
     ["Alba", "Bram", "Cleo", "Dara", "Emil", "Faye", "Gus", "Hana", "Ivan", "Jade", "Kofi", "Lena", "Milo", "Nia"]),
    ("a ambulance base", "paramedics", ["day", "night"], "pay including allowances", "$",
     ["Amir", "Bea", "Carl", "Dina", "Ezra", "Fern", "Glen", "Hope", "Igor", "June", "Kai", "Lucy", "Max", "Nell"]),
    ("an intensive care unit", "nurses", ["early", "late", "night"], "agency fee", "$",
     ["Anya", "Boris", "Chloe", "Dmitri", "Elena", "Femi", "Grace", "Hiro", "Ines", "Jamal", "Kira", "Liam", "Maya",
      "Omar"]),
]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday", "next Monday"]

MATH = (
    "**Sets:** staff $n$, days $d$, shifts $s$ (first = earliest, last = latest).\n"
    "**Parameters:** requirement $r_{ds}$, cost $c_{ns}$, maximum shifts per person $M$.\n"
    "**Variables:** $x_{nds} \\in \\{0,1\\}$, 1 if $n$ works shift $s$ on day $d$.\n"
    "**Objective:** $\\min \\sum_{n,d,s} c_{ns} x_{nds}$.\n"
    "**Constraints:** $\\sum_n x_{nds} \\ge r_{ds}$; $\\sum_s x_{nds} \\le 1$; $\\sum_{d,s} x_{nds} \\le M$; "
    "$x_{n,d,\\mathrm{last}} + x_{n,d+1,\\mathrm{first}} \\le 1$ (no earliest shift right after a latest one).\n"
)
HIGHSPY = (
    "h = highspy.Highs()\nh.silent()\n"
    "N, D, S = range(len(cost)), range(len(required)), range(len(required[0]))\n"
    "x = [[[h.addBinary() for _ in S] for _ in D] for _ in N]\n"
    "for d in D:\n"
    "    for s in S:\n"
    "        h.addConstr(sum(x[n][d][s] for n in N) >= required[d][s])\n"
    "for n in N:\n"
    "    for d in D:\n"
    "        h.addConstr(sum(x[n][d][s] for s in S) <= 1)\n"
    "        if d > 0:\n"
    "            h.addConstr(x[n][d - 1][S[-1]] + x[n][d][0] <= 1)\n"
    "    h.addConstr(sum(x[n][d][s] for d in D for s in S) <= max_shifts)\n"
    "h.minimize(sum(cost[n][s] * x[n][d][s] for n in N for d in D for s in S))\n"
)
PYOMO = (
    "m = pyo.ConcreteModel()\n"
    "N, D, S = range(len(cost)), range(len(required)), range(len(required[0]))\n"
    "m.x = pyo.Var(N, D, S, domain=pyo.Binary)\n"
    "m.cover = pyo.Constraint(D, S, rule=lambda m, d, s: sum(m.x[n, d, s] for n in N) >= required[d][s])\n"
    "m.daily = pyo.Constraint(N, D, rule=lambda m, n, d: sum(m.x[n, d, s] for s in S) <= 1)\n"
    "m.rest = pyo.Constraint(N, D, rule=lambda m, n, d: m.x[n, d - 1, S[-1]] + m.x[n, d, 0] <= 1\n"
    "                        if d > 0 else pyo.Constraint.Skip)\n"
    "m.limit = pyo.Constraint(N, rule=lambda m, n: sum(m.x[n, d, s] for d in D for s in S) <= max_shifts)\n"
    "m.obj = pyo.Objective(expr=sum(cost[n][s] * m.x[n, d, s] for n in N for d in D for s in S),\n"
    "                      sense=pyo.minimize)\n"
)
GUROBI = (
    "N, D, S = range(len(cost)), range(len(required)), range(len(required[0]))\n"
    "x = m.addVars(len(cost), len(required), len(required[0]), vtype=GRB.BINARY)\n"
    "for d in D:\n"
    "    for s in S:\n"
    "        m.addConstr(gp.quicksum(x[n, d, s] for n in N) >= required[d][s])\n"
    "for n in N:\n"
    "    for d in D:\n"
    "        m.addConstr(gp.quicksum(x[n, d, s] for s in S) <= 1)\n"
    "        if d > 0:\n"
    "            m.addConstr(x[n, d - 1, S[-1]] + x[n, d, 0] <= 1)\n"
    "    m.addConstr(gp.quicksum(x[n, d, s] for d in D for s in S) <= max_shifts)\n"
    "m.setObjective(gp.quicksum(cost[n][s] * x[n, d, s] for n in N for d in D for s in S), GRB.MINIMIZE)\n"
)


def feasible_roster(required: list[list[int]], n_staff: int) -> list[int]:
    """Shifts per person in a greedy roster that meets every requirement and the rest rule."""
    load, last = [0] * n_staff, set()
    for day in required:
        order = sorted(range(n_staff), key=lambda n: (load[n], n))
        first = [n for n in order if n not in last][:day[0]]
        rest = [n for n in order if n not in first]
        shift_of = dict.fromkeys(first, 0)
        k = 0
        for s in range(1, len(day)):
            shift_of.update(dict.fromkeys(rest[k:k + day[s]], s))
            k += day[s]
        for n in shift_of:
            load[n] += 1
        last = {n for n, s in shift_of.items() if s == len(day) - 1}
    return load


class NurseRostering(Family):
    name = "nurse_rostering"
    categories = ("IP",)

    def sample(self, rng: random.Random, size: int, category: str | None = None, infeasible: bool = False) -> Spec:
        self._category(rng, category)
        ward, staff, shifts, cost_word, unit, names = rng.choice(SCENARIOS)
        days, n_s = DAYS[:size + 2], len(shifts)
        required = [[rng.randint(1, 1 + min(size, 6) // 2) for _ in shifts] for _ in days]
        # enough staff for the greedy roster: per day, all shifts, and the first shift without last night's staff
        need = max(max(sum(r) for r in required),
                   max(required[d][0] + (required[d - 1][-1] if d else 0) for d in range(len(days))))
        n_n = min(len(names), need + rng.randint(0, 2))
        people = rng.sample(names, n_n)
        max_shifts = max(feasible_roster(required, n_n))
        cost = [[rng.randint(2, 20) * (10 if unit == "$" else 1) for _ in shifts] for _ in people]
        N, D, S = range(n_n), range(len(days)), range(n_s)
        idx = [(n, d, s) for n in N for d in D for s in S]
        var = [Var(f"x_{n}_{d}_{s}", 0, 1, "binary") for n, d, s in idx]
        cons = [Constraint(f"cover_{d}_{s}", {f"x_{n}_{d}_{s}": 1 for n in N}, ">=", required[d][s])
                for d in D for s in S]
        for n in N:
            for d in D:
                cons.append(Constraint(f"daily_{n}_{d}", {f"x_{n}_{d}_{s}": 1 for s in S}, "<=", 1))
                if d > 0:
                    rest = {f"x_{n}_{d - 1}_{n_s - 1}": 1, f"x_{n}_{d}_0": 1}
                    cons.append(Constraint(f"rest_{n}_{d}", rest, "<=", 1))
            cons.append(Constraint(f"limit_{n}", {f"x_{n}_{d}_{s}": 1 for d in D for s in S}, "<=", max_shifts))
        ir = OptModel(self.name, "min", var, {f"x_{n}_{d}_{s}": cost[n][s] for n, d, s in idx}, cons)
        params = [
            Param("max_shifts", "maximum shifts per person", max_shifts,
                  phrase=f"No one may work more than {{value}} shifts over the {len(days)} days."),
            Param("required", f"{staff} required", required, days, shifts,
                  phrase=f"On {{label}} the {staff} required per shift are: {{values}}."),
            Param("cost", f"{cost_word} per shift", cost, people, shifts, unit=unit,
                  phrase=f"For {{label}}, the {cost_word} per shift is: {{values}}."),
        ]
        story = (f"{ward[0].upper()}{ward[1:]} rosters {n_n} {staff} ({join(people)}) over {len(days)} days "
                 f"({join(days)}), each day having {n_s} shifts ({join(shifts)}). Each person works at most one "
                 f"shift a day, and nobody may work the {shifts[0]} shift on the day right after working the "
                 f"{shifts[-1]} shift. Each shift a person works incurs that person's {cost_word} for that shift.")
        ask = (f"Which roster meets every requirement (at least the required number of {staff} on each shift) "
               f"at minimum total {cost_word}? What is that minimum total?")
        code = model_code(HIGHSPY, PYOMO, GUROBI)
        return Spec(self.name, story, params, ask, ir, MATH, code)
