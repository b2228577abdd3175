"""The parent's side of the side-effect audit: what it allows, and what a program's signed record says.

The record itself is made inside the sandbox by :mod:`eval._audit_hook` (in each program's process) and by
:mod:`eval._sandbox_worker` (its checks from outside); :mod:`eval.sandbox` verifies the signatures and hands the
records here. docs/eval.md ("Side-effect audit") says what is caught where.
"""

from __future__ import annotations

import functools
import glob
import importlib.util
import os

from eval.bwrap import ro_paths

# the packages whose shared libraries a program may load through ctypes (pulp loads HiGHS that way)
SOLVER_PACKAGES = ("highspy", "pulp", "pyomo", "ortools", "gurobipy", "coptpy", "scipy", "numpy")
# the executables a program may start: solver binaries shipped in those packages (glob below each package)
SOLVER_BINARIES = {"pulp": ("solverdir/cbc/*/*/cbc",)}


@functools.lru_cache(maxsize=None)
def audit_policy() -> dict[str, list[str]]:
    """What the side-effect audit (:mod:`eval._audit_hook`) allows: ``binaries`` (the solver executables of
    :data:`SOLVER_BINARIES`), ``libraries`` (the directories of :data:`SOLVER_PACKAGES` and their vendored
    ``<name>.libs``), ``native`` (where C extensions may be imported from: the interpreter's read-only prefixes).
    Real paths, the same inside the sandbox (its binds keep them)."""
    libraries, binaries = [], []
    for name in SOLVER_PACKAGES:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        for loc in (spec.submodule_search_locations or []) if spec else []:
            loc = os.path.realpath(loc)
            libraries += [d for d in (loc, loc + ".libs") if os.path.isdir(d)]
            binaries += [os.path.realpath(b) for pat in SOLVER_BINARIES.get(name, ()) for b in glob.glob(f"{loc}/{pat}")]
    return {"binaries": sorted(set(binaries)), "libraries": sorted(set(libraries)),
            "native": sorted({os.path.realpath(p) for p in ro_paths()})}


# what ended the program on our side: its audit record stops there, intact (not "incomplete")
OUR_KILLS = ("timeout", "cpu_limit", "output_limit")


def audit_of(rep: dict, audit: list[dict | None], status: str) -> tuple[list[dict], dict]:
    """The side effects of one program: the audit hook's signed records, then what the worker found outside it
    (``sandbox.file``, ``sandbox.process``), then ``audit.incomplete`` when the record cannot be trusted to be
    whole -- its sequence has a gap, it was cut (a flood past the worker's buffer), or, unless one of our limits
    stopped the program (:data:`OUR_KILLS`), it was killed by a signal (the hook kills a program whose record
    cannot be delivered) or ended without the seal as its last record (``os._exit``: no worker epilogue)."""
    recs = sorted((r for r in audit if r is not None and r.get("kind") == "audit"), key=lambda r: r.get("seq", 0))
    effects: dict[tuple[str, str], dict] = {}
    for r in recs:
        if r.get("event") != "audit.seal":
            k = (str(r.get("event")), str(r.get("detail", "")))
            effects.setdefault(k, {"event": k[0], "detail": k[1], "by": "audit"})
    for f in rep.get("found") or []:
        k = (f["event"], f["detail"])
        effects.setdefault(k, {"event": f["event"], "detail": f["detail"], "by": "sandbox"})
    seqs = [r.get("seq") for r in recs]
    sealed = bool(recs) and recs[-1].get("event") == "audit.seal"
    why = None
    if seqs != list(range(1, len(seqs) + 1)):
        why = "a gap in the record's sequence"
    elif rep.get("records_truncated"):
        why = "the record channel was flooded past the worker's buffer"
    elif status not in OUR_KILLS and rep.get("signal"):
        why = f"the program was killed (signal {rep.get('signal')}) before the worker's epilogue"
    elif status not in OUR_KILLS and not sealed:
        why = "the program ended without the worker's epilogue (no seal)"
    counts = (recs[-1].get("counts") or {}) if sealed else {}
    if why:
        effects[("audit.incomplete", why)] = {"event": "audit.incomplete", "detail": why, "by": "worker"}
    return list(effects.values()), {"complete": why is None, "sealed": sealed, "records": len(recs),
                                    "counts": counts, "why": why}


def side_effect_kinds(res) -> list[str]:
    """The distinct kinds of side effect a program had (``socket.connect``, ``open.write``, ...), first seen first."""
    effects = res.side_effects if hasattr(res, "side_effects") else (res.get("side_effects") or [])
    return list(dict.fromkeys(e["event"] for e in effects))


def side_effect_detail(res, n: int = 5) -> str:
    """The first ``n`` side effects as ``event detail`` (for rejection records and messages)."""
    return "; ".join(f"{e['event']} {e['detail'][:200]}".strip() for e in res.side_effects[:n])
