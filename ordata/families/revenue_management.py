"""Network revenue management: booking limits per itinerary under leg capacities (LP, or IP in whole seats)."""

from __future__ import annotations

import random

from ordata.families.base import Family, Spec, model_code
from ordata.ir import Constraint, OptModel, Var
from ordata.params import Param

# seller, service, stops, seat word, fare range per leg
SCENARIOS = [
    ("regional airline", "a multi-stop flight", ["Oslo", "Bergen", "Trondheim", "Tromso", "Bodo", "Alta", "Kirkenes",
     "Vardo"], "seats", (40, 150)),
    ("rail operator", "an intercity train", ["Milan", "Verona", "Padua", "Venice", "Trieste", "Udine", "Gorizia",
     "Monfalcone"], "seats", (15, 60)),
    ("coach company", "a long-distance coach", ["Lyon", "Dijon", "Troyes", "Reims", "Lille", "Arras", "Amiens",
     "Calais"], "seats", (8, 30)),
    ("ferry line", "an island-hopping ferry", ["Piraeus", "Syros", "Tinos", "Mykonos", "Naxos", "Paros", "Ios",
     "Santorini"], "cabin berths", (25, 90)),
]

MATH = (
    "**Sets:** legs $l$, itineraries $p$.\n"
    "**Parameters:** fare $r_p$, expected demand $d_p$, capacity $C_l$, $a_{lp} = 1$ if itinerary $p$ uses leg $l$.\n"
    "**Variables:** $0 \\le x_p \\le d_p${integral}, bookings accepted for itinerary $p$.\n"
    "**Objective:** $\\max \\sum_p r_p x_p$.\n"
    "**Constraints:** $\\sum_p a_{lp} x_p \\le C_l$ for every leg $l$.\n"
)
HIGHSPY = (
    "h = highspy.Highs()\nh.silent()\n"
    "P, L = range(len(fare)), range(len(capacity))\n"
    "x = [h.addVariable(lb=0, ub=demand[p]{integrality}) for p in P]\n"
    "for leg in L:\n"
    "    h.addConstr(sum(uses[leg][p] * x[p] for p in P) <= capacity[leg])\n"
    "h.maximize(sum(fare[p] * x[p] for p in P))\n"
)
PYOMO = (
    "m = pyo.ConcreteModel()\n"
    "P, L = range(len(fare)), range(len(capacity))\n"
    "m.x = pyo.Var(P, domain=pyo.{domain}, bounds=lambda m, p: (0, demand[p]))\n"
    "m.cap = pyo.Constraint(L, rule=lambda m, leg: sum(uses[leg][p] * m.x[p] for p in P) <= capacity[leg])\n"
    "m.obj = pyo.Objective(expr=sum(fare[p] * m.x[p] for p in P), sense=pyo.maximize)\n"
)
GUROBI = (
    "P, L = range(len(fare)), range(len(capacity))\n"
    "x = m.addVars(len(fare), lb=0, ub=demand, vtype={vtype})\n"
    "for leg in L:\n"
    "    m.addConstr(gp.quicksum(uses[leg][p] * x[p] for p in P) <= capacity[leg])\n"
    "m.setObjective(gp.quicksum(fare[p] * x[p] for p in P), GRB.MAXIMIZE)\n"
)


class RevenueManagement(Family):
    name = "revenue_management"
    categories = ("LP", "IP")

    def sample(self, rng: random.Random, size: int, category: str | None = None, infeasible: bool = False) -> Spec:
        cat = self._category(rng, category)
        seller, service, stops_all, seats, fare_r = rng.choice(SCENARIOS)
        n_s = size + 2
        start = rng.randrange(len(stops_all) - n_s + 1)
        stops = stops_all[start:start + n_s]
        if rng.random() < 0.5:
            stops = stops[::-1]
        legs = [f"{stops[s]}–{stops[s + 1]}" for s in range(n_s - 1)]
        od = [(a, b) for a in range(n_s) for b in range(a + 1, n_s)]  # itinerary a -> b uses legs a..b-1
        products = [f"{stops[a]} to {stops[b]}" for a, b in od]
        leg_fare = [rng.uniform(*fare_r) for _ in legs]
        fare = [round(sum(leg_fare[a:b]) * rng.uniform(0.7, 1.05)) for a, b in od]
        demand = [round(rng.uniform(4, 60), 1) for _ in od]
        uses = [[1 if a <= leg < b else 0 for a, b in od] for leg in range(n_s - 1)]
        capacity = [max(1, round(sum(d for d, u in zip(demand, row) if u) * rng.uniform(0.45, 0.85))) for row in uses]
        whole = cat == "IP"
        kind = "integer" if whole else "continuous"
        P = range(len(od))
        var = [Var(f"x_{p}", 0, demand[p], kind) for p in P]
        cons = [Constraint(f"cap_{leg}", {f"x_{p}": 1 for p in P if uses[leg][p]}, "<=", capacity[leg])
                for leg in range(len(legs))]
        ir = OptModel(self.name, "max", var, {f"x_{p}": fare[p] for p in P}, cons)
        params = [
            Param("fare", "fare", fare, products, unit="$", phrase="A ticket from {label} sells for {value}."),
            Param("demand", "expected demand (bookings)", demand, products,
                  phrase="Expected demand from {label} is {value} bookings."),
            Param("capacity", f"capacity ({seats})", capacity, legs, phrase=f"Leg {{label}} has {{value}} {seats}."),
            Param("uses", "itinerary uses the leg (1 = yes)", uses, legs, products,
                  phrase="Leg {label} is used (1) or not (0) by each itinerary: {values}."),
        ]
        story = (f"A {seller} sells tickets on {service} calling at {', '.join(stops)} in that order. Each ticket "
                 f"between two stops occupies one of the {seats} on every leg it travels; no more tickets can be "
                 f"sold for an itinerary than its expected demand.")
        ask = ("Booking limits must be whole numbers of tickets. " if whole else "Booking limits may be fractional "
               "(a deterministic approximation). ") + \
            "Treating expected demand as certain, which booking limits maximise the total ticket revenue?"
        code = model_code(HIGHSPY, PYOMO, GUROBI, whole)
        return Spec(self.name, story, params, ask, ir, MATH.replace("{integral}", ", integer" if whole else ""),
                    code, {"fare": "itinerary", "capacity": "leg"})
