"""Staff scheduling: how many staff start each shift to cover every period (IP, cyclic shifts)."""

from __future__ import annotations

import random

from ordata.families.base import Family, Spec, model_code
from ordata.ir import Constraint, OptModel, Var
from ordata.params import Param

SCENARIOS = [("call centre", "agents"), ("hospital ward", "nurses"), ("police station", "officers"), ("airport", "security staff")]

MATH = (
    "**Sets:** periods $t$ (cyclic), shift starts $s$.\n"
    "**Parameters:** requirement $r_t$, cost $c_s$, shift length $L$ periods.\n"
    "**Variables:** $x_s \\in \\mathbb{Z}_{\\ge 0}$, staff starting in period $s$.\n"
    "**Objective:** $\\min \\sum_s c_s x_s$.\n"
    "**Constraints:** $\\sum_{s:\\, t \\in [s, s+L)} x_s \\ge r_t$ for every period $t$ (indices modulo the day).\n"
)
HIGHSPY = (
    "h = highspy.Highs()\nh.silent()\n"
    "T = len(required)\n"
    "x = [h.addIntegral(lb=0) for _ in range(T)]\n"
    "for t in range(T):\n"
    "    h.addConstr(sum(x[(t - k) % T] for k in range(shift_length)) >= required[t])\n"
    "h.minimize(sum(cost[s] * x[s] for s in range(T)))\n"
)
PYOMO = (
    "m = pyo.ConcreteModel()\n"
    "T = range(len(required))\n"
    "m.x = pyo.Var(T, domain=pyo.NonNegativeIntegers)\n"
    "m.cover = pyo.Constraint(T, rule=lambda m, t: sum(m.x[(t - k) % len(required)] for k in range(shift_length))\n"
    "                         >= required[t])\n"
    "m.obj = pyo.Objective(expr=sum(cost[s] * m.x[s] for s in T), sense=pyo.minimize)\n"
)

GUROBI = (
    "T = len(required)\n"
    "x = m.addVars(T, lb=0, vtype=GRB.INTEGER)\n"
    "for t in range(T):\n"
    "    m.addConstr(gp.quicksum(x[(t - k) % T] for k in range(shift_length)) >= required[t])\n"
    "m.setObjective(gp.quicksum(cost[s] * x[s] for s in range(T)), GRB.MINIMIZE)\n"
)

class Scheduling(Family):
    name = "scheduling"
    categories = ("IP",)

    def sample(self, rng: random.Random, size: int, category: str | None = None, infeasible: bool = False) -> Spec:
        self._category(rng, category)
        place, staff = rng.choice(SCENARIOS)
        n = 2 * size  # periods per day
        hours = 24 // n
        periods = [f"{h * hours:02d}:00-{(h + 1) * hours:02d}:00" for h in range(n)]
        length = rng.randint(2, max(2, n // 2))
        required = [rng.randint(2, 25) for _ in periods]
        cost = [rng.randint(80, 160) for _ in periods]
        var = [Var(f"x_{s}", kind="integer") for s in range(n)]
        cons = [Constraint(f"cover_{t}", {f"x_{(t - k) % n}": 1 for k in range(length)}, ">=", required[t]) for t in range(n)]
        ir = OptModel(self.name, "min", var, {f"x_{s}": cost[s] for s in range(n)}, cons)
        params = [
            Param("required", f"{staff} required", required, periods, phrase=f"From {{label}} at least {{value}} {staff} are needed."),
            Param("cost", "cost per person for a shift starting then", cost, periods, unit="$",
                  phrase="A shift starting at the beginning of {label} costs {value} per person."),
            Param("shift_length", "shift length (periods)", length,
                  phrase=f"Each shift lasts {{value}} consecutive periods of {hours} hours and may run past midnight."),
        ]
        story = f"A {place} works around the clock in {n} periods of {hours} hours and plans its {staff}."
        ask = "How many should start at each period to cover every period at minimum daily cost?"
        code = model_code(HIGHSPY, PYOMO, GUROBI)
        return Spec(self.name, story, params, ask, ir, MATH, code, {"required": "period"})
