"""Network flow: the maximum flow from a source to a sink through capacitated links (LP)."""

from __future__ import annotations

import random

from ordata.families.base import Family, Spec, model_code
from ordata.ir import Constraint, OptModel, Var
from ordata.params import Param

SCENARIOS = [("water utility", "pipes", "thousand litres per hour"), ("internet provider", "links", "Gbit/s"),
             ("rail operator", "lines", "trains per day")]
NODES = ["A", "B", "C", "D", "E", "F"]

MATH = (
    "**Sets:** nodes $i, j$; source $s$ (first), sink $t$ (last).\n"
    "**Parameters:** capacity $u_{ij}$ (0: no link).\n"
    "**Variables:** $0 \\le f_{ij} \\le u_{ij}$, flow on link $i \\to j$.\n"
    "**Objective:** $\\max \\sum_j f_{sj} - \\sum_j f_{js}$.\n"
    "**Constraints:** flow conservation $\\sum_j f_{ji} = \\sum_j f_{ij}$ at every node other than $s$ and $t$.\n"
)
HIGHSPY = (
    "h = highspy.Highs()\nh.silent()\n"
    "n = len(capacity)\n"
    "f = [[h.addVariable(lb=0, ub=capacity[i][j]) for j in range(n)] for i in range(n)]\n"
    "for k in range(1, n - 1):\n"
    "    h.addConstr(sum(f[i][k] for i in range(n)) == sum(f[k][j] for j in range(n)))\n"
    "h.maximize(sum(f[0][j] for j in range(n)) - sum(f[j][0] for j in range(n)))\n"
)
PYOMO = (
    "m = pyo.ConcreteModel()\n"
    "n = len(capacity)\n"
    "N = range(n)\n"
    "m.f = pyo.Var(N, N, domain=pyo.NonNegativeReals, bounds=lambda m, i, j: (0, capacity[i][j]))\n"
    "m.keep = pyo.Constraint(range(1, n - 1), rule=lambda m, k: sum(m.f[i, k] for i in N) == sum(m.f[k, j] for j in N))\n"
    "m.obj = pyo.Objective(expr=sum(m.f[0, j] for j in N) - sum(m.f[j, 0] for j in N), sense=pyo.maximize)\n"
)

GUROBI = (
    "n = len(capacity)\n"
    "f = m.addVars(n, n, lb=0, ub={(i, j): capacity[i][j] for i in range(n) for j in range(n)})\n"
    "for k in range(1, n - 1):\n"
    "    m.addConstr(gp.quicksum(f[i, k] for i in range(n)) == gp.quicksum(f[k, j] for j in range(n)))\n"
    "m.setObjective(gp.quicksum(f[0, j] for j in range(n)) - gp.quicksum(f[j, 0] for j in range(n)), GRB.MAXIMIZE)\n"
)

class NetworkFlow(Family):
    name = "network_flow"
    categories = ("LP",)

    def sample(self, rng: random.Random, size: int, category: str | None = None, infeasible: bool = False) -> Spec:
        self._category(rng, category)
        who, links, unit = rng.choice(SCENARIOS)
        n = size + 2
        nodes = NODES[:n]
        cap = [[0] * n for _ in range(n)]
        for i in range(n - 1):  # a backbone path guarantees a positive flow
            cap[i][i + 1] = rng.randint(5, 40)
        for i in range(n):
            for j in range(n):
                if i != j and j != 0 and i != n - 1 and cap[i][j] == 0 and rng.random() < 0.4:
                    cap[i][j] = rng.randint(5, 40)
        var = [Var(f"f_{i}_{j}", 0, cap[i][j]) for i in range(n) for j in range(n)]
        cons = []
        for k in range(1, n - 1):
            coeffs: dict[str, float] = {}
            for i in range(n):
                coeffs[f"f_{i}_{k}"] = coeffs.get(f"f_{i}_{k}", 0) + 1
                coeffs[f"f_{k}_{i}"] = coeffs.get(f"f_{k}_{i}", 0) - 1
            cons.append(Constraint(f"keep_{k}", coeffs, "==", 0))
        obj: dict[str, float] = {}
        for j in range(n):
            obj[f"f_0_{j}"] = obj.get(f"f_0_{j}", 0) + 1
            obj[f"f_{j}_0"] = obj.get(f"f_{j}_0", 0) - 1
        ir = OptModel(self.name, "max", var, obj, cons)
        params = [Param("capacity", f"link capacity ({unit})", cap, nodes, [f"to {v}" for v in nodes],
                        phrase="From node {label}, the capacities (0 means no link) are: {values}.")]
        story = (f"A {who} moves flow through a network of nodes {', '.join(nodes)} connected by one-way {links}; "
                 f"node {nodes[0]} is the source and node {nodes[-1]} the sink.")
        ask = f"What is the maximum flow in {unit} that can be sent from {nodes[0]} to {nodes[-1]}?"
        code = model_code(HIGHSPY, PYOMO, GUROBI)
        return Spec(self.name, story, params, ask, ir, MATH, code)
