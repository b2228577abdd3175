"""Job shop: sequence operations on machines to minimise the makespan (disjunctive big-M MILP)."""

from __future__ import annotations

import random

from ordata.families.base import Family, Spec, join, model_code
from ordata.ir import Constraint, OptModel, Var
from ordata.params import Param

SCENARIOS = [  # (shop, job word, job names, machines, time unit)
    ("machine shop", "parts", ["Shaft", "Gear", "Bracket", "Flange", "Housing", "Axle", "Bolt"],
     ["lathe", "mill", "drill", "grinder"], "minutes"),
    ("print shop", "orders", ["Flyers", "Posters", "Menus", "Brochures", "Cards", "Labels", "Booklets"],
     ["press", "cutter", "folder", "binder"], "minutes"),
    ("repair garage", "cars", ["Audi", "BMW", "Fiat", "Ford", "Kia", "Opel", "Volvo"],
     ["diagnosis bay", "body shop", "paint booth", "electrics bay"], "hours"),
    ("testing laboratory", "samples", ["S-01", "S-02", "S-03", "S-04", "S-05", "S-06", "S-07"],
     ["centrifuge", "spectrometer", "incubator", "microscope"], "hours"),
]

MATH = (
    "**Sets:** jobs $j$, machines $k$; job $j$ visits the machines in the order $r_{j1}, r_{j2}, \\dots$\n"
    "**Parameters:** processing time $p_{jk}$, $M = \\sum_{j,k} p_{jk}$.\n"
    "**Variables:** start $s_{jk} \\ge 0$, $y_{kij} \\in \\{0,1\\}$ ($i$ before $j$ on $k$, $i < j$), "
    "makespan $C \\ge 0$.\n"
    "**Objective:** $\\min C$.\n"
    "**Constraints:** $s_{j r_{j,o+1}} \\ge s_{j r_{jo}} + p_{j r_{jo}}$; "
    "$C \\ge s_{jk} + p_{jk}$ for the last machine $k$ of $j$; "
    "$s_{ik} + p_{ik} \\le s_{jk} + M(1 - y_{kij})$ and $s_{jk} + p_{jk} \\le s_{ik} + M y_{kij}$.\n"
)
HIGHSPY = (
    "h = highspy.Highs()\nh.silent()\n"
    "J, K = range(len(proc_time)), range(len(proc_time[0]))\n"
    "big_m = sum(sum(row) for row in proc_time)\n"
    "s = [[h.addVariable(lb=0) for _ in K] for _ in J]\n"
    "c_max = h.addVariable(lb=0)\n"
    "for j in J:\n"
    "    route = [k - 1 for k in machine_order[j]]\n"
    "    for a, b in zip(route, route[1:]):\n"
    "        h.addConstr(s[j][b] >= s[j][a] + proc_time[j][a])\n"
    "    h.addConstr(c_max >= s[j][route[-1]] + proc_time[j][route[-1]])\n"
    "for k in K:\n"
    "    for i in J:\n"
    "        for j in J:\n"
    "            if i < j:\n"
    "                y = h.addBinary()\n"
    "                h.addConstr(s[i][k] + proc_time[i][k] <= s[j][k] + big_m * (1 - y))\n"
    "                h.addConstr(s[j][k] + proc_time[j][k] <= s[i][k] + big_m * y)\n"
    "h.minimize(c_max)\n"
)
PYOMO = (
    "m = pyo.ConcreteModel()\n"
    "J, K = range(len(proc_time)), range(len(proc_time[0]))\n"
    "big_m = sum(sum(row) for row in proc_time)\n"
    "pairs = [(i, j) for i in J for j in J if i < j]\n"
    "m.s = pyo.Var(J, K, domain=pyo.NonNegativeReals)\n"
    "m.c_max = pyo.Var(domain=pyo.NonNegativeReals)\n"
    "m.y = pyo.Var(K, pairs, domain=pyo.Binary)\n"
    "m.cons = pyo.ConstraintList()\n"
    "for j in J:\n"
    "    route = [k - 1 for k in machine_order[j]]\n"
    "    for a, b in zip(route, route[1:]):\n"
    "        m.cons.add(m.s[j, b] >= m.s[j, a] + proc_time[j][a])\n"
    "    m.cons.add(m.c_max >= m.s[j, route[-1]] + proc_time[j][route[-1]])\n"
    "for k in K:\n"
    "    for i, j in pairs:\n"
    "        m.cons.add(m.s[i, k] + proc_time[i][k] <= m.s[j, k] + big_m * (1 - m.y[k, i, j]))\n"
    "        m.cons.add(m.s[j, k] + proc_time[j][k] <= m.s[i, k] + big_m * m.y[k, i, j])\n"
    "m.obj = pyo.Objective(expr=m.c_max, sense=pyo.minimize)\n"
)
GUROBI = (
    "J, K = range(len(proc_time)), range(len(proc_time[0]))\n"
    "big_m = sum(sum(row) for row in proc_time)\n"
    "s = m.addVars(len(proc_time), len(proc_time[0]), lb=0)\n"
    "c_max = m.addVar(lb=0)\n"
    "y = m.addVars([(k, i, j) for k in K for i in J for j in J if i < j], vtype=GRB.BINARY)\n"
    "for j in J:\n"
    "    route = [k - 1 for k in machine_order[j]]\n"
    "    for a, b in zip(route, route[1:]):\n"
    "        m.addConstr(s[j, b] >= s[j, a] + proc_time[j][a])\n"
    "    m.addConstr(c_max >= s[j, route[-1]] + proc_time[j][route[-1]])\n"
    "for k, i, j in y:\n"
    "    m.addConstr(s[i, k] + proc_time[i][k] <= s[j, k] + big_m * (1 - y[k, i, j]))\n"
    "    m.addConstr(s[j, k] + proc_time[j][k] <= s[i, k] + big_m * y[k, i, j])\n"
    "m.setObjective(c_max, GRB.MINIMIZE)\n"
)


class JobShop(Family):
    name = "job_shop"
    categories = ("MILP",)

    def sample(self, rng: random.Random, size: int, category: str | None = None, infeasible: bool = False) -> Spec:
        self._category(rng, category)
        shop, job_word, names, machines_all, unit = rng.choice(SCENARIOS)
        n = max(2, size)
        n_m = min(n, 3) + 1
        jobs, machines = rng.sample(names, n), machines_all[:n_m]
        K = range(n_m)
        proc = [[rng.randint(1, 12) for _ in K] for _ in jobs]
        order = [rng.sample(range(1, n_m + 1), n_m) for _ in jobs]
        big_m = sum(sum(row) for row in proc)
        var = [Var(f"s_{j}_{k}") for j in range(n) for k in K] + [Var("C_max")]
        pairs = [(k, i, j) for k in K for i in range(n) for j in range(n) if i < j]
        var += [Var(f"y_{k}_{i}_{j}", 0, 1, "binary") for k, i, j in pairs]
        cons = []
        for j in range(n):
            route = [k - 1 for k in order[j]]
            cons += [Constraint(f"prec_{j}_{a}", {f"s_{j}_{b}": 1, f"s_{j}_{a}": -1}, ">=", proc[j][a])
                     for a, b in zip(route, route[1:])]
            cons.append(Constraint(f"end_{j}", {"C_max": 1, f"s_{j}_{route[-1]}": -1}, ">=", proc[j][route[-1]]))
        for k, i, j in pairs:
            y = f"y_{k}_{i}_{j}"
            cons.append(Constraint(f"ij_{y}", {f"s_{i}_{k}": 1, f"s_{j}_{k}": -1, y: big_m}, "<=", big_m - proc[i][k]))
            cons.append(Constraint(f"ji_{y}", {f"s_{j}_{k}": 1, f"s_{i}_{k}": -1, y: -big_m}, "<=", -proc[j][k]))
        ir = OptModel(self.name, "min", var, {"C_max": 1}, cons)
        params = [
            Param("proc_time", "processing time", proc, jobs, machines, unit=unit,
                  phrase="{label} needs these processing times: {values}."),
            Param("machine_order", "machine visited (by number) at each step", order, jobs,
                  [f"step {o + 1}" for o in K], phrase="The route of {label} (step: machine number) is {values}."),
        ]
        numbered = join([f"the {mach} (machine {k + 1})" for k, mach in enumerate(machines)])
        story = (f"A {shop} must process {n} {job_word} ({join(jobs)}) on {n_m} machines: {numbered}. "
                 f"Each of the {job_word} visits every machine exactly once, in its own given order, and an operation "
                 f"may start only after the previous operation of the same {job_word[:-1]} has finished. A machine "
                 f"handles one {job_word[:-1]} at a time, operations cannot be interrupted, everything is available at "
                 "time 0 and moves between machines take no time.")
        ask = (f"What is the minimum makespan in {unit}, i.e. the earliest time at which all {job_word} "
               "can be finished?")
        code = model_code(HIGHSPY, PYOMO, GUROBI)
        return Spec(self.name, story, params, ask, ir, MATH, code)
