"""Zero-shot prompt templates for benchmark items.

* ``reference`` - the reference system's style: the model thinks in ``<think>...</think>``, writes the
  mathematical model in ``<model>...</model>`` and the program in ``<python>```python ...```</python>``,
  using the solver API given (gurobipy by default, as the reference evaluation did). The program prints
  ``Optimal objective: <value>`` (or ``Status: infeasible`` / ``Status: unbounded``), the lines that
  :mod:`eval.extract` parses. Items with data files (DPS style) name the files and show their JSON keys
  with shapes, not the values; B4O-ORGEval items (``extra["scoring"] == "lp_structure"``) also ask for the
  model to be written to :data:`LP_FILE`.
* ``synthetic`` - exactly the project's SFT prompt (:data:`SYSTEM_PROMPT` + :func:`user_prompt`, defined
  here and used by ``ordata.curate`` to render the training chats), so the held-out synthetic split is
  prompted as in training; the API defaults to the item's own ``extra["api"]``.

The data engine's LLM stages use the ``reference`` prompt to sample answers (self-distillation) and to model a
rewritten problem (the forward-modelling check), and :func:`rewrite_messages` to paraphrase a problem; the
repair turns (:data:`REWRITE_REPAIR`, :data:`PROGRAM_REPAIR`) feed an error back once. Evaluation's repair rounds
(``eval.repair_rounds``) continue a conversation with :func:`repair_turn` and :func:`execution_feedback`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from eval.benchmark_formats import BenchmarkItem

TEMPLATES = ("reference", "synthetic")
# bumped whenever a template's wording changes; part of every run fingerprint (eval.harness.run_fingerprint)
PROMPT_VERSION = 1
DEFAULT_API = "gurobipy"
LP_FILE = "model.lp"  # where a B4O-ORGEval program writes its model for the LP-equivalence check
MAX_KEYS_SHOWN = 60

# The project's own OR prompt: the SFT chats (ordata.curate) and the synthetic template share it.
SYSTEM_PROMPT = "You are an operations research expert."
INSTRUCTION = "Write a Python program with {api} that solves this problem and prints the optimal objective value."
MODEL_INSTRUCTION = "Formulate the mathematical model of this problem and state its optimal objective value."
API_NAMES = {"highspy": "highspy", "pyomo": "Pyomo (HiGHS solver)", "gurobipy": "gurobipy"}


def user_prompt(question: str, api: str = "highspy", style: str = "code_only") -> str:
    instruction = MODEL_INSTRUCTION if style == "math_model" else INSTRUCTION.format(api=API_NAMES[api])
    return f"{question}\n\n{instruction}"


@dataclass(frozen=True)
class SolverApi:
    """How a prompt names a solver API, the imports it suggests and how that API writes an LP file."""

    name: str
    imports: str
    write_lp: str


APIS: dict[str, SolverApi] = {
    "gurobipy": SolverApi("gurobipy (Gurobi 12.x)", "import gurobipy as gp\nfrom gurobipy import GRB",
                          f'model.write("{LP_FILE}")'),
    "highspy": SolverApi("highspy (the HiGHS Python API)", "import highspy", f'h.writeModel("{LP_FILE}")'),
    "pyomo": SolverApi("Pyomo (solver: HiGHS via SolverFactory(\"appsi_highs\"))", "import pyomo.environ as pyo",
                       f'model.write("{LP_FILE}", io_options={{"symbolic_solver_labels": True}})'),
    "pulp": SolverApi("PuLP with its bundled CBC solver", "import pulp", f'prob.writeLP("{LP_FILE}")'),
    "ortools": SolverApi("OR-Tools (pywraplp linear/MIP solver)", "from ortools.linear_solver import pywraplp",
                         f'open("{LP_FILE}", "w").write(solver.ExportModelAsLpFormat(False))'),
    "coptpy": SolverApi("coptpy (COPT)", "import coptpy as cp\nfrom coptpy import COPT", f'model.write("{LP_FILE}")'),
    "scipy": SolverApi("SciPy (scipy.optimize: linprog, milp or minimize)", "from scipy import optimize",
                       f"write the model in CPLEX LP format to {LP_FILE} yourself"),
}

REFERENCE_SYSTEM = (
    "You are an expert in operations research and mathematical optimization, fluent in {api}. "
    "When the user gives you an optimization problem, analyse it, build a complete mathematical model "
    "and implement it in Python with {api}.\n"
    "Structure your answer in three tagged parts:\n"
    "1. <think> ... </think>: reason step by step to identify the decision variables, the objective and "
    "the constraints.\n"
    "2. <model> ... </model>: the complete mathematical model: sets, parameters, decision variables (with "
    "their types and bounds), the objective function and every constraint.\n"
    "3. <python>\n```python\n...\n```\n</python>: one complete, runnable Python program that builds and "
    "solves the model with {api}.\n"
    "Write each part inside its tags, in Markdown."
)

REFERENCE_REQUIREMENTS = (
    "Requirements for the program:\n"
    "- Use {api}, e.g.\n```python\n{imports}\n```\n"
    "- Give every variable its type and its lower and upper bounds.\n"
    "- Write the code at module level (no `if __name__ == \"__main__\":`) and read nothing from standard input.\n"
    "- When an optimal solution is found, print its objective value as `Optimal objective: <value>`, "
    "e.g. `print(\"Optimal objective:\", value)`.\n"
    "- If the problem is infeasible, print `Status: infeasible`; if it is unbounded, print `Status: unbounded`."
)


def _api(api: str) -> SolverApi:
    if api not in APIS:
        raise ValueError(f"unknown solver api {api!r}; valid: {', '.join(APIS)}")
    return APIS[api]


def _shape(value: Any) -> str:
    """A short description of a JSON value's type and size, without its contents (``list[3] of number``)."""
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if value is None:
        return "null"
    if isinstance(value, list):
        inner = {_shape(v) for v in value}
        of = f" of {inner.pop()}" if len(inner) == 1 else " of mixed values" if inner else ""
        return f"list[{len(value)}]{of}"
    if isinstance(value, dict):
        return f"object with {len(value)} keys"
    return type(value).__name__


def describe_file(name: str, text: str) -> str:
    """One line naming a data file and its top-level JSON keys with their shapes (never the values)."""
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, TypeError):
        return f"- `{name}`"
    if isinstance(data, dict):
        keys = [f"`{k}` ({_shape(v)})" for k, v in list(data.items())[:MAX_KEYS_SHOWN]]
        more = f", and {len(data) - MAX_KEYS_SHOWN} more keys" if len(data) > MAX_KEYS_SHOWN else ""
        return f"- `{name}`: a JSON object with the keys " + ", ".join(keys) + more
    return f"- `{name}`: a JSON {_shape(data)}"


def data_section(files: dict[str, str]) -> str:
    """The prompt section telling the model which data files it gets and what keys they hold."""
    names = list(files)
    first = names[0]
    lines = [
        "# Data",
        "The instance data is provided in " + ("a file" if len(names) == 1 else "these files")
        + " in the program's working directory:",
        *[describe_file(n, files[n]) for n in names],
        f"Read the data from these files by their plain names (e.g. `json.load(open(\"{first}\"))`), not from an "
        "absolute path, and use no other files. Use only the parameters the problem describes and the files "
        "contain; derive any helper quantity from them.",
    ]
    return "\n".join(lines)


def reference_messages(item: BenchmarkItem, api: str = DEFAULT_API) -> list[dict[str, str]]:
    """The reference-style system + user messages for one item."""
    info = _api(api)
    parts = ["Answer the following mathematical modelling question.", "# Problem\n" + item.question.strip()]
    if item.files:
        parts.append(data_section(item.files))
    requirements = REFERENCE_REQUIREMENTS.format(api=info.name, imports=info.imports)
    if item.extra.get("scoring") == "lp_structure":
        requirements += (f"\n- Before solving, save the model in LP format as `{LP_FILE}` in the working "
                         f"directory ({info.write_lp}).")
    parts += [requirements, "Please think step by step."]
    return [{"role": "system", "content": REFERENCE_SYSTEM.format(api=info.name)},
            {"role": "user", "content": "\n\n".join(parts)}]


def synthetic_messages(item: BenchmarkItem, api: str | None = None) -> list[dict[str, str]]:
    """The project's SFT prompt (as in :func:`eval.harness.generate_answers`)."""
    api = api or item.extra.get("api") or "highspy"
    if api not in API_NAMES:
        raise ValueError(f"unknown solver api {api!r} for the synthetic template; valid: {', '.join(API_NAMES)}")
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user_prompt(item.question, api)}]


# The data engine's rewrite prompt (ordata/llm/rewrite.py): a rendered problem paraphrased into natural wording.
REWRITE_SYSTEM = (
    "You rewrite optimisation word problems in natural, varied language, as a person describing their own "
    "business situation would, without changing the problem. The reader must be able to build exactly the same "
    "mathematical model from your text as from the original.")
REWRITE_KEEP = {
    "DP": "Keep every number exactly as written (the same digits and units), each attached to the same item and "
          "quantity. Write no other numbers: no numbered lists, no totals, no examples.",
    "DT": "Keep every Markdown table exactly as it is (the same rows, columns, labels and numbers); rewrite only the "
          "prose around the tables. Write no other numbers.",
    "DPS": "The data stay in the attached file `{file}`: keep its name, and every key name in backticks exactly as "
           "written, with its meaning, unit and order. Write no numbers of your own.",
}
REWRITE_INSTRUCTION = (
    "Rewrite the following optimisation problem.\n\n{keep}\nKeep the question that is asked (what to optimise, "
    "and that the optimal objective value is wanted). Answer with the rewritten problem only, between <problem> and "
    "</problem>.\n\n<problem>\n{question}\n</problem>")
REWRITE_REPAIR = ("Your rewrite was rejected: {problem}. Write the whole problem again, fixing this, between "
                  "<problem> and </problem>.")
PROGRAM_REPAIR = ("Executing your program in the sandbox failed: {problem}. Find the mistake and answer again in the "
                  "same format, with the complete corrected program.")


STOPPED = {"timeout": "it did not finish within its time limit", "cpu_limit": "it exceeded its CPU time limit",
           "memory_limit": "it ran out of memory", "output_limit": "it wrote more output than allowed",
           "killed": "it was killed"}
TRACEBACK_LINES = 20  # the end of a traceback quoted in a repair turn


def execution_feedback(outcome: str, exec_result: dict | None) -> str:
    """What went wrong when a program ran, for a repair turn (:data:`PROGRAM_REPAIR`): the trimmed traceback, the
    limit it hit, or the solver's status and, where the solver gave one, an irreducible infeasible subsystem. Only
    what the program's own run shows: never the expected answer."""
    res = exec_result or {}
    if outcome == "no_program":
        return "the answer contains no complete ```python code block"
    if outcome in STOPPED:
        return STOPPED[outcome]
    if outcome == "error":
        tail = "\n".join((res.get("stderr_tail") or "").strip().splitlines()[-TRACEBACK_LINES:])
        return f"it stopped with an error:\n{tail[-1500:]}" if tail else "it exited with an error status"
    if outcome == "no_solve":
        return "it finished without solving a model with the solver"
    attested = res.get("attested") or {}
    status = attested.get("status") or res.get("reported") or "no result"
    text = f"the solver reported the model as {status.replace('_', ' ')} (solver status: {attested.get('raw_status')})"
    iis = attested.get("iis") or {}
    if iis.get("constraints") or iis.get("bounds"):
        text += (f"; an irreducible infeasible subsystem: constraints {', '.join(iis.get('constraints') or []) or '-'}"
                 f"; variable bounds {', '.join(iis.get('bounds') or []) or '-'}")
    return text


def repair_turn(messages: list[dict[str, str]], answer: str, feedback: str) -> list[dict[str, str]]:
    """The conversation continued: the model's ``answer``, then a user turn quoting what its program did."""
    return [*messages, {"role": "assistant", "content": answer},
            {"role": "user", "content": PROGRAM_REPAIR.format(problem=feedback)}]


def rewrite_messages(question: str, representation: str, data_file: str = "data.json") -> list[dict[str, str]]:
    """System + user messages asking for a paraphrase of a rendered problem in ``representation`` (DP / DT / DPS)."""
    keep = REWRITE_KEEP[representation].format(file=data_file)
    return [{"role": "system", "content": REWRITE_SYSTEM},
            {"role": "user", "content": REWRITE_INSTRUCTION.format(keep=keep, question=question.strip())}]


def build_messages(item: BenchmarkItem, template: str = "reference", api: str | None = None) -> list[dict[str, str]]:
    """Chat messages (system + user) for ``item``.

    ``api`` defaults to gurobipy for ``reference`` and to the item's own API (else highspy) for
    ``synthetic``. An unknown template or API raises ValueError listing the valid ones.
    """
    if template == "reference":
        return reference_messages(item, api or DEFAULT_API)
    if template == "synthetic":
        return synthetic_messages(item, api)
    raise ValueError(f"unknown prompt template {template!r}; valid: {', '.join(TEMPLATES)}")
