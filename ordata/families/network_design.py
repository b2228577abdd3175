"""Fixed-charge network design: which links to open so that every commodity reaches its destination (MILP)."""

from __future__ import annotations

import random

from ordata.families.base import Family, Spec, model_code
from ordata.ir import Constraint, OptModel, Var
from ordata.params import Param

# operator, links, nodes, commodity word, flow unit, what opening a link means
SCENARIOS = [
    ("freight carrier", "lanes", ["Leeds", "York", "Hull", "Derby", "Luton", "Bath", "Poole", "Exeter", "Dover"],
     "shipment", "tonnes per day", "running a lane"),
    ("telecom operator", "fibre links", ["POP-A", "POP-B", "POP-C", "POP-D", "POP-E", "POP-F", "POP-G", "POP-H",
     "POP-I"], "traffic demand", "Gbit/s", "leasing a link"),
    ("rail freight company", "rail links", ["Ashford", "Basford", "Crewe", "Didcot", "Ely", "Frome", "Goole", "Hythe",
     "Ilkley"], "container flow", "containers per week", "operating a link"),
    ("parcel airline", "air routes", ["AMS", "BRU", "CDG", "DUB", "EDI", "FRA", "GVA", "HAM", "IST"],
     "parcel stream", "pallets per night", "flying a route"),
]

MATH = (
    "**Sets:** nodes $i$, links $(i,j)$ with $u_{ij} > 0$, commodities $k$.\n"
    "**Parameters:** capacity $u_{ij}$, fixed cost $f_{ij}$, unit cost $c_{ij}$, net supply $b_{ki}$.\n"
    "**Variables:** $y_{ij} \\in \\{0,1\\}$ open link, $x_{kij} \\ge 0$ flow of commodity $k$.\n"
    "**Objective:** $\\min \\sum_{ij} f_{ij} y_{ij} + \\sum_{k,ij} c_{ij} x_{kij}$.\n"
    "**Constraints:** $\\sum_j x_{kij} - \\sum_j x_{kji} = b_{ki}$ for all $k, i$; "
    "$\\sum_k x_{kij} \\le u_{ij} y_{ij}$ for every link.\n"
)
HIGHSPY = (
    "h = highspy.Highs()\nh.silent()\n"
    "N, K = range(len(capacity)), range(len(supply))\n"
    "A = [(i, j) for i in N for j in N if capacity[i][j] > 0]\n"
    "y = {a: h.addBinary() for a in A}\n"
    "x = {(k, i, j): h.addVariable(lb=0) for k in K for (i, j) in A}\n"
    "for k in K:\n"
    "    for n in N:\n"
    "        h.addConstr(sum(x[k, i, j] for (i, j) in A if i == n) - sum(x[k, i, j] for (i, j) in A if j == n)\n"
    "                    == supply[k][n])\n"
    "for (i, j) in A:\n"
    "    h.addConstr(sum(x[k, i, j] for k in K) <= capacity[i][j] * y[i, j])\n"
    "h.minimize(sum(fixed_cost[i][j] * y[i, j] + sum(unit_cost[i][j] * x[k, i, j] for k in K) for (i, j) in A))\n"
)
PYOMO = (
    "m = pyo.ConcreteModel()\n"
    "N, K = range(len(capacity)), range(len(supply))\n"
    "A = [(i, j) for i in N for j in N if capacity[i][j] > 0]\n"
    "m.y = pyo.Var(A, domain=pyo.Binary)\n"
    "m.x = pyo.Var(K, A, domain=pyo.NonNegativeReals)\n"
    "m.keep = pyo.Constraint(K, N, rule=lambda m, k, n: sum(m.x[k, i, j] for (i, j) in A if i == n)\n"
    "                        - sum(m.x[k, i, j] for (i, j) in A if j == n) == supply[k][n])\n"
    "m.cap = pyo.Constraint(A, rule=lambda m, i, j: sum(m.x[k, i, j] for k in K) <= capacity[i][j] * m.y[i, j])\n"
    "m.obj = pyo.Objective(expr=sum(fixed_cost[i][j] * m.y[i, j] + sum(unit_cost[i][j] * m.x[k, i, j] for k in K)\n"
    "                               for (i, j) in A), sense=pyo.minimize)\n"
)
GUROBI = (
    "N, K = range(len(capacity)), range(len(supply))\n"
    "A = [(i, j) for i in N for j in N if capacity[i][j] > 0]\n"
    "y = m.addVars(A, vtype=GRB.BINARY)\n"
    "x = m.addVars([(k, i, j) for k in K for (i, j) in A], lb=0)\n"
    "for k in K:\n"
    "    for n in N:\n"
    "        m.addConstr(gp.quicksum(x[k, i, j] for (i, j) in A if i == n)\n"
    "                    - gp.quicksum(x[k, i, j] for (i, j) in A if j == n) == supply[k][n])\n"
    "for (i, j) in A:\n"
    "    m.addConstr(gp.quicksum(x[k, i, j] for k in K) <= capacity[i][j] * y[i, j])\n"
    "m.setObjective(gp.quicksum(fixed_cost[i][j] * y[i, j] + gp.quicksum(unit_cost[i][j] * x[k, i, j] for k in K)\n"
    "                           for (i, j) in A), GRB.MINIMIZE)\n"
)


class NetworkDesign(Family):
    name = "network_design"
    categories = ("MILP",)

    def sample(self, rng: random.Random, size: int, category: str | None = None, infeasible: bool = False) -> Spec:
        self._category(rng, category)
        who, links, names, word, unit, opening = rng.choice(SCENARIOS)
        n, n_k = size + 3, size + 1
        nodes = rng.sample(names, n)
        pairs = rng.sample([(o, d) for o in range(n) for d in range(n) if o != d], n_k)
        demand = [rng.randint(5, 40) for _ in pairs]
        supply = [[d if i == o else -d if i == t else 0 for i in range(n)] for (o, t), d in zip(pairs, demand)]
        cap = [[0] * n for _ in range(n)]
        for i in range(n - 1):  # a two-way backbone path that can carry everything keeps every instance feasible
            cap[i][i + 1] = cap[i + 1][i] = sum(demand) + rng.randint(0, 20)
        for i, j in rng.sample([(i, j) for i in range(n) for j in range(n) if abs(i - j) > 1], n + rng.randint(0, 2)):
            cap[i][j] = rng.randint(min(demand), max(demand) + 20)  # shortcuts
        fixed = [[rng.randint(10, 60) * 10 if cap[i][j] else 0 for j in range(n)] for i in range(n)]
        cost = [[rng.randint(1, 12) if cap[i][j] else 0 for j in range(n)] for i in range(n)]
        arcs = [(i, j) for i in range(n) for j in range(n) if cap[i][j] > 0]
        K = range(n_k)
        var = [Var(f"y_{i}_{j}", 0, 1, "binary") for i, j in arcs] + [Var(f"x_{k}_{i}_{j}") for k in K for i, j in arcs]
        cons = []
        for k in K:
            for v in range(n):
                coeffs = {f"x_{k}_{i}_{j}": 1 if i == v else -1 for i, j in arcs if v in (i, j)}
                cons.append(Constraint(f"keep_{k}_{v}", coeffs, "==", supply[k][v]))
        cons += [Constraint(f"cap_{i}_{j}", {**{f"x_{k}_{i}_{j}": 1 for k in K}, f"y_{i}_{j}": -cap[i][j]}, "<=", 0)
                 for i, j in arcs]
        obj = {f"y_{i}_{j}": fixed[i][j] for i, j in arcs}
        obj.update({f"x_{k}_{i}_{j}": cost[i][j] for k in K for i, j in arcs})
        ir = OptModel(self.name, "min", var, obj, cons)
        commodities = [f"{word.capitalize()} {k + 1}" for k in K]
        cols = [f"to {v}" for v in nodes]
        params = [
            Param("capacity", f"link capacity ({unit})", cap, nodes, cols,
                  phrase="From {label}, the link capacities (0 means no link) are: {values}."),
            Param("fixed_cost", "fixed cost of opening a link", fixed, nodes, cols, unit="$",
                  phrase=f"From {{label}}, the fixed costs of {opening} (0 where there is no link) are: {{values}}."),
            Param("unit_cost", f"cost per unit of flow ({unit})", cost, nodes, cols, unit="$",
                  phrase="From {label}, the costs per unit of flow (0 where there is no link) are: {values}."),
            Param("supply", f"net supply ({unit}; positive at the origin, negative at the destination)", supply,
                  commodities, list(nodes),
                  phrase=f"{{label}} has net supply ({unit}; positive at its origin, negative at its destination): "
                         "{values}."),
        ]
        routes = "; ".join(f"{c} sends {d} {unit} from {nodes[o]} to {nodes[t]}"
                           for c, (o, t), d in zip(commodities, pairs, demand))
        story = (f"A {who} designs a network over {', '.join(nodes)} from candidate one-way {links}. "
                 f"Each {word} must be routed from its origin to its destination and may be split over several "
                 f"paths: {routes}. A link carries flow only if it is opened, and then at most its capacity in total.")
        ask = ("Flows may be fractional. Which links should be opened, and how should each "
               f"{word} be routed, to minimise the total fixed and flow cost?")
        code = model_code(HIGHSPY, PYOMO, GUROBI)
        return Spec(self.name, story, params, ask, ir, MATH, code)
