"""Mean-variance portfolio: the least risky allocation reaching a target return (convex QP, NLP)."""

from __future__ import annotations

import random

from ordata.families.base import Family, Spec, join, model_code
from ordata.ir import Constraint, OptModel, Var
from ordata.params import Param

ASSETS = ["bonds", "equities", "real estate", "gold", "emerging markets", "infrastructure", "commodities", "cash"]

MATH = (
    "**Sets:** assets $i$.\n"
    "**Parameters:** expected return $r_i$ (%), covariance $\\Sigma_{ij}$ (%$^2$), target return $R$.\n"
    "**Variables:** $w_i \\ge 0$, fraction of the budget in asset $i$.\n"
    "**Objective:** $\\min \\sum_{i,j} \\Sigma_{ij} w_i w_j$ (portfolio variance).\n"
    "**Constraints:** $\\sum_i w_i = 1$; $\\sum_i r_i w_i \\ge R$.\n"
)
HIGHSPY = (
    "h = highspy.Highs()\nh.silent()\n"
    "n = len(expected_return)\n"
    "w = [h.addVariable(lb=0) for _ in range(n)]\n"
    "h.addConstr(sum(w) == 1)\n"
    "h.addConstr(sum(expected_return[i] * w[i] for i in range(n)) >= target_return)\n"
    "# HiGHS minimises 1/2 w'Qw: pass Q = 2 * covariance, lower triangle, column by column\n"
    "start, index, value = [0], [], []\n"
    "for j in range(n):\n"
    "    for i in range(j, n):\n"
    "        index.append(i)\n"
    "        value.append(2 * covariance[i][j])\n"
    "    start.append(len(index))\n"
    "h.passHessian(n, len(value), highspy.HessianFormat.kTriangular, start, index, value)\n"
    "h.run()\n"
)
PYOMO = (
    "m = pyo.ConcreteModel()\n"
    "A = range(len(expected_return))\n"
    "m.w = pyo.Var(A, domain=pyo.NonNegativeReals)\n"
    "m.budget = pyo.Constraint(expr=sum(m.w[i] for i in A) == 1)\n"
    "m.ret = pyo.Constraint(expr=sum(expected_return[i] * m.w[i] for i in A) >= target_return)\n"
    "m.obj = pyo.Objective(expr=sum(covariance[i][j] * m.w[i] * m.w[j] for i in A for j in A), sense=pyo.minimize)\n"
)

GUROBI = (
    "A = range(len(expected_return))\n"
    "w = m.addVars(len(expected_return), lb=0)\n"
    "m.addConstr(w.sum() == 1)\n"
    "m.addConstr(gp.quicksum(expected_return[i] * w[i] for i in A) >= target_return)\n"
    "m.setObjective(gp.quicksum(covariance[i][j] * w[i] * w[j] for i in A for j in A), GRB.MINIMIZE)\n"
)

class Portfolio(Family):
    name = "portfolio"
    categories = ("NLP",)
    infeasible_variants = True

    def sample(self, rng: random.Random, size: int, category: str | None = None, infeasible: bool = False) -> Spec:
        self._category(rng, category)
        n = size + 1
        assets = rng.sample(ASSETS, n)
        ret = [round(rng.uniform(1.0, 12.0), 1) for _ in assets]
        # covariance from a one-factor model plus idiosyncratic variance: symmetric positive definite
        beta = [rng.uniform(0.2, 3.0) for _ in assets]
        idio = [rng.uniform(2.0, 25.0) for _ in assets]
        cov = [[round(beta[i] * beta[j] * 4.0 + (idio[i] if i == j else 0.0), 2) for j in range(n)] for i in range(n)]
        target = round(rng.uniform(min(ret) + 0.1 * (max(ret) - min(ret)), max(ret) - 0.1 * (max(ret) - min(ret))), 1)
        if infeasible:  # no long-only portfolio returns more than its best asset
            target = round(max(ret) + 0.5 + (target - min(ret)) / (max(ret) - min(ret) + 1e-9), 1)
        var = [Var(f"w_{i}") for i in range(n)]
        cons = [Constraint("budget", {f"w_{i}": 1 for i in range(n)}, "==", 1),
                Constraint("return", {f"w_{i}": ret[i] for i in range(n)}, ">=", target)]
        quad = [(f"w_{i}", f"w_{j}", cov[i][j]) for i in range(n) for j in range(n)]
        ir = OptModel(self.name, "min", var, {}, cons, quad)
        params = [
            Param("expected_return", "expected annual return (%)", ret, assets, phrase="{label} is expected to return {value}% a year."),
            Param("covariance", "covariance of returns (%^2)", cov, assets, list(assets),
                  phrase="The covariances of {label} with each asset are: {values}."),
            Param("target_return", "target portfolio return (%)", target,
                  phrase="The portfolio must return at least {value}% a year."),
        ]
        story = f"An investor splits a budget between {join(assets)}; short selling is not allowed."
        ask = "Which fractions of the budget minimise the variance of the portfolio's return? Report the minimum variance."
        code = model_code(HIGHSPY, PYOMO, GUROBI, pyomo_solver="highs")  # appsi_highs has no QP
        return Spec(self.name, story, params, ask, ir, MATH, code, {"expected_return": "asset"})
