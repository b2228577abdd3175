"""Permutation flow shop: one job sequence for all machines, minimising makespan or weighted completion (MILP)."""

from __future__ import annotations

import random

from ordata.families.base import Family, Spec, join, model_code
from ordata.ir import Constraint, OptModel, Var
from ordata.params import Param

SCENARIOS = [  # (line, job word (one, many), job names, stages in line order, time unit)
    ("car wash", ("car", "cars"), ["Audi", "BMW", "Fiat", "Ford", "Kia", "Opel", "Seat", "Volvo"],
     ["washing", "rinsing", "drying", "polishing"], "minutes"),
    ("bakery line", ("batch", "batches"),
     ["rye", "sourdough", "baguettes", "rolls", "brioche", "bagels", "spelt", "pretzels"],
     ["mixing", "proofing", "baking", "packing"], "minutes"),
    ("circuit-board line", ("board", "boards"), ["B-11", "B-12", "B-13", "B-14", "B-15", "B-16", "B-17", "B-18"],
     ["solder paste", "placement", "reflow", "inspection"], "minutes"),
    ("furniture workshop", ("order", "orders"), ["Ames", "Baker", "Cole", "Dunn", "Ellis", "Frost", "Grant", "Hale"],
     ["cutting", "sanding", "painting", "varnishing"], "hours"),
]

MATH = (
    "**Sets:** jobs $i, j$, machines $k = 1..m$ (every job visits them in this order).\n"
    "**Parameters:** processing time $p_{jk}$, weight $w_j$ (weighted variant), $M = \\sum_{j,k} p_{jk}$.\n"
    "**Variables:** start $s_{jk} \\ge 0$, $y_{ij} \\in \\{0,1\\}$ ($i$ before $j$ on every machine, $i < j$), "
    "completion $C_j \\ge 0$ or makespan $C \\ge 0$.\n"
    "**Objective:** $\\min C$ (makespan) or $\\min \\sum_j w_j C_j$.\n"
    "**Constraints:** $s_{j,k+1} \\ge s_{jk} + p_{jk}$; $s_{ik} + p_{ik} \\le s_{jk} + M(1 - y_{ij})$ and "
    "$s_{jk} + p_{jk} \\le s_{ik} + M y_{ij}$ for every $k$; $C_j$ (or $C$) $\\ge s_{jm} + p_{jm}$.\n"
)
HIGHSPY = (
    "h = highspy.Highs()\nh.silent()\n"
    "J, K = range(len(proc_time)), range(len(proc_time[0]))\n"
    "big_m = sum(sum(row) for row in proc_time)\n"
    "last = len(proc_time[0]) - 1\n"
    "s = [[h.addVariable(lb=0) for _ in K] for _ in J]\n"
    "for j in J:\n"
    "    for k in range(last):\n"
    "        h.addConstr(s[j][k + 1] >= s[j][k] + proc_time[j][k])\n"
    "for i in J:\n"
    "    for j in J:\n"
    "        if i < j:\n"
    "            y = h.addBinary()\n"
    "            for k in K:\n"
    "                h.addConstr(s[i][k] + proc_time[i][k] <= s[j][k] + big_m * (1 - y))\n"
    "                h.addConstr(s[j][k] + proc_time[j][k] <= s[i][k] + big_m * y)\n"
)
PYOMO = (
    "m = pyo.ConcreteModel()\n"
    "J, K = range(len(proc_time)), range(len(proc_time[0]))\n"
    "big_m = sum(sum(row) for row in proc_time)\n"
    "last = len(proc_time[0]) - 1\n"
    "pairs = [(i, j) for i in J for j in J if i < j]\n"
    "m.s = pyo.Var(J, K, domain=pyo.NonNegativeReals)\n"
    "m.y = pyo.Var(pairs, domain=pyo.Binary)\n"
    "m.cons = pyo.ConstraintList()\n"
    "for j in J:\n"
    "    for k in range(last):\n"
    "        m.cons.add(m.s[j, k + 1] >= m.s[j, k] + proc_time[j][k])\n"
    "for i, j in pairs:\n"
    "    for k in K:\n"
    "        m.cons.add(m.s[i, k] + proc_time[i][k] <= m.s[j, k] + big_m * (1 - m.y[i, j]))\n"
    "        m.cons.add(m.s[j, k] + proc_time[j][k] <= m.s[i, k] + big_m * m.y[i, j])\n"
)
GUROBI = (
    "J, K = range(len(proc_time)), range(len(proc_time[0]))\n"
    "big_m = sum(sum(row) for row in proc_time)\n"
    "last = len(proc_time[0]) - 1\n"
    "s = m.addVars(len(proc_time), len(proc_time[0]), lb=0)\n"
    "y = m.addVars([(i, j) for i in J for j in J if i < j], vtype=GRB.BINARY)\n"
    "for j in J:\n"
    "    for k in range(last):\n"
    "        m.addConstr(s[j, k + 1] >= s[j, k] + proc_time[j][k])\n"
    "for i, j in y:\n"
    "    for k in K:\n"
    "        m.addConstr(s[i, k] + proc_time[i][k] <= s[j, k] + big_m * (1 - y[i, j]))\n"
    "        m.addConstr(s[j, k] + proc_time[j][k] <= s[i, k] + big_m * y[i, j])\n"
)
TAILS = {  # objective part per variant: (highspy, pyomo, gurobipy)
    "makespan": (
        "c_max = h.addVariable(lb=0)\nfor j in J:\n    h.addConstr(c_max >= s[j][last] + proc_time[j][last])\n"
        "h.minimize(c_max)\n",
        "m.c_max = pyo.Var(domain=pyo.NonNegativeReals)\n"
        "m.end = pyo.Constraint(J, rule=lambda m, j: m.c_max >= m.s[j, last] + proc_time[j][last])\n"
        "m.obj = pyo.Objective(expr=m.c_max, sense=pyo.minimize)\n",
        "c_max = m.addVar(lb=0)\nfor j in J:\n    m.addConstr(c_max >= s[j, last] + proc_time[j][last])\n"
        "m.setObjective(c_max, GRB.MINIMIZE)\n"),
    "weighted": (
        "finish = [h.addVariable(lb=0) for _ in J]\n"
        "for j in J:\n    h.addConstr(finish[j] >= s[j][last] + proc_time[j][last])\n"
        "h.minimize(sum(weight[j] * finish[j] for j in J))\n",
        "m.finish = pyo.Var(J, domain=pyo.NonNegativeReals)\n"
        "m.end = pyo.Constraint(J, rule=lambda m, j: m.finish[j] >= m.s[j, last] + proc_time[j][last])\n"
        "m.obj = pyo.Objective(expr=sum(weight[j] * m.finish[j] for j in J), sense=pyo.minimize)\n",
        "finish = m.addVars(len(proc_time), lb=0)\n"
        "for j in J:\n    m.addConstr(finish[j] >= s[j, last] + proc_time[j][last])\n"
        "m.setObjective(gp.quicksum(weight[j] * finish[j] for j in J), GRB.MINIMIZE)\n"),
}


class FlowShop(Family):
    name = "flow_shop"
    categories = ("MILP",)

    def sample(self, rng: random.Random, size: int, category: str | None = None, infeasible: bool = False) -> Spec:
        self._category(rng, category)
        line, (one, job_word), names, stages_all, unit = rng.choice(SCENARIOS)
        variant = rng.choice(sorted(TAILS))
        n, n_m = size + 1, min(size, 2) + 2
        jobs, stages = rng.sample(names, n), stages_all[:n_m]
        J, K, last = range(n), range(n_m), n_m - 1
        proc = [[rng.randint(1, 15) for _ in K] for _ in J]
        big_m = sum(sum(row) for row in proc)
        pairs = [(i, j) for i in J for j in J if i < j]
        var = [Var(f"s_{j}_{k}") for j in J for k in K] + [Var(f"y_{i}_{j}", 0, 1, "binary") for i, j in pairs]
        cons = [Constraint(f"prec_{j}_{k}", {f"s_{j}_{k + 1}": 1, f"s_{j}_{k}": -1}, ">=", proc[j][k])
                for j in J for k in range(last)]
        for (i, j), k in ((p, k) for p in pairs for k in K):
            si, sj, y = f"s_{i}_{k}", f"s_{j}_{k}", f"y_{i}_{j}"
            cons.append(Constraint(f"ij_{i}_{j}_{k}", {si: 1, sj: -1, y: big_m}, "<=", big_m - proc[i][k]))
            cons.append(Constraint(f"ji_{i}_{j}_{k}", {sj: 1, si: -1, y: -big_m}, "<=", -proc[j][k]))
        params = [Param("proc_time", "processing time", proc, jobs, stages, unit=unit,
                        phrase="{label} needs these processing times: {values}.")]
        story = (f"A {line} handles {n} {job_word} ({join(jobs)}); each passes the {n_m} stations in the same order: "
                 f"{join(stages)}. A station works on one {one} at a time, each {one} is at one "
                 "station at a time and starts a station only after finishing the previous one, work cannot be "
                 f"interrupted, and the {job_word} keep the same sequence at every station (no overtaking). "
                 "Everything is available at time 0 and moves between stations take no time.")
        if variant == "makespan":
            var.append(Var("C_max"))
            cons += [Constraint(f"end_{j}", {"C_max": 1, f"s_{j}_{last}": -1}, ">=", proc[j][last]) for j in J]
            obj = {"C_max": 1}
            ask = f"What is the minimum makespan in {unit}, the time at which the last {one} is finished?"
        else:
            weight = [rng.randint(1, 6) for _ in J]
            var += [Var(f"C_{j}") for j in J]
            cons += [Constraint(f"end_{j}", {f"C_{j}": 1, f"s_{j}_{last}": -1}, ">=", proc[j][last]) for j in J]
            obj = {f"C_{j}": weight[j] for j in J}
            params.append(Param("weight", f"waiting cost per {unit[:-1]}", weight, jobs, unit="$",
                                phrase=f"Until it is finished, {{label}} costs {{value}} per {unit[:-1]}."))
            ask = (f"Each {one} costs its waiting cost per {unit[:-1]} from time 0 until it is finished. What "
                   "is the minimum total waiting cost in dollars (the weighted sum of completion times)?")
        ir = OptModel(self.name, "min", var, obj, cons)
        tail = TAILS[variant]
        code = model_code(HIGHSPY + tail[0], PYOMO + tail[1], GUROBI + tail[2])
        return Spec(self.name, story, params, ask, ir, MATH, code, {"weight": one})
