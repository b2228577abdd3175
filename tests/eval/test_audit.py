"""The side-effect audit: every kind of effect is recorded (and rejected from training data) even when the program
prints, and attests, the right optimum; plain solver programs record nothing; the record cannot be erased.

All programs of a module run in one batch (one sandbox, as curation runs them): each still in a fresh process.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from eval.audit import audit_policy, side_effect_kinds
from eval.sandbox import SOLVER_PRELOAD, bwrap_info, rejection_reason, run_programs

# a correct attested optimum (42) and the printed number: what a verifier would accept without the audit
SOLVE = ("import highspy\nh = highspy.Highs()\nh.silent()\nx = h.addVariable(lb=0, ub=6)\nh.maximize(7 * x)\n"
         "print('Optimal objective:', h.getInfo().objective_function_value)\n")

# name -> (program, the side-effect kind its rejection names)
EFFECTS = {
    "socket_connect": ("import socket\ns = socket.socket()\ns.settimeout(1)\ntry:\n    s.connect(('10.1.2.3', 80))\n"
                       "except OSError:\n    pass\n", "socket.connect"),
    "socket_bind": ("import socket\ns = socket.socket()\ns.bind(('127.0.0.1', 0))\n", "socket.bind"),
    "udp_sendto": ("import socket\ns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\ntry:\n"
                   "    s.sendto(b'x', ('127.0.0.1', 9))\nexcept OSError:\n    pass\n", "socket.sendto"),
    "dns_lookup": ("import socket\ntry:\n    socket.getaddrinfo('example.org', 443)\nexcept OSError:\n    pass\n",
                   "socket.getaddrinfo"),
    "subprocess_run": ("import subprocess\nsubprocess.run(['true'])\n", "subprocess.Popen"),
    "os_system": ("import os\nos.system('true')\n", "os.system"),
    "os_exec_in_fork": ("import os\npid = os.fork()\nif pid == 0:\n    os.execv('/bin/true', ['true'])\n"
                        "os.waitpid(pid, 0)\n", "os.fork"),
    "posix_spawn": ("import os\npid = os.posix_spawn('/bin/true', ['true'], {})\nos.waitpid(pid, 0)\n",
                    "os.posix_spawn"),
    "raw_fork_exec": ("import _posixsubprocess, os\nr, w = os.pipe()\n"
                      "pid = _posixsubprocess.fork_exec([b'/bin/true'], [b'/bin/true'], True, (), None, None, -1, -1,"
                      " -1, -1, -1, -1, r, w, True, False, -1, None, None, None, -1, None, False)\n"
                      "os.waitpid(pid, 0)\n", "subprocess.fork_exec"),
    "write_tmp": ("open('/tmp/side-effect.txt', 'w').write('x')\n", "open.write"),
    "append_home_parent": ("import os\nopen(os.path.join(os.getcwd(), '..', 'sibling.txt'), 'a').write('x')\n",
                           "open.write"),
    "write_through_symlink": ("import os\nos.symlink('/tmp/target.txt', 'link.txt')\nopen('link.txt', 'w').write('x')\n",
                              "open.write"),
    "remove_outside": ("import os\ntry:\n    os.remove('/tmp/nothing-here')\nexcept OSError:\n    pass\n", "os.remove"),
    "rename_outside": ("import os\ntry:\n    os.rename('/tmp/a', '/tmp/b')\nexcept OSError:\n    pass\n", "os.rename"),
    "mkdir_outside": ("import os\nos.mkdir('/tmp/made-here')\n", "os.mkdir"),
    "ctypes_libc": ("import ctypes\nctypes.CDLL('libc.so.6').getpid()\n", "ctypes.dlsym"),
    "ctypes_self": ("import ctypes\nctypes.CDLL(None)\n", "ctypes.dlopen"),
    "ctypes_memory": ("import ctypes\nctypes.string_at(id(1), 8)\n", "ctypes.string_at"),
    "gc_walk": ("import gc\nlen(gc.get_objects())\n", "gc.get_objects"),
    # native code the hook cannot see: the worker finds what it left (a file HiGHS wrote, a process)
    "native_write": ("import highspy\nh = highspy.Highs()\nh.silent()\nh.addVariable(lb=0, ub=1)\n"
                     "h.writeModel('/tmp/written-by-highs.mps')\n", "sandbox.file"),
    "mkfifo": ("import os\nos.mkfifo('/dev/shm/fifo')\n", "sandbox.file"),
}

# tampering with the record: the hook kills the program, or the record is incomplete
TAMPER = {
    "close_channel": "import os\nos.close(3)\nopen('/tmp/after-close.txt', 'w')\n",
    "dup_over_channel": "import os\nos.dup2(os.open('/dev/null', os.O_WRONLY), 3)\nimport socket\nsocket.socket().bind(('127.0.0.1', 0))\n",
    "exit_without_seal": "import os\nos._exit(0)\n",
    "early_seal_then_close": "import sys, os\nsys.audit('trex.audit.seal')\nos.close(3)\n",
    "flood_channel": "import os\nfor _ in range(1200):\n    os.write(3, b'x' * 4000 + b'\\n')\n",
}

# plain programs of every solver API: no side effect, a complete record
PLAIN = {
    "highspy": SOLVE,
    "pulp_cbc": ("import pulp\np = pulp.LpProblem('a', pulp.LpMaximize)\nx = pulp.LpVariable('x', 0, 5, cat='Integer')\n"
                 "p += 2 * x\np.solve(pulp.PULP_CBC_CMD(msg=0))\n"),
    "pulp_default": ("import pulp\np = pulp.LpProblem('a', pulp.LpMaximize)\nx = pulp.LpVariable('x', 0, 5)\n"
                     "p += 2 * x\np.solve()\n"),
    "pyomo_highs": ("import pyomo.environ as pyo\nm = pyo.ConcreteModel()\nm.x = pyo.Var(bounds=(0, 3), within=pyo.Integers)\n"
                    "m.obj = pyo.Objective(expr=2 * m.x, sense=pyo.maximize)\npyo.SolverFactory('highs').solve(m)\n"
                    "pyo.SolverFactory('appsi_highs').solve(m)\n"),
    "ortools": ("from ortools.linear_solver import pywraplp\ns = pywraplp.Solver.CreateSolver('SCIP')\n"
                "x = s.IntVar(0, 5, 'x')\ns.Maximize(2 * x)\ns.Solve()\nfrom ortools.sat.python import cp_model\n"
                "m = cp_model.CpModel()\ny = m.NewIntVar(0, 5, 'y')\nm.Maximize(2 * y)\ncp_model.CpSolver().Solve(m)\n"),
    "gurobipy": ("import gurobipy as gp\nm = gp.Model()\nm.Params.OutputFlag = 0\nx = m.addVar(ub=2, vtype='I')\n"
                 "m.setObjective(x, gp.GRB.MAXIMIZE)\nm.optimize()\n"),
    "scipy": "from scipy.optimize import linprog\nlinprog([-1], bounds=[(0, 7)])\n",
    "files_in_its_directory": ("import json, os, tempfile\nd = json.load(open('data.json'))\n"
                               "open('out.txt', 'w').write(str(d))\nos.mkdir('sub')\nos.rename('out.txt', 'sub/o.txt')\n"
                               "with tempfile.NamedTemporaryFile('w') as f:\n    f.write('x')\nos.remove('sub/o.txt')\n"
                               "import logging, warnings\nlogging.warning('note')\nwarnings.warn('w')\n" + SOLVE),
}


@pytest.fixture(scope="module")
def ran():
    names = [*EFFECTS, *TAMPER, *PLAIN]
    code = {**{k: v[0] + SOLVE for k, v in EFFECTS.items()}, **{k: SOLVE + v for k, v in TAMPER.items()}, **PLAIN}
    progs = [{"code": code[n], "files": {"data.json": '{"a": 1}'}} for n in names]
    return dict(zip(names, run_programs(progs, timeout_s=30, preload=SOLVER_PRELOAD)))


@pytest.mark.parametrize("name", list(EFFECTS))
def test_a_side_effect_is_recorded_and_rejected_despite_a_correct_attested_optimum(ran, name):
    res, kind = ran[name], EFFECTS[name][1]
    assert res.status == "ok" and res.objective == 42.0, (res.status, res.stderr_tail[-500:])
    assert kind in side_effect_kinds(res), res.side_effects
    assert rejection_reason(res, correct=True).startswith("side-effect: "), res.side_effects
    assert rejection_reason(res, correct=True) == f"side-effect: {side_effect_kinds(res)[0]}"


@pytest.mark.parametrize("name", list(PLAIN))
def test_plain_solver_programs_record_no_side_effect(ran, name):
    res = ran[name]
    assert res.status == "ok" and res.solves >= 1, (res.status, res.stderr_tail[-500:])
    assert res.side_effects == [] and res.audit["complete"] and res.audit["sealed"], (res.side_effects, res.audit)
    assert res.rejected_records == 0


def test_pulp_starts_its_cbc_binary_from_the_documented_list(ran):
    assert any(b.endswith("/cbc") for b in audit_policy()["binaries"])
    assert ran["pulp_cbc"].objective == 10.0 and not ran["pulp_cbc"].side_effects


@pytest.mark.parametrize("name", list(TAMPER))
def test_tampering_with_the_record_leaves_it_incomplete(ran, name):
    res = ran[name]
    assert "audit.incomplete" in side_effect_kinds(res), (res.status, res.side_effects, res.audit)
    assert not res.audit["complete"]
    assert rejection_reason(res, correct=True).startswith("side-effect: ")


def test_an_effect_after_closing_the_channel_never_happens(ran):
    """The hook cannot deliver the record, so it kills the program before the file is opened."""
    res = ran["close_channel"]
    assert res.status == "killed" and "after-close" not in str(res.side_effects)
    assert not any(e["detail"].endswith("after-close.txt") for e in res.side_effects)


def test_patching_os_and_builtins_does_not_silence_the_hook():
    code = ("import builtins, os, json, hmac, posixpath\nos.write = lambda *a: len(a[1])\nos.fstat = None\n"
            "os.kill = None\nos.readlink = None\nos.getcwd = lambda: '/tmp'\njson.dumps = None\nhmac.new = None\n"
            "posixpath.realpath = lambda p, **k: '/sandbox/p0/x'\nbuiltins.isinstance = lambda *a: False\n"
            "builtins.repr = lambda o: ''\nbuiltins.len = lambda o: 0\n"
            "import _socket\ns = _socket.socket()\ns.settimeout(1)\ntry:\n    s.connect(('10.1.2.3', 80))\n"
            "except OSError:\n    pass\nopen('/tmp/patched.txt', 'w')\n")
    res = run_programs([SOLVE + code], preload=SOLVER_PRELOAD)[0]
    assert {"socket.connect", "open.write"} <= set(side_effect_kinds(res)), (res.status, res.side_effects,
                                                                           res.stderr_tail[-400:])


def test_the_audit_runs_without_the_sandbox_too(monkeypatch):
    """rlimits only (explicitly allowed): no worker checks of the host, but the hook records the same."""
    res = run_programs(["import socket\nsocket.socket().bind(('127.0.0.1', 0))\n" + SOLVE, PLAIN["pulp_cbc"]],
                       isolation="rlimits", allow_unisolated=True)
    assert side_effect_kinds(res[0]) == ["socket.bind"] and res[0].isolation == "rlimits"
    assert res[1].side_effects == [] and res[1].audit["complete"]


def test_a_bwrap_is_found_and_named():
    info = bwrap_info()
    assert info["path"] and info["source"] in ("system", "bundled", "TREX_BWRAP"), info
    assert info["version"].startswith("bubblewrap")


def test_without_any_working_bwrap_the_error_names_the_cause_and_the_fix(tmp_path):
    """A bwrap that cannot create namespaces (as under a policy that forbids unprivileged user namespaces): one
    error, naming what each candidate said, the likely cause and a fix."""
    fake = tmp_path / "bwrap"
    fake.write_text("#!/bin/sh\necho 'bwrap: No permissions to create a new namespace' >&2\nexit 1\n")
    fake.chmod(0o755)
    code = ("from eval.sandbox import bwrap_info, probe\nimport json\n"
            "print(json.dumps(bwrap_info()))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "TREX_BWRAP": str(fake)}, cwd=str(tmp_path.parent))
    import json

    info = json.loads(out.stdout.strip().splitlines()[-1])
    assert info["path"] is None
    assert "No permissions to create a new namespace" in info["error"] and "Likely cause" in info["error"]
    assert "fix" in info["error"]
