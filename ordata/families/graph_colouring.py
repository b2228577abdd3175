"""Graph colouring: give conflicting items different slots, using as few (or as cheap) slots as possible (IP)."""

from __future__ import annotations

import random

from ordata.families.base import Family, Spec, join, model_code
from ordata.ir import Constraint, OptModel, Var
from ordata.params import Param

# (planner, item word, slot word, conflict reason, cost wording, slot names, item names)
SCENARIOS = [
    ("university registry", "exams", "exam slot", "share at least one student", "invigilation and room cost",
     ["Mon AM", "Mon PM", "Tue AM", "Tue PM", "Wed AM", "Wed PM", "Thu AM", "Thu PM", "Fri AM", "Fri PM"],
     ["Calculus", "Physics", "Chemistry", "Biology", "History", "Economics", "Law", "Statistics", "Philosophy",
      "Geology", "Music", "Spanish", "Sociology", "Astronomy"]),
    ("radio regulator", "transmitters", "frequency channel", "are too close to share a channel", "annual licence fee",
     [f"Channel {k}" for k in range(1, 11)],
     ["Alton", "Barford", "Crewe", "Dunstan", "Elmsley", "Frome", "Garth", "Haddon", "Irwell", "Jarrow", "Keswick",
      "Ludlow", "Marlow", "Newent"]),
    ("consulting firm", "meetings", "time slot", "share at least one attendee", "overtime cost",
     ["08:00", "09:00", "10:00", "11:00", "12:00", "13:00", "14:00", "15:00", "16:00", "17:00"],
     ["budget review", "hiring panel", "client call", "design sprint", "audit prep", "sales sync", "IT update",
      "legal briefing", "board prep", "training", "vendor pitch", "safety drill", "strategy day", "retro"]),
    ("chemical depot", "chemicals", "storage room", "react dangerously if stored together", "monthly rent",
     ["Room A", "Room B", "Room C", "Room D", "Room E", "Room F", "Room G", "Room H", "Room I", "Room J"],
     ["acetone", "ammonia", "bleach", "chlorine", "ethanol", "hydrogen peroxide", "nitric acid", "sodium", "sulphur",
      "toluene", "methanol", "potassium", "phosphorus", "iodine"]),
]

MATH = (
    "**Sets:** items $v$ (vertices), slots $c$ (colours), conflicting pairs $(u, v) \\in E$.\n"
    "**Parameters:** conflict indicator $a_{uv}$; weighted variant: slot cost $f_c$ (non-decreasing).\n"
    "**Variables:** $x_{vc} \\in \\{0,1\\}$ (item $v$ in slot $c$), $w_c \\in \\{0,1\\}$ (slot $c$ used).\n"
    "**Objective:** $\\min \\sum_c w_c$ (weighted: $\\min \\sum_c f_c w_c$).\n"
    "**Constraints:** $\\sum_c x_{vc} = 1$; $x_{vc} \\le w_c$; $x_{uc} + x_{vc} \\le w_c$ for $(u, v) \\in E$; "
    "symmetry breaking $w_{c+1} \\le w_c$ and $x_{vc} = 0$ for $c > v$.\n"
)
HIGHSPY = (
    "h = highspy.Highs()\nh.silent()\n"
    "V, C = range(len(conflict)), range(SLOTS)\n"
    "x = [[h.addBinary() for _ in C] for _ in V]\n"
    "w = [h.addBinary() for _ in C]\n"
    "for v in V:\n"
    "    h.addConstr(sum(x[v][c] for c in C) == 1)\n"
    "    for c in C:\n"
    "        h.addConstr(x[v][c] <= w[c])\n"
    "        if c > v:\n"
    "            h.addConstr(x[v][c] == 0)\n"
    "        for u in range(v):\n"
    "            if conflict[u][v]:\n"
    "                h.addConstr(x[u][c] + x[v][c] <= w[c])\n"
    "for c in C[1:]:\n"
    "    h.addConstr(w[c] <= w[c - 1])\n"
    "h.minimize(sum(WEIGHTw[c] for c in C))\n"
)
PYOMO = (
    "m = pyo.ConcreteModel()\n"
    "V, C = range(len(conflict)), range(SLOTS)\n"
    "m.x = pyo.Var(V, C, domain=pyo.Binary)\n"
    "m.w = pyo.Var(C, domain=pyo.Binary)\n"
    "m.one = pyo.Constraint(V, rule=lambda m, v: sum(m.x[v, c] for c in C) == 1)\n"
    "m.used = pyo.Constraint(V, C, rule=lambda m, v, c: m.x[v, c] <= m.w[c])\n"
    "m.sym = pyo.Constraint(V, C, rule=lambda m, v, c: m.x[v, c] == 0 if c > v else pyo.Constraint.Skip)\n"
    "m.edge = pyo.Constraint(V, V, C, rule=lambda m, u, v, c: m.x[u, c] + m.x[v, c] <= m.w[c]\n"
    "                        if u < v and conflict[u][v] else pyo.Constraint.Skip)\n"
    "m.order = pyo.Constraint(C, rule=lambda m, c: m.w[c] <= m.w[c - 1] if c > 0 else pyo.Constraint.Skip)\n"
    "m.obj = pyo.Objective(expr=sum(WEIGHTm.w[c] for c in C), sense=pyo.minimize)\n"
)
GUROBI = (
    "V, C = range(len(conflict)), range(SLOTS)\n"
    "x = m.addVars(len(conflict), SLOTS, vtype=GRB.BINARY)\n"
    "w = m.addVars(SLOTS, vtype=GRB.BINARY)\n"
    "for v in V:\n"
    "    m.addConstr(gp.quicksum(x[v, c] for c in C) == 1)\n"
    "    for c in C:\n"
    "        m.addConstr(x[v, c] <= w[c])\n"
    "        if c > v:\n"
    "            m.addConstr(x[v, c] == 0)\n"
    "        for u in range(v):\n"
    "            if conflict[u][v]:\n"
    "                m.addConstr(x[u, c] + x[v, c] <= w[c])\n"
    "for c in C[1:]:\n"
    "    m.addConstr(w[c] <= w[c - 1])\n"
    "m.setObjective(gp.quicksum(WEIGHTw[c] for c in C), GRB.MINIMIZE)\n"
)


def greedy_colours(adj: list[list[int]]) -> int:
    colour: list[int] = []
    for v in range(len(adj)):
        colour.append(min(set(range(len(adj))) - {colour[u] for u in range(v) if adj[u][v]}))
    return max(colour) + 1


class GraphColouring(Family):
    name = "graph_colouring"
    categories = ("IP",)

    def sample(self, rng: random.Random, size: int, category: str | None = None, infeasible: bool = False) -> Spec:
        self._category(rng, category)
        who, items_word, slot, reason, cost_word, slot_names, item_names = rng.choice(SCENARIOS)
        n = 2 * size + 2
        items = rng.sample(item_names, n)
        density = rng.uniform(0.3, 0.6)
        adj = [[0] * n for _ in range(n)]
        pairs = [(u, v) for u in range(n) for v in range(u + 1, n)]
        for u, v in [rng.choice(pairs)] + [e for e in pairs if rng.random() < density]:
            adj[u][v] = adj[v][u] = 1
        k = min(n, greedy_colours(adj) + rng.randint(0, 1))
        weighted = rng.random() < 0.5
        cost = sorted(rng.randint(10, 90) * 10 for _ in range(k))
        var = [Var(f"x_{v}_{c}", 0, 1, "binary") for v in range(n) for c in range(k)]
        var += [Var(f"w_{c}", 0, 1, "binary") for c in range(k)]
        cons = [Constraint(f"one_{v}", {f"x_{v}_{c}": 1 for c in range(k)}, "==", 1) for v in range(n)]
        for v in range(n):
            for c in range(k):
                cons.append(Constraint(f"used_{v}_{c}", {f"x_{v}_{c}": 1, f"w_{c}": -1}, "<=", 0))
                if c > v:
                    cons.append(Constraint(f"sym_{v}_{c}", {f"x_{v}_{c}": 1}, "==", 0))
                cons += [Constraint(f"edge_{u}_{v}_{c}", {f"x_{u}_{c}": 1, f"x_{v}_{c}": 1, f"w_{c}": -1}, "<=", 0)
                         for u in range(v) if adj[u][v]]
        cons += [Constraint(f"order_{c}", {f"w_{c}": 1, f"w_{c - 1}": -1}, "<=", 0) for c in range(1, k)]
        ir = OptModel(self.name, "min", var, {f"w_{c}": cost[c] if weighted else 1 for c in range(k)}, cons)
        params = [Param("conflict", "conflict (1 = conflict)", adj, items, items,
                        phrase="Conflicts of {label} (1 = conflict, 0 = none): {values}.")]
        story = (f"A {who} must place each of {n} {items_word} ({join(items)}) in exactly one {slot}. "
                 f"Two {items_word} that {reason} conflict and must not be placed in the same {slot}.")
        if weighted:
            params.insert(0, Param("slot_cost", cost_word, cost, slot_names[:k], unit="$",
                                   phrase=f"The {cost_word} for {{label}} is {{value}}."))
            story += (f" The {slot}s available are {join(slot_names[:k])}; a {slot} that holds at least one of the "
                      f"{items_word} incurs its {cost_word}, an unused one costs nothing.")
            ask = f"Which assignment minimises the total {cost_word} of the {slot}s used? What is that minimum cost?"
        else:
            params.insert(0, Param("num_slots", f"number of {slot}s available", k,
                                   phrase=f"There are {{value}} {slot}s available."))
            ask = f"What is the minimum number of {slot}s that must be used?"
        slots, weight = ("len(slot_cost)", "slot_cost[c] * ") if weighted else ("num_slots", "")
        code = {api: c.replace("SLOTS", slots).replace("WEIGHT", weight)
                for api, c in model_code(HIGHSPY, PYOMO, GUROBI).items()}
        return Spec(self.name, story, params, ask, ir, MATH, code, {"slot_cost": slot})
