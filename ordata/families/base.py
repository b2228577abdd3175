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
PRINT_OBJECTIVE = {
    "highspy": 'print("Optimal objective:", h.getInfo().objective_function_value)\n',
    "pyomo": 'print("Optimal objective:", pyo.value(m.obj))\n',
    "gurobipy": 'print("Optimal objective:", m.ObjVal)\n',
}
GUROBI_HEADER = 'm = gp.Model()\nm.Params.OutputFlag = 0\n'
GUROBI_SOLVE = "m.optimize()\n"
PYOMO_SOLVE = 'pyo.SolverFactory("appsi_highs").solve(m)\n'


def model_code(highspy_code: str, pyomo_code: str, gurobi_code: str, whole: bool = False,
               pyomo_solve: str = PYOMO_SOLVE) -> dict[str, str]:
    """Complete model code per API: ``{integrality}`` / ``{domain}`` / ``{vtype}`` placeholders become
    integer or continuous, then the solve call and the objective print are appended."""
    hs = highspy_code.replace("{integrality}", ", type=highspy.HighsVarType.kInteger" if whole else "")
    py = pyomo_code.replace("{domain}", "NonNegativeIntegers" if whole else "NonNegativeReals")
    gu = gurobi_code.replace("{vtype}", "GRB.INTEGER" if whole else "GRB.CONTINUOUS")
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

    def sample(self, rng: random.Random, size: int, category: str | None = None) -> Spec:
        raise NotImplementedError

    def _category(self, rng: random.Random, category: str | None) -> str:
        if category is None:
            return rng.choice(self.categories)
        if category not in self.categories:
            raise ValueError(f"family {self.name} cannot produce {category} (it produces {self.categories})")
        return category


def join(words: list[str]) -> str:
    return ", ".join(words[:-1]) + " and " + words[-1] if len(words) > 1 else words[0]
