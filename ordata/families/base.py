"""The family interface: a sampled instance (``Spec``) and its rendering into question + program."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import ClassVar

from ordata.ir import OptModel
from ordata.params import REPRESENTATIONS, Param, Rendered, data_code, data_file, render_data

APIS: tuple[str, ...] = ("highspy", "pyomo", "gurobipy")
API_IMPORT = {"highspy": "import highspy", "pyomo": "import pyomo.environ as pyo",
              "gurobipy": "import gurobipy as gp\nfrom gurobipy import GRB"}
# every program prints the optimum, or the solver status when there is none (e.g. "Status: Infeasible")
PRINT_OBJECTIVE = {
    "highspy": ('if h.getModelStatus() == highspy.HighsModelStatus.kOptimal:\n'
                '    print("Optimal objective:", h.getInfo().objective_function_value)\n'
                'else:\n'
                '    print("Status:", h.modelStatusToString(h.getModelStatus()))\n'),
    "pyomo": ('if result.solver.termination_condition == pyo.TerminationCondition.optimal:\n'
              '    m.solutions.load_from(result)\n'
              '    print("Optimal objective:", pyo.value(m.obj))\n'
              'else:\n'
              '    print("Status:", result.solver.termination_condition)\n'),
    "gurobipy": ('if m.Status == GRB.OPTIMAL:\n'
                 '    print("Optimal objective:", m.ObjVal)\n'
                 'else:\n'
                 '    print("Status:", {GRB.INFEASIBLE: "infeasible", GRB.UNBOUNDED: "unbounded"}.get(m.Status, m.Status))\n'),
}
# DualReductions=0: gurobi then tells infeasible from unbounded instead of answering INF_OR_UNBD
GUROBI_HEADER = 'm = gp.Model()\nm.Params.OutputFlag = 0\nm.Params.DualReductions = 0\n'
GUROBI_SOLVE = "m.optimize()\n"
PYOMO_SOLVER = "appsi_highs"


def model_code(highspy_code: str, pyomo_code: str, gurobi_code: str, whole: bool = False,
               pyomo_solver: str = PYOMO_SOLVER) -> dict[str, str]:
    """Complete model code per API: ``{integrality}`` / ``{domain}`` / ``{vtype}`` placeholders become
    integer or continuous, then the solve call and the objective print are appended."""
    hs = highspy_code.replace("{integrality}", ", type=highspy.HighsVarType.kInteger" if whole else "")
    py = pyomo_code.replace("{domain}", "NonNegativeIntegers" if whole else "NonNegativeReals")
    gu = gurobi_code.replace("{vtype}", "GRB.INTEGER" if whole else "GRB.CONTINUOUS")
    pyomo_solve = f'result = pyo.SolverFactory("{pyomo_solver}").solve(m, load_solutions=False)\n'
    return {"highspy": hs + PRINT_OBJECTIVE["highspy"], "pyomo": py + pyomo_solve + PRINT_OBJECTIVE["pyomo"],
            "gurobipy": GUROBI_HEADER + gu + GUROBI_SOLVE + PRINT_OBJECTIVE["gurobipy"]}


@dataclass
class Spec:
    """One sampled instance: its story, data, IR, math model and model code per solver API."""

    family: str
    story: str
    params: list[Param]
    ask: str
    ir: OptModel
    math_model: str
    code: dict[str, str]  # model code per API, using the parameter names as variables
    index_names: dict[str, str] = field(default_factory=dict)  # DT header per vector parameter

    @property
    def category(self) -> str:
        return self.ir.category

    @property
    def data(self) -> dict:
        return {p.key: p.values for p in self.params}

    def render(self, rep: str = "DP", api: str = "highspy") -> Rendered:
        if rep not in REPRESENTATIONS:
            raise ValueError(f"unknown representation {rep!r}; expected one of {REPRESENTATIONS}")
        if api not in self.code:
            raise ValueError(f"family {self.family} has no {api!r} program; it has {sorted(self.code)}")
        question = f"{self.story}\n\n{render_data(self.params, rep, self.index_names)}\n\n{self.ask}"
        program = f"{API_IMPORT[api]}\n\n{data_code(self.params, rep)}\n{self.code[api]}"
        files = {"data.json": data_file(self.params)} if rep == "DPS" else {}
        return Rendered(question, program, files)


class Family:
    name: ClassVar[str]
    categories: ClassVar[tuple[str, ...]]
    #: the family can draw deliberately infeasible data (``sample(..., infeasible=True)``)
    infeasible_variants: ClassVar[bool] = False

    def sample(self, rng: random.Random, size: int, category: str | None = None, infeasible: bool = False) -> Spec:
        raise NotImplementedError

    def _category(self, rng: random.Random, category: str | None) -> str:
        if category is None:
            return rng.choice(self.categories)
        if category not in self.categories:
            raise ValueError(f"family {self.name} cannot produce {category} (it produces {self.categories})")
        return category


def join(words: list[str]) -> str:
    return ", ".join(words[:-1]) + " and " + words[-1] if len(words) > 1 else words[0]
