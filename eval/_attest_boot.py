"""Solver attestation inside the sandbox: every completed solve becomes an HMAC-signed record.

Loaded by :mod:`eval._sandbox_worker` (the process that runs untrusted programs inside the sandbox);
imports nothing of T-Rex. Protocol:

- :func:`configure` takes the batch's random key (the parent sends it on the worker's stdin);
- :func:`install` adds an import hook that instruments gurobipy, coptpy, pyomo, pulp, highspy, ortools and
  scipy.optimize the moment they are imported (the worker pre-imports some of them, then forks one child per
  program, so every child inherits instrumented modules);
- :func:`set_fd` (in each child) names the program's own private pipe: after every completed solve one line
  ``<json record>\t<hmac-sha256(key, json)>`` is written to it (the moment the solve returns, so a program
  that crashes or hangs afterwards keeps it);
- :func:`collect` sends named output files (e.g. the LP model of an LP-output prompt) over the same channel.

The judge trusts only correctly signed records and uses the last one. Printing, writing to stdout or
writing unsigned lines to any descriptor cannot forge a record. (A program that deliberately searches
the interpreter's memory for the key could sign records of its own run; the sandbox still contains it, and
each program's records travel on its own pipe, so it cannot sign for another program. See docs/eval.md.)

Records: ``{"seq", "pid", "kind", ...}``; a solve is ``{"kind": "solve", "solver", "call", "status",
"raw_status", "objective"}`` with ``status`` one of optimal / infeasible / unbounded /
infeasible_or_unbounded / limit / error / other.
"""

import hashlib
import hmac
import importlib.abc
import json
import math
import os
import sys
import threading

_STATE = threading.local()


def _make_recorder():
    """The signing functions; the key and the pipe live only in their closure (not in a module global)."""
    cell = {"key": b"", "fd": -1, "seq": 0}
    write, dumps, sign, sha = os.write, json.dumps, hmac.new, hashlib.sha256

    def configure(key: bytes) -> None:
        cell["key"] = key

    def set_fd(fd: int) -> None:
        cell["fd"], cell["seq"] = fd, 0

    def emit(payload: dict) -> None:
        if cell["fd"] < 0:
            return
        cell["seq"] += 1
        body = dumps({"seq": cell["seq"], "pid": os.getpid(), **payload}, sort_keys=True)
        try:
            write(cell["fd"], (body + "\t" + sign(cell["key"], body.encode(), sha).hexdigest() + "\n").encode())
        except OSError:
            pass

    def record(solver: str, call: str, status: str, raw, objective, iis: dict | None = None) -> None:
        try:
            obj = float(objective) if objective is not None else None
            if obj is not None and not math.isfinite(obj):
                obj = None
        except (TypeError, ValueError):
            obj = None
        emit({"kind": "solve", "solver": solver, "call": call, "status": status, "raw_status": str(raw),
              "objective": obj, **({"iis": iis} if iis else {})})

    return record, emit, configure, set_fd


_record, _emit, configure, set_fd = _make_recorder()
MAX_COLLECT = 4 * 1024 * 1024
MAX_IIS = 20  # constraints and bounds named per irreducible infeasible subsystem
OPTIONS = {"iis": False}  # the worker sets it for a batch whose infeasible solves should name an IIS (repair)


def want_iis(flag: bool) -> None:
    """Compute an irreducible infeasible subsystem after an infeasible solve, where the solver gives one
    (highspy, gurobipy): its names go into the solve record (for a repair prompt)."""
    OPTIONS["iis"] = bool(flag)


def collect(names: list[str]) -> None:
    """Send the named output files (e.g. an LP model the program wrote) over the signed channel."""
    for name in names:
        try:
            if os.path.isfile(name) and os.path.getsize(name) <= MAX_COLLECT:
                with open(name, encoding="utf-8", errors="replace") as f:
                    _emit({"kind": "file", "name": name, "text": f.read()})
        except OSError:
            pass


def _traced(solver: str, call: str, fn, after):
    """Wrap ``fn``: on the outermost call, record ``after(args, kwargs, result, error)`` once it returns."""

    def wrapper(*args, **kwargs):
        depth = getattr(_STATE, "depth", 0)
        _STATE.depth = depth + 1
        result, error = None, None
        try:
            result = fn(*args, **kwargs)
            return result
        except BaseException as e:  # noqa: BLE001 - recorded, then re-raised
            error = e
            raise
        finally:
            _STATE.depth = depth
            if depth == 0:
                try:
                    status, raw, objective, *iis = after(args, kwargs, result, error)
                except Exception as e:  # noqa: BLE001 - the program may have left the model unusable
                    status, raw, objective, iis = "error", f"{type(e).__name__}: {e}", None, []
                _record(solver, call, status, raw, objective, iis[0] if iis else None)

    wrapper.__name__ = getattr(fn, "__name__", call)
    wrapper.__doc__ = getattr(fn, "__doc__", None)
    return wrapper


def _error(error) -> tuple:
    return "error", f"{type(error).__name__}: {error}", None


# ------------------------------------------------------------------------------------------- solvers
def _patch_highspy(mod) -> None:
    base, cls = mod._core._Highs, mod.Highs
    status_of, info_of, name_of = base.getModelStatus, base.getInfo, base.modelStatusToString
    S = mod.HighsModelStatus
    table = {S.kOptimal: "optimal", S.kInfeasible: "infeasible", S.kUnbounded: "unbounded",
             S.kUnboundedOrInfeasible: "infeasible_or_unbounded", S.kTimeLimit: "limit",
             S.kIterationLimit: "limit", S.kSolutionLimit: "limit", S.kInterrupt: "limit"}

    get_iis, get_lp = getattr(base, "getIis", None), base.getLp

    def iis_of(h) -> dict | None:
        if not OPTIONS["iis"] or get_iis is None:
            return None
        try:
            ok, iis = get_iis(h)
            if not iis.valid_:
                return None
            lp = get_lp(h)
            rows, cols = list(lp.row_names_), list(lp.col_names_)
            name = lambda names, i, kind: names[i] if i < len(names) and names[i] else f"{kind}{i}"  # noqa: E731
            return {"constraints": [name(rows, i, "row") for i in list(iis.row_index_)[:MAX_IIS]],
                    "bounds": [name(cols, i, "col") for i in list(iis.col_index_)[:MAX_IIS]]}
        except Exception:  # noqa: BLE001 - an IIS is a hint for a repair prompt, never a verdict
            return None

    def after(args, kwargs, result, error):
        if error is not None:
            return _error(error)
        h = args[0]
        st = status_of(h)
        obj = info_of(h).objective_function_value if st == S.kOptimal else None
        return table.get(st, "other"), name_of(h, st), obj, iis_of(h) if st == S.kInfeasible else None

    for name in ("run", "solve"):
        cls_fn = getattr(cls, name)
        setattr(cls, name, _traced("highspy", name, cls_fn, after))


def _patch_gurobipy(mod) -> None:
    GRB, get = mod.GRB, mod.Model.getAttr
    table = {GRB.OPTIMAL: "optimal", GRB.INFEASIBLE: "infeasible", GRB.UNBOUNDED: "unbounded",
             GRB.INF_OR_UNBD: "infeasible_or_unbounded", GRB.TIME_LIMIT: "limit", GRB.ITERATION_LIMIT: "limit",
             GRB.NODE_LIMIT: "limit", GRB.SOLUTION_LIMIT: "limit"}

    compute_iis = mod.Model.computeIIS

    def iis_of(m) -> dict | None:
        if not OPTIONS["iis"]:
            return None
        try:
            compute_iis(m)
            return {"constraints": [c.ConstrName for c in m.getConstrs() if c.IISConstr][:MAX_IIS],
                    "bounds": [v.VarName for v in m.getVars() if v.IISLB or v.IISUB][:MAX_IIS]}
        except Exception:  # noqa: BLE001 - an IIS is a hint for a repair prompt, never a verdict
            return None

    def after(args, kwargs, result, error):
        if error is not None:
            return _error(error)
        st = get(args[0], "Status")
        return (table.get(st, "other"), st, get(args[0], "ObjVal") if st == GRB.OPTIMAL else None,
                iis_of(args[0]) if st == GRB.INFEASIBLE else None)

    mod.Model.optimize = _traced("gurobipy", "optimize", mod.Model.optimize, after)


def _patch_coptpy(mod) -> None:
    C = mod.COPT
    table = {C.OPTIMAL: "optimal", C.INFEASIBLE: "infeasible", C.UNBOUNDED: "unbounded",
             C.INF_OR_UNB: "infeasible_or_unbounded", C.TIMEOUT: "limit", C.NODELIMIT: "limit"}
    get = mod.Model.getAttr

    def after(args, kwargs, result, error):
        if error is not None:
            return _error(error)
        st = get(args[0], "Status") if get(args[0], "IsMIP") else get(args[0], "LpStatus")
        obj = None
        if st == C.OPTIMAL:
            obj = get(args[0], "BestObj") if get(args[0], "IsMIP") else get(args[0], "LpObjval")
        return table.get(st, "other"), st, obj

    for name in ("solve", "solveLP"):
        if hasattr(mod.Model, name):
            setattr(mod.Model, name, _traced("coptpy", name, getattr(mod.Model, name), after))


def _patch_pulp(mod) -> None:
    value = mod.LpAffineExpression.value
    table = {1: "optimal", -1: "infeasible", -2: "unbounded"}

    def after(args, kwargs, result, error):
        if error is not None:
            return _error(error)
        prob = args[0]
        st = prob.status
        sol = getattr(prob, "sol_status", None)
        status = table.get(st, "other")
        if status == "optimal" and sol not in (None, 1):  # pulp says "Optimal" for a MIP stopped early
            status = "limit"
        obj = value(prob.objective) if status == "optimal" and prob.objective is not None else None
        if status == "optimal" and obj is None:
            obj = 0.0  # an objective-free (feasibility) problem
        return status, mod.LpStatus.get(st, st), obj

    mod.LpProblem.solve = _traced("pulp", "solve", mod.LpProblem.solve, after)


def _patch_pyomo(mod) -> None:
    factory_call = mod.SolverFactoryClass.__call__

    def pyomo_after(args, kwargs, result, error):
        if error is not None:
            return _error(error)
        tc = None
        solver = getattr(result, "solver", None)
        if solver is not None:
            tc = getattr(solver, "termination_condition", None)
        if tc is None:
            tc = getattr(result, "termination_condition", None)
        name = str(getattr(tc, "name", tc)).lower()
        if name in ("optimal", "globallyoptimal", "locallyoptimal", "convergencecriteriasatisfied"):
            status = "optimal"
        elif name in ("infeasible", "provenonfeasible", "proveninfeasible", "locallyinfeasible"):
            status = "infeasible"
        elif name == "unbounded":
            status = "unbounded"
        elif name in ("infeasibleorunbounded",):
            status = "infeasible_or_unbounded"
        elif "limit" in name:
            status = "limit"
        else:
            status = "other"
        obj = None
        if status == "optimal":
            obj = getattr(result, "incumbent_objective", None)
            problem = getattr(result, "problem", None)
            if obj is None and problem is not None:
                p = problem[0] if hasattr(problem, "__getitem__") and not hasattr(problem, "sense") else problem
                sense = str(getattr(p, "sense", "minimize")).lower()
                bound = p.upper_bound if "min" in sense else p.lower_bound
                if bound is not None and math.isfinite(float(bound)):
                    obj = float(bound)
            if obj is None and args[1:]:
                import pyomo.environ as pyo

                objs = list(args[1].component_data_objects(pyo.Objective, active=True))
                obj = pyo.value(objs[0]) if len(objs) == 1 else None
        return status, tc, obj

    def call(self, *args, **kwargs):
        solver = factory_call(self, *args, **kwargs)
        solve = getattr(solver, "solve", None)
        if solve is not None and not getattr(solve, "_trex_traced", False):
            traced = _traced("pyomo", "solve", lambda *a, **k: solve(*a, **k), lambda a, k, r, e: pyomo_after((solver,) + a, k, r, e))
            traced._trex_traced = True
            try:
                solver.solve = traced
            except (AttributeError, TypeError):
                pass
        return solver

    mod.SolverFactoryClass.__call__ = call


def _patch_scipy(mod) -> None:
    def make(name, table):
        def after(args, kwargs, result, error):
            if error is not None:
                return _error(error)
            st = int(getattr(result, "status", -1))
            status = table.get(st, "other")
            if name == "minimize":
                status = "optimal" if getattr(result, "success", False) else "other"
            return status, st, getattr(result, "fun", None) if status == "optimal" else None

        return after

    lp = {0: "optimal", 1: "limit", 2: "infeasible", 3: "unbounded"}
    for name in ("linprog", "milp", "minimize"):
        fn = getattr(mod, name, None)
        if fn is not None:
            setattr(mod, name, _traced("scipy", name, fn, make(name, lp)))


def _patch_pywraplp(mod) -> None:
    S = mod.Solver
    table = {S.OPTIMAL: "optimal", S.INFEASIBLE: "infeasible", S.UNBOUNDED: "unbounded", S.FEASIBLE: "limit"}
    objective = S.Objective

    def after(args, kwargs, result, error):
        if error is not None:
            return _error(error)
        return table.get(result, "other"), result, objective(args[0]).Value() if result == S.OPTIMAL else None

    S.Solve = _traced("ortools", "Solve", S.Solve, after)


def _patch_cp_model(mod) -> None:
    cls = mod.CpSolver
    table = {mod.OPTIMAL: "optimal", mod.INFEASIBLE: "infeasible", mod.FEASIBLE: "limit"}
    objective = cls.objective_value.fget if isinstance(getattr(cls, "objective_value", None), property) else None

    def after(args, kwargs, result, error):
        if error is not None:
            return _error(error)
        obj = None
        if result == mod.OPTIMAL:
            obj = objective(args[0]) if objective else args[0].ObjectiveValue()
        return table.get(result, "other"), result, obj

    for name in ("solve", "Solve"):
        if hasattr(cls, name):
            setattr(cls, name, _traced("ortools-cp", name, getattr(cls, name), after))


PATCHES = {
    "highspy": _patch_highspy,
    "gurobipy": _patch_gurobipy,
    "coptpy": _patch_coptpy,
    "pulp": _patch_pulp,
    "pyomo.opt.base.solvers": _patch_pyomo,
    "scipy.optimize": _patch_scipy,
    "ortools.linear_solver.pywraplp": _patch_pywraplp,
    "ortools.sat.python.cp_model": _patch_cp_model,
}


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, inner, patch):
        self._inner, self._patch = inner, patch

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        self._inner.exec_module(module)
        try:
            self._patch(module)
        except Exception as e:  # noqa: BLE001 - an unknown solver version must not break the program
            _record(module.__name__, "instrument", "error", f"instrumentation failed: {e}", None)

    def __getattr__(self, name):
        return getattr(self._inner, name)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        # another finder that asks every finder (pyomo's deferred-import finder does) calls back into this
        # one: answer None inside our own search instead of recursing without end
        if name not in PATCHES or getattr(_STATE, "finding", None) == name:
            return None
        _STATE.finding = name
        try:
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(name, path, target)
                if spec is not None and spec.loader is not None:
                    if not isinstance(spec.loader, _PatchingLoader):
                        spec.loader = _PatchingLoader(spec.loader, PATCHES[name])
                    return spec
            return None
        finally:
            _STATE.finding = None


def install() -> None:
    """Instrument the solver modules when they are imported (call before any of them is imported)."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
