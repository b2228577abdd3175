"""A small typed intermediate representation (IR) of a linear / mixed-integer model, and its HiGHS solve.

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
class LinearModel:
    name: str
    sense: Literal["min", "max"]
    variables: list[Var]
    objective: dict[str, float]
    constraints: list[Constraint] = field(default_factory=list)

    @property
    def category(self) -> str:
        kinds = {v.kind for v in self.variables}
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


def solve_highs(model: LinearModel, time_limit: float = 10.0) -> SolveResult:
    """Solve ``model`` with HiGHS and return status, objective and variable values."""
    import highspy

    _silence_banner()
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("time_limit", float(time_limit))
    index = {v.name: i for i, v in enumerate(model.variables)}
    inf = highspy.kHighsInf
    for v in model.variables:
        ub = 1.0 if v.kind == "binary" else (inf if math.isinf(v.ub) else v.ub)
        h.addVar(v.lb, ub)
    for v in model.variables:
        if v.kind != "continuous":
            h.changeColIntegrality(index[v.name], highspy.HighsVarType.kInteger)
    for name, c in model.objective.items():
        h.changeColCost(index[name], float(c))
    if model.sense == "max":
        h.changeObjectiveSense(highspy.ObjSense.kMaximize)
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
        return SolveResult("optimal", float(h.getInfo().objective_function_value), values, seconds)
    text = h.modelStatusToString(status).lower()
    if status == highspy.HighsModelStatus.kInfeasible:
        text = "infeasible"
    elif status == highspy.HighsModelStatus.kUnbounded:
        text = "unbounded"
    return SolveResult(text, None, {}, seconds)
