"""Run untrusted solver programs in separate processes with time, memory and file-size limits.

Each program runs in a fresh interpreter (``python -I``) in a private temporary directory, with
rlimits on CPU time, address space, written file size and open files, a wall-clock timeout that kills
its whole process group, and no network when ``unshare -n`` is available. The isolation level used
is reported with every result. (Bubblewrap isolation and solver attestation extend this module.)
"""

from __future__ import annotations

import functools
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from eval.extract import parse_printed_objective, parse_printed_status

BATCH_WORKER = Path(__file__).with_name("_batch_worker.py")


@dataclass
class ExecResult:
    status: str  # "ok" | "error" | "timeout" | "no_objective"
    objective: float | None
    reported: str | None  # "optimal" | "infeasible" | "unbounded" | "infeasible_or_unbounded" | None
    returncode: int | None
    seconds: float
    isolation: str
    stdout_tail: str = ""
    stderr_tail: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


@functools.lru_cache(maxsize=1)
def isolation_level() -> str:
    """'netns' when ``unshare -n`` works here (no network for the program), else 'rlimits'."""
    unshare = shutil.which("unshare")
    if unshare:
        for args in ([unshare, "-n", "true"], [unshare, "-rn", "true"]):
            try:
                if subprocess.run(args, capture_output=True, timeout=5).returncode == 0:
                    return "netns" if args[1] == "-n" else "netns-user"
            except (OSError, subprocess.SubprocessError):
                pass
    return "rlimits"


def _prefix() -> list[str]:
    level = isolation_level()
    if level == "netns":
        return ["unshare", "-n"]
    if level == "netns-user":
        return ["unshare", "-rn"]
    return []


def _limits(cpu_s: float, memory_mb: int, fsize_mb: int = 64):
    def apply() -> None:
        os.setsid()
        cpu = max(1, int(cpu_s) + 1)
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        mem = memory_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
        fs = fsize_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_FSIZE, (fs, fs))
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    return apply


def _clean_env(workdir: str) -> dict[str, str]:
    keep = {k: os.environ[k] for k in ("PATH", "LANG", "LC_ALL", "OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE") if k in os.environ}
    keep.update({"HOME": workdir, "TMPDIR": workdir, "PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1"})
    return keep


def _run(cmd: list[str], stdin: str | None, timeout_s: float, memory_mb: int, cwd: str) -> tuple[int | None, str, str, float, bool]:
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        _prefix() + cmd,
        cwd=cwd,
        env=_clean_env(cwd),
        stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        preexec_fn=_limits(timeout_s, memory_mb),
        text=True,
        errors="replace",
    )
    timed_out = False
    try:
        out, err = proc.communicate(stdin, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        out, err = proc.communicate()
    return proc.returncode, out or "", err or "", time.perf_counter() - t0, timed_out


def run_program(code: str, timeout_s: float = 20.0, memory_mb: int = 2048, files: dict[str, bytes] | None = None) -> ExecResult:
    """Execute one program in its own sandboxed interpreter and read the optimum it prints."""
    with tempfile.TemporaryDirectory(prefix="trex-exec-") as wd:
        Path(wd, "program.py").write_text(code)
        for name, blob in (files or {}).items():
            Path(wd, name).write_bytes(blob)
        rc, out, err, secs, timed_out = _run([sys.executable, "-I", "program.py"], None, timeout_s, memory_mb, wd)
    obj, reported = None, None
    if timed_out:
        status = "timeout"
    elif rc != 0:
        status = "error"
    else:
        obj, reported = parse_printed_objective(out), parse_printed_status(out)
        status = "ok" if reported is not None else "no_objective"
    return ExecResult(status, obj, reported, rc, secs, isolation_level(), out[-2000:], err[-2000:])


def run_batch(programs: list[str | dict], timeout_s: float = 120.0, memory_mb: int = 4096) -> list[dict]:
    """Execute many trusted-but-unverified programs (reference programs) in one sandboxed process.

    ``programs`` are code strings or ``{"code", "files": {name: text}}``. Each program gets a fresh
    namespace, its own directory with its files and its own captured stdout; returns per program
    ``{"status", "objective", "reported", "error"}``. Used to verify generated reference programs cheaply.
    """
    items = [p if isinstance(p, dict) else {"code": p} for p in programs]
    with tempfile.TemporaryDirectory(prefix="trex-batch-") as wd:
        rc, out, err, _, timed_out = _run(
            [sys.executable, "-I", str(BATCH_WORKER)], json.dumps(items), timeout_s, memory_mb, wd
        )
    if timed_out or rc != 0:
        reason = "timeout" if timed_out else f"worker exit {rc}: {err[-300:]}"
        return [{"status": "error", "objective": None, "reported": None, "error": reason} for _ in items]
    results = json.loads(out.strip().splitlines()[-1])
    for r in results:
        stdout = r.pop("stdout")
        ok = r["status"] == "ok"
        r["objective"] = parse_printed_objective(stdout) if ok else None
        r["reported"] = parse_printed_status(stdout) if ok else None
        if ok and r["reported"] is None:
            r["status"] = "no_objective"
    return results
