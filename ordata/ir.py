"""A small typed intermediate representation (IR) of an optimisation model, and its HiGHS solve.

Models are linear or mixed-integer with an optional convex quadratic objective (``quadratic``
terms ``coeff * x_i * x_j``): LP, IP, MILP, or NLP (convex QP, continuous variables only).

Every generated problem is built as an IR first; the IR is solved with HiGHS (highspy) to obtain the
ground truth, and the natural-language question, the mathematical model and the reference program
are rendered from the same data.
"""

from __future__ import annotations

import functools
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Literal

from ordata.executors import process_pool_map

VarKind = Literal["continuous", "integer", "binary"]
Sense = Literal["<=", ">=", "=="]


@dataclass
class Var:
    name: str
    lb: float = 0.0
    ub: float = math.inf
    kind: VarKind = "continuous"


@dataclass
class Constraint:
    name: str
    coeffs: dict[str, float]
    sense: Sense
    rhs: float


@dataclass
class OptModel:
    name: str
    sense: Literal["min", "max"]
    variables: list[Var]
    objective: dict[str, float]
    constraints: list[Constraint] = field(default_factory=list)
    quadratic: list[tuple[str, str, float]] = field(default_factory=list)  # objective += c * x_i * x_j

    @property
    def category(self) -> str:
        kinds = {v.kind for v in self.variables}
        if self.quadratic:
            return "NLP"
        if kinds == {"continuous"}:
            return "LP"
        if "continuous" in kinds:
            return "MILP"
        return "IP"

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class SolveResult:
    status: str  # "optimal" | "infeasible" | "unbounded" | other HiGHS status text
    objective: float | None
    values: dict[str, float]
    seconds: float


@functools.lru_cache(maxsize=1)
def _silence_banner() -> None:
    """HiGHS prints a banner on the first ``Highs()`` of a process; swallow it (fd-level stdout)."""
    import highspy

    sys.stdout.flush()
    saved, devnull = os.dup(1), os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        highspy.Highs()
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(devnull)


def solve_highs(model: OptModel, time_limit: float = 10.0) -> SolveResult:
    """Solve ``model`` with HiGHS and return status, objective and variable values."""
    import highspy

    _silence_banner()
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("time_limit", float(time_limit))
    h.setOptionValue("mip_rel_gap", 0.0)  # the ground truth is the proven optimum, not one within HiGHS' 1e-4 gap
    index = {v.name: i for i, v in enumerate(model.variables)}
    inf = highspy.kHighsInf
    for v in model.variables:
        ub = 1.0 if v.kind == "binary" else (inf if math.isinf(v.ub) else v.ub)
        h.addVar(v.lb, ub)
    for v in model.variables:
        if v.kind != "continuous":
            h.changeColIntegrality(index[v.name], highspy.HighsVarType.kInteger)
    # a quadratic objective is solved as a minimisation (HiGHS wants a convex min-QP): negate for max
    flip = -1.0 if (model.sense == "max" and model.quadratic) else 1.0
    for name, c in model.objective.items():
        h.changeColCost(index[name], flip * float(c))
    if model.sense == "max" and not model.quadratic:
        h.changeObjectiveSense(highspy.ObjSense.kMaximize)
    if model.quadratic:
        if any(v.kind != "continuous" for v in model.variables):
            raise ValueError(f"{model.name}: HiGHS solves quadratic objectives over continuous variables only")
        _pass_hessian(h, model, index, flip)
    for con in model.constraints:
        idx = [index[n] for n in con.coeffs]
        vals = [float(c) for c in con.coeffs.values()]
        lo = con.rhs if con.sense in (">=", "==") else -inf
        hi = con.rhs if con.sense in ("<=", "==") else inf
        h.addRow(lo, hi, len(idx), idx, vals)
    t0 = time.perf_counter()
    h.run()
    seconds = time.perf_counter() - t0
    status = h.getModelStatus()
    if status == highspy.HighsModelStatus.kOptimal:
        sol = h.getSolution().col_value
        values = {v.name: float(sol[i]) for i, v in enumerate(model.variables)}
        return SolveResult("optimal", flip * float(h.getInfo().objective_function_value), values, seconds)
    text = h.modelStatusToString(status).lower()
    if status == highspy.HighsModelStatus.kInfeasible:
        text = "infeasible"
    elif status == highspy.HighsModelStatus.kUnbounded:
        text = "unbounded"
    return SolveResult(text, None, {}, seconds)


def _pass_hessian(h, model: OptModel, index: dict[str, int], flip: float) -> None:
    """HiGHS minimises c'x + 1/2 x'Qx; pass Q's lower triangle column-wise (CSC)."""
    import highspy

    q: dict[tuple[int, int], float] = {}
    for a, b, c in model.quadratic:
        i, j = sorted((index[a], index[b]), reverse=True)  # (row >= col): lower triangle
        q[(i, j)] = q.get((i, j), 0.0) + flip * float(c) * (2.0 if i == j else 1.0)
    n = len(model.variables)
    start, rows, vals = [0], [], []
    for col in range(n):
        for (i, j), v in sorted(q.items(), key=lambda kv: (kv[0][1], kv[0][0])):
            if j == col:
                rows.append(i)
                vals.append(v)
        start.append(len(rows))
    h.passHessian(n, len(vals), highspy.HessianFormat.kTriangular, start, rows, vals)


def _solve_one(args: tuple[OptModel, float]) -> SolveResult:
    model, time_limit = args
    try:
        return solve_highs(model, time_limit)
    except Exception as e:  # noqa: BLE001 - a bad instance is reported, never crashes the pool
        return SolveResult(f"error: {type(e).__name__}: {e}", None, {}, 0.0)


def solve_many(models: list[OptModel], workers: int = 2, time_limit: float = 10.0) -> list[SolveResult]:
    """Solve every model with HiGHS in spawned worker processes (no solver state shared with the caller)."""

    return process_pool_map(workers, chunksize=16)(_solve_one, [(m, time_limit) for m in models])
