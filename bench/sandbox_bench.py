"""Sandbox overhead and execution throughput.

Runs the same solver programs (a highspy LP, a gurobipy MILP, a pyomo LP) as (a) a bare subprocess
(``python -I program.py``: no namespaces, no attestation) and (b) through :func:`eval.sandbox.run_program`
(the strongest isolation available + solver attestation), alternating the two, and prints the median wall
time per execution, their ratio (target <= 1.5x), and the executions/s of the sandbox with a worker pool.

Usage: ``python bench/sandbox_bench.py [--rounds 15] [--workers 2]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eval.sandbox import isolation_level, run_program  # noqa: E402

PROGRAMS = {
    "highspy_lp": (
        "import highspy\nh = highspy.Highs()\nh.silent()\nn = 60\n"
        "x = [h.addVariable(lb=0, ub=10) for _ in range(n)]\n"
        "for i in range(n - 1):\n    h.addConstr(x[i] + 2 * x[i + 1] <= 15 + i % 7)\n"
        "h.maximize(sum((1 + i % 5) * x[i] for i in range(n)))\n"
        "print('Optimal objective:', h.getInfo().objective_function_value)\n"),
    "gurobipy_milp": (
        "import gurobipy as gp\nfrom gurobipy import GRB\nm = gp.Model()\nm.Params.OutputFlag = 0\n"
        "x = m.addVars(30, vtype=GRB.INTEGER, ub=9)\n"
        "m.addConstrs(x[i] + x[i + 1] <= 11 for i in range(29))\n"
        "m.setObjective(gp.quicksum((i % 4 + 1) * x[i] for i in range(30)), GRB.MAXIMIZE)\nm.optimize()\n"
        "print('Optimal objective:', m.ObjVal)\n"),
    "pyomo_lp": (
        "import pyomo.environ as pyo\nm = pyo.ConcreteModel()\nm.I = pyo.RangeSet(0, 19)\n"
        "m.x = pyo.Var(m.I, bounds=(0, 5))\nm.c = pyo.Constraint(expr=sum(m.x[i] for i in m.I) <= 40)\n"
        "m.obj = pyo.Objective(expr=sum((i % 3 + 1) * m.x[i] for i in m.I), sense=pyo.maximize)\n"
        "r = pyo.SolverFactory('appsi_highs').solve(m)\nprint('Optimal objective:', pyo.value(m.obj))\n"),
}


def bare(code: str) -> float:
    with tempfile.TemporaryDirectory() as wd:
        Path(wd, "program.py").write_text(code)
        t0 = time.perf_counter()
        env = {"PATH": os.environ.get("PATH", ""), "HOME": wd, "TMPDIR": wd, "OMP_NUM_THREADS": "1",
               "OPENBLAS_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"}  # the sandbox's environment
        subprocess.run([sys.executable, "-I", "program.py"], cwd=wd, env=env, capture_output=True, check=True,
                       timeout=120)
        return time.perf_counter() - t0


def sandboxed(code: str) -> float:
    t0 = time.perf_counter()
    res = run_program(code, timeout_s=120)
    dt = time.perf_counter() - t0
    if res.status != "ok":
        raise RuntimeError(f"sandboxed run failed: {res.status} {res.stderr_tail[-300:]}")
    return dt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()
    print(f"isolation: {isolation_level()}  rounds: {args.rounds}")
    ratios = []
    for name, code in PROGRAMS.items():
        bare(code), sandboxed(code)  # warm the page cache
        b, s = [], []
        for _ in range(args.rounds):
            b.append(bare(code))
            s.append(sandboxed(code))
        mb, ms = statistics.median(b), statistics.median(s)
        ratios.append(ms / mb)
        print(f"{name:14s} bare {mb * 1000:7.1f} ms   sandbox {ms * 1000:7.1f} ms   overhead {ms / mb:4.2f}x")
    print(f"median overhead over programs: {statistics.median(ratios):.2f}x (target <= 1.5x)")
    jobs = [code for code in PROGRAMS.values() for _ in range(args.rounds)]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=args.workers) as pool:
        list(pool.map(sandboxed, jobs))
    secs = time.perf_counter() - t0
    print(f"throughput: {len(jobs) / secs:.2f} sandboxed executions/s with {args.workers} workers "
          f"({len(jobs)} programs in {secs:.1f} s)")


if __name__ == "__main__":
    main()
