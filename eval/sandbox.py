"""Run untrusted programs — every one T-Rex executes — in one sandbox, judged by solver-attested results.

One execution path: model completions, curated reference programs, ingested seed programs and
``trex eval exec`` all go through :func:`run_programs` (:func:`run_program` is a batch of one). A batch runs in
one sandbox: :mod:`eval._sandbox_worker` starts inside it, pre-imports the solver libraries with the
attestation hooks in place, and forks one child per program (its own session, rlimits, working directory,
stdout/stderr files and signed-record pipe); after each program every other process of the sandbox is
killed and its writable directories are emptied, so nothing of one program is alive or on disk when the
next one starts. Batching amortises the sandbox start and the solver imports (about 1 s with Pyomo).

Isolation (the level used is recorded in every result; a level weaker than configured is an error):

- ``bwrap``: bubblewrap with new network, PID, IPC, UTS and cgroup namespaces and a fresh mount namespace
  holding only a read-only view of ``/usr`` and the interpreter's prefixes (wherever they live: under
  ``/tmp``, ``/home`` or a read-only prefix), ``/proc`` of the new PID namespace, a minimal ``/dev``, and
  size-limited private ``/tmp``, ``/dev/shm`` and working directory ``/sandbox``. As root the worker drops
  to a per-batch unprivileged uid (``setpriv``), so the process limit applies and root-only files stay
  closed; otherwise a user namespace maps it to ``nobody``.
- ``rlimits``: rlimits only — refused unless explicitly allowed (``allow_unisolated=True`` or
  ``TREX_ALLOW_UNISOLATED=1``), because the program can then reach the network and the user's files.

There is no ``unshare`` fallback: a network namespace alone gave the program the host's ``/tmp`` and
``/var/tmp`` to write into, which is not a sandbox. ``auto`` means bubblewrap (the only sandbox level);
when it does not work the error says why (the probe's own message).

Every program gets rlimits (CPU seconds, address space beyond the warm interpreter's, file size — which
also bounds stdout/stderr — open files, no core dumps) and a wall-clock timeout; where the cgroup
filesystem is writable a per-batch ``pids`` cgroup caps fork bombs.

Attestation: :mod:`eval._attest_boot` records every completed solve through gurobipy, coptpy, pyomo,
pulp, highspy, ortools and scipy.optimize as HMAC-signed lines on the program's private pipe. The
result's ``objective``/``reported`` come from the **last signed solve**; what the program printed is kept
only as ``printed_objective``/``printed_status`` (a diagnostic, never a verdict).
"""

from __future__ import annotations

import base64
import functools
import hashlib
import hmac
import json
import os
import queue
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

from eval.audit import audit_of, audit_policy, side_effect_kinds
from eval.bwrap import (AUDIT, BOOT, INNER, WORKER, PidsCgroup, bwrap_candidates, clean_env, command_prefix,
                        drop_privileges, namespace_diagnosis, next_uid, preexec)
from eval.extract import parse_printed_objective, parse_printed_status

LEVELS = ("bwrap", "rlimits")
DEFAULT_PRELOAD = ("numpy", "highspy")
API_MODULES = {"highspy": "highspy", "pyomo": "pyomo.environ", "gurobipy": "gurobipy"}


def preload_for(apis) -> tuple[str, ...]:
    """The modules to pre-import for programs written against ``apis`` (unknown names are skipped)."""
    return ("numpy", *dict.fromkeys(API_MODULES[a] for a in apis if a in API_MODULES))


# what seed programs and model outputs may import (every API T-Rex renders): pre-imported once per batch
SOLVER_PRELOAD = preload_for(API_MODULES)


class SandboxUnavailable(RuntimeError):
    """No isolation level that the caller allowed works on this machine."""


@dataclass
class ExecResult:
    status: str  # ok | no_solve | error | timeout | cpu_limit | memory_limit | output_limit | killed
    objective: float | None  # from the last attested solve (optimal only)
    reported: str | None  # the last attested solve's status: optimal | infeasible | unbounded | ...
    returncode: int | None
    seconds: float
    isolation: str
    stdout_tail: str = ""
    stderr_tail: str = ""
    solver: str | None = None
    solves: int = 0  # attested solves
    rejected_records: int = 0  # lines on the side channel without a valid signature
    printed_objective: float | None = None  # diagnostics only
    printed_status: str | None = None
    attested: dict | None = None
    limits: dict = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)  # output files collected (``collect=``), signed
    side_effects: list[dict] = field(default_factory=list)  # [{"event", "detail", "by"}]: see _audit_of
    audit: dict = field(default_factory=dict)  # {"complete", "sealed", "records", "counts", "why"}

    def to_dict(self) -> dict:
        return asdict(self)


# ------------------------------------------------------------------------------------------ detection
def _probe(cmd: list[str]) -> str | None:
    """None when ``cmd`` succeeds, else why it failed (its own words)."""
    try:
        r = subprocess.run(cmd, capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        return f"{type(e).__name__}: {e}"
    if r.returncode == 0:
        return None
    return (r.stderr or r.stdout).decode(errors="replace").strip()[-500:] or f"exit {r.returncode}"


@functools.lru_cache(maxsize=None)
def bwrap_info() -> dict:
    """Which bubblewrap runs the sandbox here: ``{"path", "source" (system | bundled | TREX_BWRAP), "version",
    "not_used": {source: why}, "error"}`` (``path`` None and ``error`` the reason when none works).

    Each candidate (:func:`eval.bwrap.bwrap_candidates`: the system's, then the bundled one) is probed with the
    exact command line the sandbox uses, starting this interpreter; the first that works is used."""
    not_used: dict[str, str] = {}
    for source, path, missing in bwrap_candidates():
        if path is None:
            not_used[source] = missing
            continue
        why = _probe(command_prefix(bwrap=path) + drop_privileges(next_uid()) + [sys.executable, "-I", "-c", "pass"])
        if why is None:
            version = subprocess.run([path, "--version"], capture_output=True, text=True).stdout.strip()
            return {"path": path, "source": source, "version": version, "not_used": not_used, "error": None}
        not_used[source] = f"{path} does not start the interpreter {sys.executable} in its namespaces: {why}"
    if any(" does not start " in w for w in not_used.values()):
        error = ("no bubblewrap can create the sandbox's namespaces here ("
                 + "; ".join(f"{k}: {v}" for k, v in not_used.items()) + f"). Likely cause: {namespace_diagnosis()}")
    else:
        error = "no bubblewrap found (" + "; ".join(f"{k}: {v}" for k, v in not_used.items()) + ")"
    return {"path": None, "source": None, "version": None, "not_used": not_used, "error": error}


def probe() -> dict[str, str | None]:
    """Each sandbox level -> None when it works here, else the reason it does not."""
    return {"bwrap": bwrap_info()["error"], "rlimits": None}


def describe_sandbox() -> dict[str, str]:
    """The sandbox as MLflow tags: which bwrap runs it and why the other was not used."""
    info = bwrap_info()
    if info["path"] is None:
        return {"sandbox_bwrap": "none", "sandbox_bwrap_error": info["error"][:4000]}
    out = {"sandbox_bwrap": f"{info['source']}: {info['path']} ({info['version']})"}
    if info["not_used"]:
        out["sandbox_bwrap_not_used"] = "; ".join(f"{k}: {v}" for k, v in info["not_used"].items())[:4000]
    return out


def require_sandbox(cfg, data: bool = False, evaluate: bool = False) -> dict[str, str]:
    """Check, before any stage runs, that the sandbox a run of ``cfg`` (a ``TrexConfig``) needs works here:
    curation's (``data``: when it verifies programs or ingests seeds) and evaluation's (``evaluate``). Raises
    :class:`SandboxUnavailable` -- one message naming the cause and the fix -- when one cannot run. Returns the
    tags that name the bubblewrap running it (:func:`describe_sandbox`; none when nothing needs it)."""
    settings = []
    if data and (cfg.data.verify_programs or cfg.data.seeds):
        settings.append((cfg.data.isolation, cfg.data.allow_unisolated, "data.isolation"))
    if evaluate:
        settings.append((cfg.eval.isolation, cfg.eval.allow_unisolated, "eval.isolation"))
    for isolation, allow, setting in settings:
        isolation_level(isolation, allow, setting)
    if not settings:
        return {}
    return describe_sandbox() if any(iso != "rlimits" for iso, _, _ in settings) else {"sandbox_bwrap": "unused"}


def _allowed_unisolated(allow: bool | None) -> bool:
    return bool(allow) or os.environ.get("TREX_ALLOW_UNISOLATED", "") in ("1", "true", "yes")


def isolation_level(prefer: str = "auto", allow_unisolated: bool | None = None,
                    setting: str = "eval.isolation") -> str:
    """The level a run uses: ``prefer`` (``auto`` = bubblewrap), never silently a weaker one.

    ``setting`` names the config key in the error (``eval.isolation``, ``data.isolation``).
    """
    if prefer not in ("auto", *LEVELS):
        raise ValueError(f"{setting}: unknown isolation {prefer!r}: choose auto, {', '.join(LEVELS)}"
                         + (" ('netns' was removed: it gave no private filesystem)" if prefer == "netns" else ""))
    level = "bwrap" if prefer == "auto" else prefer
    why = probe()[level]
    if why:
        raise SandboxUnavailable(
            f"{setting}={prefer}: {why}. Untrusted programs run only in the sandbox; to run them with rlimits "
            "only (no isolation: the program can reach the network and your files) set "
            f"{setting}=rlimits and {setting.rsplit('.', 1)[0]}.allow_unisolated=true")
    if level == "rlimits" and not _allowed_unisolated(allow_unisolated):
        raise SandboxUnavailable(
            f"{setting}=rlimits runs untrusted code without isolation; it needs "
            f"{setting.rsplit('.', 1)[0]}.allow_unisolated=true (or TREX_ALLOW_UNISOLATED=1)")
    return level


def _verify(lines: list[str], key: bytes) -> list[dict | None]:
    """The signed records of one program (None for a line without a valid signature)."""
    out: list[dict | None] = []
    for line in lines:
        body, _, mac = line.encode().rpartition(b"\t")
        good = hmac.new(key, body, hashlib.sha256).hexdigest().encode()
        if body and hmac.compare_digest(mac, good):
            try:
                out.append(json.loads(body))
                continue
            except ValueError:
                pass
        out.append(None)
    return out


@dataclass
class Program:
    """One untrusted program with its data files (plain names in its working directory)."""
    code: str
    files: dict[str, bytes | str] = field(default_factory=dict)

    @classmethod
    def of(cls, item: "str | dict | Program") -> "Program":
        if isinstance(item, Program):
            return item
        if isinstance(item, str):
            return cls(item)
        return cls(item["code"], dict(item.get("files") or {}))

    def payload(self) -> dict:
        files = {}
        for name, blob in self.files.items():
            if os.path.basename(name) != name or name.startswith(".") or name == "program.py":
                raise ValueError(f"data file name {name!r}: plain file names only")
            files[name] = base64.b64encode(blob.encode() if isinstance(blob, str) else blob).decode()
        return {"code": self.code, "files": files}


@dataclass
class _Limits:
    timeout_s: float
    memory_mb: int
    fsize_mb: int
    nproc: int
    collect: tuple[str, ...]
    preload: tuple[str, ...]
    iis: bool = False


def run_programs(programs: list, timeout_s: float = 20.0, memory_mb: int = 2048, isolation: str = "auto",
                 allow_unisolated: bool | None = None, fsize_mb: int = 64, nproc: int = 256,
                 collect: tuple[str, ...] = (), preload: tuple[str, ...] = DEFAULT_PRELOAD,
                 workers: int = 1, batch_size: int = 64, setting: str = "eval.isolation",
                 iis: bool = False) -> list[ExecResult]:
    """Execute untrusted programs in the sandbox, ``batch_size`` per sandbox, ``workers`` sandboxes at once.

    ``programs``: code strings, ``{"code", "files"}`` dicts or :class:`Program`. Each program is judged by
    its last attested solve (see the module docstring); ``timeout_s`` and ``memory_mb`` apply to each
    program. ``collect`` names output files returned in ``result.files``; ``preload`` modules are imported
    once per sandbox (with the attestation hooks in place) before the programs run. ``iis``: an infeasible solve
    (highspy, gurobipy) also names an irreducible infeasible subsystem in its record (``attested["iis"]``: for a
    repair prompt; it costs a second solve). Results keep the order of ``programs``.
    """
    level = isolation_level(isolation, allow_unisolated, setting)
    progs = [Program.of(p).payload() for p in programs]
    limits = _Limits(timeout_s, memory_mb, fsize_mb, nproc, tuple(os.path.basename(c) for c in collect),
                     tuple(preload), iis)
    chunks = [list(range(i, min(i + batch_size, len(progs)))) for i in range(0, len(progs), max(1, batch_size))]
    results: list[ExecResult | None] = [None] * len(progs)

    def run_chunk(idx: list[int]) -> None:
        while idx:  # a sandbox that ends early (a program killed its worker) leaves the rest to a fresh one
            done = _run_sandbox(level, [progs[i] for i in idx], limits)
            for i, res in zip(idx, done):
                results[i] = res
            idx = idx[len(done):]

    if len(chunks) <= 1 or workers <= 1:
        for c in chunks:
            run_chunk(c)
    else:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            list(pool.map(run_chunk, chunks))
    return results  # type: ignore[return-value]


def run_program(code: str, timeout_s: float = 20.0, memory_mb: int = 2048, files: dict | None = None,
                isolation: str = "auto", allow_unisolated: bool | None = None, fsize_mb: int = 64,
                nproc: int = 256, collect: tuple[str, ...] = (), preload: tuple[str, ...] = (),
                setting: str = "eval.isolation") -> ExecResult:
    """Execute one untrusted program (a batch of one: the same path as every other program).

    Nothing is pre-imported by default: a single program imports what it uses, once either way."""
    return run_programs([Program(code, dict(files or {}))], timeout_s, memory_mb, isolation, allow_unisolated,
                        fsize_mb, nproc, collect, preload, setting=setting)[0]


def _run_sandbox(level: str, progs: list[dict], lim: _Limits) -> list[ExecResult]:
    """One sandbox running ``progs`` in order. Returns a result for a prefix of them (at least one)."""
    key, audit_key = secrets.token_bytes(32), secrets.token_bytes(32)
    uid = next_uid()
    grace = 10.0
    with tempfile.TemporaryDirectory(prefix="trex-sandbox-") as host:
        os.chmod(host, 0o755)
        err_path = os.path.join(host, "worker.stderr")
        if level == "bwrap":
            argv = (command_prefix(fsize_mb=lim.fsize_mb, bwrap=bwrap_info()["path"]) + drop_privileges(uid)
                    + [sys.executable, "-I", f"{INNER}/worker.py", f"{INNER}/attest_boot.py", f"{INNER}/audit_hook.py",
                       "/sandbox"])
            cwd, inner = host, "/sandbox"
        else:  # rlimits: explicitly allowed, no isolation
            wd = os.path.join(host, "work")
            os.mkdir(wd)
            os.chmod(wd, 0o1777)
            argv = drop_privileges(uid) + [sys.executable, "-I", str(WORKER), str(BOOT), str(AUDIT), wd]
            cwd, inner = wd, wd
        job = {"preload": list(lim.preload), "collect": list(lim.collect), "private": level == "bwrap",
               "limits": {"timeout_s": lim.timeout_s, "memory_mb": lim.memory_mb, "fsize_mb": lim.fsize_mb},
               "audit": audit_policy(), "iis": lim.iis, "programs": progs}
        cgroup = PidsCgroup(lim.nproc)
        lines: queue.Queue = queue.Queue()
        reports: list[dict] = []
        try:
            with open(err_path, "wb") as err:
                proc = subprocess.Popen(argv, cwd=cwd, env=clean_env(inner), stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=err,
                                        preexec_fn=preexec(lim.fsize_mb, lim.nproc, cgroup))
            reader = threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout] + [lines.put(None)],
                                      daemon=True)
            reader.start()
            try:
                proc.stdin.write(key.hex().encode() + b"\n" + audit_key.hex().encode() + b"\n"
                                 + json.dumps(job).encode())
                proc.stdin.close()
            except OSError:
                pass
            ready = _next_line(lines, 120.0)
            if ready is None or "ready" not in ready:
                _kill_tree(proc)
                raise RuntimeError(f"the {level} sandbox did not start: {_tail(err_path)[-800:]}")
            t_last = time.perf_counter()
            while len(reports) < len(progs):
                rep = _next_line(lines, lim.timeout_s + grace)
                if rep is None:  # the worker died or stopped answering while running this program
                    stalled = time.perf_counter() - t_last >= lim.timeout_s
                    reports.append({"rc": None, "signal": signal.SIGKILL, "timed_out": stalled,
                                    "seconds": time.perf_counter() - t_last, "stdout": "",
                                    "stderr": "the sandbox ended while this program ran", "out_size": 0,
                                    "records": [], "worker_lost": True})
                    break
                reports.append(rep)
                t_last = time.perf_counter()
            _kill_tree(proc)
        finally:
            cgroup.close()
    results = []
    for rep in reports:
        results.append(_classify(rep, _verify(rep["records"], key), _verify(rep["records"], audit_key), level,
                                 {"timeout_s": lim.timeout_s, "memory_mb": lim.memory_mb, "fsize_mb": lim.fsize_mb,
                                  "nproc": lim.nproc, "pids_cgroup": cgroup.used}))
    return results


def _next_line(lines: queue.Queue, timeout: float) -> dict | None:
    try:
        line = lines.get(timeout=timeout)
    except queue.Empty:
        return None
    if line is None:
        return None
    try:
        return json.loads(line)
    except ValueError:
        return None


def _tail(path: str, n: int = 4000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - n))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def _kill_tree(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _classify(rep: dict, records: list, audit: list, level: str, limits: dict) -> ExecResult:
    good = [r for r in records if r is not None and r.get("kind", "solve") == "solve"]
    files = {r["name"]: r["text"] for r in records if r is not None and r.get("kind") == "file"}
    last = good[-1] if good else None
    rc, sig, stderr, stdout = rep["rc"], rep["signal"], rep["stderr"], rep["stdout"]
    if rep["timed_out"]:
        status = "timeout"
    elif sig == signal.SIGXCPU:
        status = "cpu_limit"
    elif (sig == signal.SIGXFSZ or rep["out_size"] >= limits["fsize_mb"] * 1024 * 1024
          or "[Errno 27] File too large" in stderr):
        status = "output_limit"
    elif "MemoryError" in stderr or "std::bad_alloc" in stderr:
        status = "memory_limit"
    elif sig is not None:
        status = "killed"
    elif rc != 0:
        status = "error"
    else:
        status = "ok" if last is not None else "no_solve"
    side_effects, audited = audit_of(rep, audit, status)
    return ExecResult(
        status=status, objective=last["objective"] if last and last["status"] == "optimal" else None,
        reported=last["status"] if last else None, returncode=rc, seconds=rep["seconds"], isolation=level,
        stdout_tail=stdout[-2000:], stderr_tail=stderr[-2000:], solver=last["solver"] if last else None,
        solves=len(good), rejected_records=sum(r is None and a is None for r, a in zip(records, audit)),
        files=files, printed_objective=parse_printed_objective(stdout), printed_status=parse_printed_status(stdout),
        attested=last, limits=limits, side_effects=side_effects, audit=audited)


def rejection_reason(res: ExecResult, correct: bool) -> str | None:
    """Why an executed program is not accepted as verified (None when it is): one vocabulary for every caller.

    ``side-effect: <kind>`` first (a program with any recorded side effect never teaches the model, whatever it
    solved: :func:`side_effect_kinds`), then ``program_printed_without_solve`` (it printed an objective but no
    solver ever attested one), ``program_mismatch`` (the attested solve reached something else),
    ``program_timeout``, ``program_error`` (exit status or exception), ``program_no_solve`` (nothing solved,
    nothing printed), ``program_<limit>`` for the resource limits.
    """
    kinds = side_effect_kinds(res)
    if kinds:
        return f"side-effect: {kinds[0]}"
    if res.status == "ok":
        return None if correct else "program_mismatch"
    if res.status == "no_solve":
        printed = res.printed_objective is not None or res.printed_status is not None
        return "program_printed_without_solve" if printed else "program_no_solve"
    return f"program_{res.status}"
