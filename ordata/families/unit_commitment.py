"""Unit commitment: which units to run each period, and at what output, to meet demand at least cost (MILP)."""

from __future__ import annotations

import random

from ordata.families.base import Family, Spec, model_code
from ordata.ir import Constraint, OptModel, Var
from ordata.params import Param

# operator, units, names, output unit (plural, singular), verb, period, max output, marginal, fixed, start-up costs
SCENARIOS = [
    ("regional utility", "generating units", ["Coal 1", "Coal 2", "Gas CC 1", "Gas CC 2", "Gas peaker", "Oil peaker",
     "Biomass", "Lignite"], ("MWh", "MWh"), "generate", "hour", (80, 400), (15, 90), (100, 900), (500, 5000)),
    ("island microgrid", "diesel generators", [f"Diesel {c}" for c in "ABCDEFGH"], ("kWh", "kWh"), "generate", "hour",
     (40, 300), (0.18, 0.6), (5, 40), (10, 120)),
    ("food factory", "steam boilers", [f"Boiler {k}" for k in range(1, 9)], ("tonnes of steam", "tonne of steam"),
     "raise", "shift", (20, 120), (8, 30), (50, 400), (100, 900)),
    ("water utility", "pumps", [f"Pump {c}" for c in "PQRSTUVW"], ("megalitres", "megalitre"), "pump", "time block",
     (10, 60), (2, 12), (20, 150), (40, 300)),
]

MATH = (
    "**Sets:** units $g$, periods $t = 1..T$.\n"
    "**Parameters:** demand $d_t$, reserve $R$, output limits $P^{min}_g, P^{max}_g$, marginal cost $c_g$, "
    "fixed cost $f_g$ per period on, start-up cost $s_g$.\n"
    "**Variables:** $u_{gt} \\in \\{0,1\\}$ on, $v_{gt} \\in \\{0,1\\}$ started ($u_{g0} = 0$), "
    "$p_{gt} \\ge 0$ output.\n"
    "**Objective:** $\\min \\sum_{g,t} (f_g u_{gt} + s_g v_{gt} + c_g p_{gt})$.\n"
    "**Constraints:** $P^{min}_g u_{gt} \\le p_{gt} \\le P^{max}_g u_{gt}$; $v_{gt} \\ge u_{gt} - u_{g,t-1}$; "
    "$\\sum_g p_{gt} \\ge d_t$; $\\sum_g P^{max}_g u_{gt} \\ge d_t + R$.\n"
)
HIGHSPY = (
    "h = highspy.Highs()\nh.silent()\n"
    "G, T = range(len(max_output)), range(len(demand))\n"
    "u = [[h.addBinary() for _ in T] for _ in G]\n"
    "v = [[h.addBinary() for _ in T] for _ in G]\n"
    "p = [[h.addVariable(lb=0) for _ in T] for _ in G]\n"
    "for g in G:\n"
    "    for t in T:\n"
    "        h.addConstr(p[g][t] >= min_output[g] * u[g][t])\n"
    "        h.addConstr(p[g][t] <= max_output[g] * u[g][t])\n"
    "        h.addConstr(v[g][t] >= u[g][t] - (u[g][t - 1] if t > 0 else 0))\n"
    "for t in T:\n"
    "    h.addConstr(sum(p[g][t] for g in G) >= demand[t])\n"
    "    h.addConstr(sum(max_output[g] * u[g][t] for g in G) >= demand[t] + reserve)\n"
    "h.minimize(sum(fixed_cost[g] * u[g][t] + startup_cost[g] * v[g][t] + marginal_cost[g] * p[g][t]\n"
    "               for g in G for t in T))\n"
)
PYOMO = (
    "m = pyo.ConcreteModel()\n"
    "G, T = range(len(max_output)), range(len(demand))\n"
    "m.u = pyo.Var(G, T, domain=pyo.Binary)\n"
    "m.v = pyo.Var(G, T, domain=pyo.Binary)\n"
    "m.p = pyo.Var(G, T, domain=pyo.NonNegativeReals)\n"
    "m.low = pyo.Constraint(G, T, rule=lambda m, g, t: m.p[g, t] >= min_output[g] * m.u[g, t])\n"
    "m.high = pyo.Constraint(G, T, rule=lambda m, g, t: m.p[g, t] <= max_output[g] * m.u[g, t])\n"
    "m.start = pyo.Constraint(G, T, rule=lambda m, g, t: m.v[g, t] >= m.u[g, t] - (m.u[g, t - 1] if t > 0 else 0))\n"
    "m.meet = pyo.Constraint(T, rule=lambda m, t: sum(m.p[g, t] for g in G) >= demand[t])\n"
    "m.spin = pyo.Constraint(T, rule=lambda m, t: sum(max_output[g] * m.u[g, t] for g in G) >= demand[t] + reserve)\n"
    "m.obj = pyo.Objective(expr=sum(fixed_cost[g] * m.u[g, t] + startup_cost[g] * m.v[g, t]\n"
    "                               + marginal_cost[g] * m.p[g, t] for g in G for t in T), sense=pyo.minimize)\n"
)
GUROBI = (
    "G, T = range(len(max_output)), range(len(demand))\n"
    "u = m.addVars(len(max_output), len(demand), vtype=GRB.BINARY)\n"
    "v = m.addVars(len(max_output), len(demand), vtype=GRB.BINARY)\n"
    "p = m.addVars(len(max_output), len(demand), lb=0)\n"
    "for g in G:\n"
    "    for t in T:\n"
    "        m.addConstr(p[g, t] >= min_output[g] * u[g, t])\n"
    "        m.addConstr(p[g, t] <= max_output[g] * u[g, t])\n"
    "        m.addConstr(v[g, t] >= u[g, t] - (u[g, t - 1] if t > 0 else 0))\n"
    "for t in T:\n"
    "    m.addConstr(gp.quicksum(p[g, t] for g in G) >= demand[t])\n"
    "    m.addConstr(gp.quicksum(max_output[g] * u[g, t] for g in G) >= demand[t] + reserve)\n"
    "m.setObjective(gp.quicksum(fixed_cost[g] * u[g, t] + startup_cost[g] * v[g, t] + marginal_cost[g] * p[g, t]\n"
    "                           for g in G for t in T), GRB.MINIMIZE)\n"
)


class UnitCommitment(Family):
    name = "unit_commitment"
    categories = ("MILP",)

    def sample(self, rng: random.Random, size: int, category: str | None = None, infeasible: bool = False) -> Spec:
        self._category(rng, category)
        who, units_word, names, (unit, unit1), verb, word, pmax_r, marg_r, fixed_r, start_r = rng.choice(SCENARIOS)
        n_g, n_t = size + 1, size + 2
        units = rng.sample(names, n_g)
        periods = [f"{word.capitalize()} {t + 1}" for t in range(n_t)]
        pmax = [rng.randint(*pmax_r) for _ in units]
        pmin = [max(1, round(pmax[g] * rng.uniform(0.15, 0.35))) for g in range(n_g)]
        marg = [round(rng.uniform(*marg_r), 2) for _ in units]
        fixed = [rng.randint(*fixed_r) for _ in units]
        start = [rng.randint(*start_r) for _ in units]
        reserve = rng.randint(max(1, round(0.05 * sum(pmax))), max(2, round(0.12 * sum(pmax))))
        # all units on always covers demand: sum Pmin <= d_t and d_t + R <= sum Pmax
        lo, hi = sum(pmin), sum(pmax) - reserve
        demand = [rng.randint(lo, lo + round((hi - lo) * rng.uniform(0.3, 1.0))) for _ in periods]
        G, T = range(n_g), range(n_t)
        var = [Var(f"{k}_{g}_{t}", 0, 1, "binary") for k in "uv" for g in G for t in T]
        var += [Var(f"p_{g}_{t}") for g in G for t in T]
        cons = []
        for g in G:
            for t in T:
                cons.append(Constraint(f"low_{g}_{t}", {f"p_{g}_{t}": 1, f"u_{g}_{t}": -pmin[g]}, ">=", 0))
                cons.append(Constraint(f"high_{g}_{t}", {f"p_{g}_{t}": 1, f"u_{g}_{t}": -pmax[g]}, "<=", 0))
                prev = {f"u_{g}_{t - 1}": 1} if t > 0 else {}
                cons.append(Constraint(f"start_{g}_{t}", {f"v_{g}_{t}": 1, f"u_{g}_{t}": -1, **prev}, ">=", 0))
        for t in T:
            cons.append(Constraint(f"meet_{t}", {f"p_{g}_{t}": 1 for g in G}, ">=", demand[t]))
            cons.append(Constraint(f"spin_{t}", {f"u_{g}_{t}": pmax[g] for g in G}, ">=", demand[t] + reserve))
        obj = {f"u_{g}_{t}": fixed[g] for g in G for t in T}
        obj.update({f"v_{g}_{t}": start[g] for g in G for t in T})
        obj.update({f"p_{g}_{t}": marg[g] for g in G for t in T})
        ir = OptModel(self.name, "min", var, obj, cons)
        params = [
            Param("demand", f"demand ({unit})", demand, periods, phrase=f"{{label}} demand is {{value}} {unit}."),
            Param("reserve", f"spinning reserve ({unit})", reserve,
                  phrase=f"In every {word} the maximum outputs of the units that are on must add up to at least "
                         f"the demand plus a spinning reserve of {{value}} {unit}."),
            Param("min_output", f"minimum output when on ({unit})", pmin, units,
                  phrase=f"When on, {{label}} must {verb} at least {{value}} {unit} per {word}."),
            Param("max_output", f"maximum output ({unit})", pmax, units,
                  phrase=f"{{label}} can {verb} at most {{value}} {unit} per {word}."),
            Param("marginal_cost", f"cost per {unit1}", marg, units, unit="$",
                  phrase=f"Each {unit1} from {{label}} costs {{value}}."),
            Param("fixed_cost", f"fixed cost per {word} on", fixed, units, unit="$",
                  phrase=f"Running {{label}} costs {{value}} per {word} it is on, whatever its output."),
            Param("startup_cost", "start-up cost", start, units, unit="$",
                  phrase="Starting {label} up costs {value}."),
        ]
        story = (f"A {who} schedules its {n_g} {units_word} ({', '.join(units)}) over {n_t} {word}s. "
                 f"All of them are off before {periods[0]}; a unit that is on has an output between its minimum and "
                 f"maximum, and a unit that is off has none.")
        ask = (f"Output may be fractional. Which units should be on in each {word}, and at what output, to meet "
               f"demand and reserve at the minimum total fixed, start-up and output cost?")
        code = model_code(HIGHSPY, PYOMO, GUROBI)
        return Spec(self.name, story, params, ask, ir, MATH, code, {"demand": word, "min_output": units_word[:-1]})
