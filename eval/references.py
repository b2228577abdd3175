"""Run the B4O (bench4opt) reference LP models through the project's execution path, and self-check
the ORGEval equivalence scorer on them.

B4O-Feasible layout (``bench4opt_feasible/``): ``test.jsonl`` rows with ``id``, ``reference_lp_path``
(``lp_code/model_<k>_problem<k>.lp``), ``data_path`` (``lp_final/*.json``) and ``optimal_value``. The
LP files are fully instantiated (Gurobi ``model.write`` output of the reference program run on its
data), so the data JSON is not needed to solve them.

Each reference becomes a small Python program that reads ``model.lp`` (passed with ``files=``) and
solves it; it runs in ``eval.sandbox.run_programs`` like any generated program, printing
``Optimal objective: <value>`` or ``Status: <status>``, plus ``Solver: <name>``. Solver choice:

* ``highs``: highspy only (brackets inside Gurobi names are rewritten first, see ``eval.lp_format``).
* ``gurobi``: gurobipy only.
* ``auto`` (default): highspy; gurobipy when HiGHS cannot read the model (quadratic constraints) or
  cannot solve it (a non-convex quadratic objective gives "Solve error"), if gurobipy is installed.

A result matches when ``|p - g| / (|g| + 1) <= 1e-6``; an ``optimal_value`` of ``null`` means
"expected infeasible" and matches a program that reports infeasibility.
"""

from __future__ import annotations

import json
import re
import time
from collections import Counter
from pathlib import Path

from eval.lp_equiv import canonical, equivalent, perturb_lp, scramble_lp
from eval.sandbox import Program, run_programs

REL_TOL = 1e-6

PROGRAM = r'''
import re
import sys

SOLVER = __SOLVER__
TIME_LIMIT = __TIME_LIMIT__
text = open("model.lp").read()


def highs():
    import highspy
    lo, hi = next(((a, b) for a, b in (("{", "}"), ("(", ")")) if a not in text and b not in text), ("_L_", "_R_"))
    fixed = re.sub(r"(?<=[^\s\[\]+\-*/^:<>=])\[([^\s\[\]]*)\]", lambda m: lo + m.group(1) + hi, text)
    open("model_highs.lp", "w").write(fixed)
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("threads", 1)
    h.setOptionValue("time_limit", TIME_LIMIT)
    if h.readModel("model_highs.lp") not in (highspy.HighsStatus.kOk, highspy.HighsStatus.kWarning):
        print("Note: highs could not read the model")
        return None
    h.run()
    st = h.getModelStatus()
    S = highspy.HighsModelStatus
    if st == S.kOptimal:
        return "optimal", h.getInfo().objective_function_value
    if st == S.kInfeasible:
        return "infeasible", None
    if st == S.kUnbounded:
        return "unbounded", None
    if st == S.kUnboundedOrInfeasible:
        return "infeasible or unbounded", None
    if st == S.kSolveError:
        print("Note: highs gave a solve error (e.g. a non-convex quadratic objective)")
        return None
    return h.modelStatusToString(st), None


def gurobi():
    import gurobipy as gp
    env = gp.Env(params={"OutputFlag": 0, "Threads": 1, "TimeLimit": TIME_LIMIT})
    m = gp.read("model.lp", env)
    m.optimize()
    if m.Status == gp.GRB.OPTIMAL:
        return "optimal", m.ObjVal
    names = {gp.GRB.INFEASIBLE: "infeasible", gp.GRB.UNBOUNDED: "unbounded",
             gp.GRB.INF_OR_UNBD: "infeasible or unbounded"}
    return names.get(m.Status, "gurobi status %d" % m.Status), None


result, used = None, None
for name, fn in (("highs", highs), ("gurobi", gurobi)):
    if SOLVER not in ("auto", name):
        continue
    try:
        result = fn()
    except ImportError:
        print("Note: %s is not installed" % name)
        result = None
    if result is not None:
        used = name
        break
print("Solver: %s" % (used or "none"))
if result is None:
    print("Status: solver_error")
    sys.exit(3)
status, value = result
if status == "optimal":
    print("Optimal objective: %r" % value)
else:
    print("Status: %s" % status)
'''


def reference_program(solver: str = "auto", time_limit_s: float = 50.0) -> str:
    """The solver program for one reference (reads ``model.lp`` from its working directory)."""
    if solver not in ("auto", "highs", "gurobi"):
        raise ValueError(f"solver must be auto, highs or gurobi, not {solver!r}")
    return PROGRAM.replace("__SOLVER__", repr(solver)).replace("__TIME_LIMIT__", repr(float(time_limit_s)))


def load_rows(benchmark_dir: str | Path, name: str = "test.jsonl", limit: int | None = None) -> list[dict]:
    """The JSONL rows of ``benchmark_dir/name`` (first ``limit``)."""
    lines = Path(benchmark_dir, name).read_text().splitlines()
    rows = [json.loads(x) for x in lines if x.strip()]
    return rows[:limit] if limit is not None else rows


def _lp_path(benchmark_dir: Path, row: dict) -> Path:
    if row.get("reference_lp_path"):
        return benchmark_dir / row["reference_lp_path"]
    k = re.search(r"_(\d+)$", row["id"]).group(1)  # BENCH4OPT_<k> -> lp_code/model_<k>_problem<k>.lp
    return benchmark_dir / "lp_code" / f"model_{k}_problem{k}.lp"


def matches(got: float | None, reported: str | None, expected: float | None) -> bool:
    """``|got - expected| / (|expected| + 1) <= 1e-6``; ``expected`` None wants a reported infeasibility."""
    if expected is None:
        return reported in ("infeasible", "infeasible_or_unbounded")
    return got is not None and reported == "optimal" and abs(got - expected) / (abs(expected) + 1) <= REL_TOL


def run_references(benchmark_dir: str | Path, limit: int | None = None, workers: int = 2, timeout_s: float = 60,
                   solver: str = "auto") -> dict:
    """Solve every reference LP of a B4O-Feasible directory in the sandbox and compare with ``optimal_value``.

    Returns ``{"n", "matched", "match_rate", "mismatches": [{"id", "expected", "got", "status",
    "reported", "solver", "stdout_tail", "stderr_tail"}], "max_rel_error_matched", "solvers": {name: count}, "statuses": {status: count},
    "isolation", "seconds" (wall), "exec_seconds" (sum over programs), "max_exec_seconds"}``.
    """
    root = Path(benchmark_dir)
    rows = load_rows(root, limit=limit)
    program = reference_program(solver, time_limit_s=max(1.0, timeout_s - 10))

    t0 = time.perf_counter()
    programs = [Program(program, {"model.lp": _lp_path(root, row).read_bytes()}) for row in rows]
    batch = max(1, -(-len(rows) // max(1, workers)))  # one sandbox per worker: the solver imports load once each
    results = run_programs(programs, timeout_s=timeout_s, memory_mb=4096, workers=workers, batch_size=min(batch, 64),
                           preload=("numpy", "highspy"))
    wall = time.perf_counter() - t0
    mismatches, solvers, statuses, worst = [], Counter(), Counter(), 0.0
    for row, res in zip(rows, results):
        used = re.search(r"Solver: (\w+)", res.stdout_tail or "")
        solvers[used.group(1) if used else "none"] += 1
        statuses[res.status] += 1
        expected = row.get("optimal_value")
        if matches(res.objective, res.reported, expected) and expected is not None:
            worst = max(worst, abs(res.objective - expected) / (abs(expected) + 1))
        elif not matches(res.objective, res.reported, expected):
            mismatches.append({"id": row["id"], "expected": expected, "got": res.objective, "status": res.status,
                               "reported": res.reported, "solver": used.group(1) if used else None,
                               "stdout_tail": (res.stdout_tail or "")[-300:],
                               "stderr_tail": (res.stderr_tail or "")[-300:]})
    n = len(rows)
    return {
        "n": n,
        "matched": n - len(mismatches),
        "match_rate": (n - len(mismatches)) / n if n else 0.0,
        "mismatches": mismatches,
        "max_rel_error_matched": worst,
        "solvers": dict(solvers),
        "statuses": dict(statuses),
        "isolation": results[0].isolation if results else None,
        "seconds": round(wall, 2),
        "exec_seconds": round(sum(r.seconds for r in results), 2),
        "max_exec_seconds": round(max((r.seconds for r in results), default=0.0), 2),
    }


def orgeval_self_check(benchmark_dir: str | Path, limit: int | None = None, seed: int = 0) -> dict:
    """Check the ORGEval scorer on the reference LPs of a B4O-ORGEval directory (``bench4opt/``).

    For every reference R: R ~ R, R ~ scramble_lp(R) (renamed, reordered, rescaled, flipped senses),
    and R !~ perturb_lp(R) (one constraint coefficient times 1.5). A perturbation the light presolve
    absorbs (it only moves a bound that a tighter bound makes redundant, or rescales a slack) leaves
    the same optimisation problem: such ids are listed under ``perturbed_absorbed`` and counted as
    caught when the strict form (``reduce=False``) tells them apart. Returns counts, failures,
    methods and readers.
    """
    root = Path(benchmark_dir)
    rows = load_rows(root, limit=limit)
    counts, methods, readers = Counter(), Counter(), Counter()
    failures, absorbed = [], []
    t0 = time.perf_counter()
    for i, row in enumerate(rows):
        text = _lp_path(root, row).read_text()
        try:
            ref = canonical(text)
        except ValueError as exc:
            failures.append({"id": row["id"], "check": "read", "detail": str(exc)})
            continue
        readers[ref.reader] += 1
        same = equivalent(ref, text)
        scrambled = equivalent(ref, scramble_lp(text, seed=seed + i))
        perturbed_text = perturb_lp(text, index=seed + i)
        perturbed = equivalent(ref, perturbed_text)
        if perturbed.equivalent:
            strict = equivalent(canonical(text, reduce=False), perturbed_text, reduce=False)
            if not strict.equivalent:
                absorbed.append(row["id"])
                perturbed = strict
        for check, res, want in (("self", same, True), ("scrambled", scrambled, True), ("perturbed", perturbed, False)):
            methods[f"{check}:{res.method}"] += 1
            if res.equivalent == want:
                counts[f"{check}_ok"] += 1
            else:
                failures.append({"id": row["id"], "check": check, "method": res.method, "detail": res.detail})
    n = len(rows)
    return {
        "n": n,
        "self_equivalent": counts["self_ok"],
        "scrambled_equivalent": counts["scrambled_ok"],
        "perturbed_distinguished": counts["perturbed_ok"],
        "perturbed_absorbed": absorbed,
        "failures": failures,
        "methods": dict(sorted(methods.items())),
        "readers": dict(readers),
        "seconds": round(time.perf_counter() - t0, 2),
    }
