"""Run untrusted solver programs: one sandboxed process each, judged by solver-attested results.

Isolation (the level used is reported with every result):

- ``bwrap`` (preferred): bubblewrap with new network, PID, IPC and UTS namespaces and a fresh mount
  namespace holding only a read-only view of ``/usr`` (and the interpreter's prefixes), ``/proc`` of the new
  PID namespace, a minimal ``/dev``, a size-limited private ``/tmp`` and a size-limited private working
  directory ``/sandbox`` holding the program and its data files. When run as root the program drops to
  user ``nobody`` (``setpriv``), so the process limit applies and root-only files stay closed.
- ``netns`` (fallback): ``unshare`` with new network + PID namespaces (the whole process tree dies with it);
  the program runs in a private temporary directory, as ``nobody`` when started as root.
- ``rlimits``: rlimits only — refused unless explicitly allowed (``allow_unisolated=True`` or
  ``TREX_ALLOW_UNISOLATED=1``), because the program could then reach the network and the user's files.

Every level applies rlimits (CPU seconds, address space, file size — which also bounds stdout/stderr, which
go to files outside the sandbox — open files, no core dumps), a wall-clock timeout that kills the whole
process tree, and, where the cgroup filesystem is writable, a per-run ``pids`` cgroup (fork bombs).

Attestation: the program runs under :mod:`eval._attest_boot`, which records every completed solve through
gurobipy, coptpy, pyomo, pulp, highspy, ortools and scipy.optimize as HMAC-signed lines on a private pipe.
The result's ``objective``/``reported`` come from the **last signed solve**; what the program printed is
kept only as ``printed_objective``/``printed_status`` (a diagnostic).
"""

from __future__ import annotations

import functools
import json
import os
import resource
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import hmac
import hashlib
from dataclasses import asdict, dataclass, field
from pathlib import Path

from eval.extract import parse_printed_objective, parse_printed_status

BATCH_WORKER = Path(__file__).with_name("_batch_worker.py")
BOOT = Path(__file__).with_name("_attest_boot.py")
NOBODY = 65534
RUN_UIDS = range(61000, 61000 + 4096)  # as root, each run gets its own unprivileged uid (own process count)
_uid_lock = threading.Lock()
_uid_next = [secrets.randbelow(len(RUN_UIDS))]


def _next_uid() -> int:
    with _uid_lock:
        _uid_next[0] = (_uid_next[0] + 1) % len(RUN_UIDS)
        return RUN_UIDS[_uid_next[0]]
LEVELS = ("bwrap", "netns", "rlimits")


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

    def to_dict(self) -> dict:
        return asdict(self)


# ------------------------------------------------------------------------------------------ detection
def _probe(cmd: list[str]) -> bool:
    try:
        return subprocess.run(cmd, capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


@functools.lru_cache(maxsize=None)
def available_levels() -> tuple[str, ...]:
    """The isolation levels that work here, strongest first."""
    levels = []
    with tempfile.TemporaryDirectory(prefix="trex-probe-") as wd:
        if shutil.which("bwrap") and _probe(_bwrap_prefix(wd, {}) + [sys.executable, "-I", "-c", "pass"]):
            levels.append("bwrap")
    if shutil.which("unshare") and _probe(_unshare_prefix() + [sys.executable, "-I", "-c", "pass"]):
        levels.append("netns")
    levels.append("rlimits")
    return tuple(levels)


def _allowed_unisolated(allow: bool | None) -> bool:
    return bool(allow) or os.environ.get("TREX_ALLOW_UNISOLATED", "") in ("1", "true", "yes")


def isolation_level(prefer: str = "auto", allow_unisolated: bool | None = None) -> str:
    """The level a run uses: ``prefer`` (must be available) or the strongest available one."""
    levels = available_levels()
    if prefer != "auto":
        if prefer not in LEVELS:
            raise ValueError(f"unknown isolation {prefer!r}: choose auto, {', '.join(LEVELS)}")
        if prefer not in levels:
            raise SandboxUnavailable(f"isolation {prefer!r} does not work here (available: {', '.join(levels)})")
        level = prefer
    else:
        level = levels[0]
    if level == "rlimits" and not _allowed_unisolated(allow_unisolated):
        raise SandboxUnavailable(
            "neither bubblewrap nor unshare works here; running untrusted code with rlimits only needs "
            "allow_unisolated=True or TREX_ALLOW_UNISOLATED=1 (install the Debian package 'bubblewrap')")
    return level


# --------------------------------------------------------------------------------------------- command
def _as_root() -> bool:
    return os.geteuid() == 0


def _drop(uid: int = NOBODY) -> list[str]:
    """Inside the sandbox, become an unprivileged ``uid`` when we are root (so RLIMIT_NPROC applies to the
    run's own processes and root-only files stay closed)."""
    if _as_root() and shutil.which("setpriv"):
        return ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--"]
    return []


def _ro_paths() -> list[str]:
    """Read-only mounts the interpreter needs: /usr plus the Python prefixes (deduplicated)."""
    paths = {"/usr"}
    for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, os.path.dirname(os.path.realpath(sys.executable))):
        p = os.path.realpath(p)
        if not p.startswith("/usr/"):
            paths.add(p)
    ordered = sorted(paths, key=len)
    return [p for i, p in enumerate(ordered) if not any(p.startswith(q + "/") for q in ordered[:i])]


def _bwrap_prefix(wd: str, files: dict[str, str], tmp_mb: int = 64) -> list[str]:
    cmd = ["bwrap", "--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
           "--die-with-parent", "--new-session", "--hostname", "sandbox"]
    if not _drop():  # not root (or no setpriv): a user namespace maps the program to ``nobody``
        cmd += ["--unshare-user", "--uid", str(NOBODY), "--gid", str(NOBODY)]
    made = set()
    for p in _ro_paths():
        parts = Path(p).parts
        for i in range(2, len(parts)):  # ancestors readable by ``nobody`` (bwrap's default is 0700)
            anc = str(Path(*parts[:i]))
            if anc not in made and anc != "/usr":
                made.add(anc)
                cmd += ["--perms", "0755", "--dir", anc]
        cmd += ["--ro-bind", p, p]
    for link in ("bin", "lib", "lib64", "sbin"):
        if os.path.islink(f"/{link}"):
            cmd += ["--symlink", os.readlink(f"/{link}"), f"/{link}"]
    for etc in ("/etc/ld.so.cache", "/etc/localtime", "/etc/nsswitch.conf"):
        if os.path.exists(etc):
            cmd += ["--ro-bind", etc, etc]
    size = str(tmp_mb * 1024 * 1024)
    cmd += ["--proc", "/proc", "--dev", "/dev", "--size", size, "--tmpfs", "/tmp", "--size", size, "--tmpfs", "/sandbox"]
    cmd += ["--ro-bind", str(BOOT), "/sandbox/.trex_boot.py"]
    for name, host in files.items():
        cmd += ["--ro-bind", host, f"/sandbox/{name}"]
    cmd += ["--chdir", "/sandbox", "--chmod", "1777", "/sandbox", "--chmod", "1777", "/tmp"]
    return cmd


def _unshare_prefix() -> list[str]:
    base = ["unshare", "--net", "--pid", "--fork", "--kill-child", "--mount", "--mount-proc"]
    return base if _as_root() else ["unshare", "--map-root-user", *base[1:]]


# ------------------------------------------------------------------------------------------- limits
class _PidsCgroup:
    """A per-run ``pids`` cgroup (v1 or v2) capping the process count, when the cgroup fs is writable."""

    ROOTS = ("/sys/fs/cgroup/pids", "/sys/fs/cgroup")

    def __init__(self, max_pids: int):
        self.path = None
        self.used = False
        for root in self.ROOTS:
            ctrl = os.path.join(root, "cgroup.controllers")
            if root == "/sys/fs/cgroup" and not (os.path.exists(ctrl) and "pids" in open(ctrl).read()):
                continue
            try:
                path = os.path.join(root, f"trex-{os.getpid()}-{secrets.token_hex(4)}")
                os.mkdir(path)
                with open(os.path.join(path, "pids.max"), "w") as f:
                    f.write(str(max_pids))
                self.path, self.used = path, True
                break
            except OSError:
                continue

    def join(self) -> None:  # in the child, before exec
        if self.path:
            with open(os.path.join(self.path, "cgroup.procs"), "w") as f:
                f.write("0")

    def close(self) -> None:
        if not self.path:
            return
        for _ in range(50):
            try:
                os.rmdir(self.path)
                self.path = None
                return
            except FileNotFoundError:
                self.path = None
                return
            except OSError:
                try:
                    for pid in open(os.path.join(self.path, "cgroup.procs")).read().split():
                        os.kill(int(pid), signal.SIGKILL)
                except OSError:
                    pass
                time.sleep(0.02)


def _preexec(cpu_s: float, memory_mb: int, fsize_mb: int, nproc: int, cgroup: _PidsCgroup, close_fd: int):
    def apply() -> None:
        os.setsid()
        cgroup.join()
        cpu = max(1, int(cpu_s) + 1)
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        mem = memory_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
        fs = fsize_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_FSIZE, (fs, fs))
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if _as_root():  # counts the processes of the run's own uid (the program drops to it)
            resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
        os.close(close_fd)

    return apply


def _clean_env(workdir: str, attest_fd: int) -> dict[str, str]:
    keep = {k: os.environ[k] for k in ("PATH", "LANG", "LC_ALL") if k in os.environ}
    keep.update({"HOME": workdir, "TMPDIR": "/tmp" if workdir == "/sandbox" else workdir,
                 "PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
                 "TREX_ATTEST_FD": str(attest_fd)})
    return keep


def _tail(path: str, n: int = 4000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - n))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def _read_records(fd: int, key: bytes, sink: list) -> None:
    buf = b""
    with os.fdopen(fd, "rb") as f:
        while True:
            chunk = f.read1(65536) if hasattr(f, "read1") else f.read(65536)
            if not chunk:
                break
            buf += chunk
            if len(buf) > 4 * 1024 * 1024:  # a flood: keep the tail
                buf = buf[-1024 * 1024:]
    for line in buf.split(b"\n"):
        if not line:
            continue
        body, _, mac = line.rpartition(b"\t")
        good = hmac.new(key, body, hashlib.sha256).hexdigest().encode()
        if body and hmac.compare_digest(mac, good):
            try:
                sink.append(json.loads(body))
                continue
            except ValueError:
                pass
        sink.append(None)


# ------------------------------------------------------------------------------------------- running
def run_program(code: str, timeout_s: float = 20.0, memory_mb: int = 2048, files: dict[str, bytes] | None = None,
                isolation: str = "auto", allow_unisolated: bool | None = None, fsize_mb: int = 64,
                nproc: int = 256, collect: tuple[str, ...] = ()) -> ExecResult:
    """Execute one untrusted program in its own sandbox; judge it by its last attested solve.

    ``collect`` names output files (plain names in the working directory) returned in ``result.files``.
    """
    level = isolation_level(isolation, allow_unisolated)
    key = secrets.token_bytes(32)
    with tempfile.TemporaryDirectory(prefix="trex-exec-") as host:
        os.chmod(host, 0o755)
        wd = os.path.join(host, "work")
        os.mkdir(wd)
        os.chmod(wd, 0o1777)
        for name, blob in {"program.py": code.encode(), **(files or {})}.items():
            if os.path.basename(name) != name or name.startswith("."):
                raise ValueError(f"data file name {name!r}: plain file names only")
            Path(wd, name).write_bytes(blob)
            os.chmod(os.path.join(wd, name), 0o644)
        out_path, err_path = os.path.join(host, "stdout"), os.path.join(host, "stderr")
        uid = _next_uid()
        boot_args = ["-I", "-X", "frozen_modules=on"]
        if level == "bwrap":
            names = {n: os.path.join(wd, n) for n in os.listdir(wd)}
            prefix = _bwrap_prefix(wd, names) + _drop(uid)
            argv = prefix + [sys.executable, *boot_args, "/sandbox/.trex_boot.py", "program.py"]
            cwd, inner_wd = host, "/sandbox"
        else:
            shutil.copy(BOOT, os.path.join(wd, ".trex_boot.py"))
            prefix = (_unshare_prefix() if level == "netns" else []) + _drop(uid)
            argv = prefix + [sys.executable, *boot_args, ".trex_boot.py", "program.py"]
            cwd, inner_wd = wd, wd
        r_fd, w_fd = os.pipe()
        cgroup = _PidsCgroup(nproc)
        records: list = []
        t0 = time.perf_counter()
        try:
            with open(out_path, "wb") as out, open(err_path, "wb") as err:
                env = _clean_env(inner_wd, w_fd)
                if collect:
                    env["TREX_COLLECT"] = ",".join(os.path.basename(c) for c in collect)
                proc = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.PIPE,
                                        stdout=out, stderr=err, pass_fds=(w_fd,),
                                        preexec_fn=_preexec(timeout_s, memory_mb, fsize_mb, nproc, cgroup, r_fd))
            os.close(w_fd)
            reader = threading.Thread(target=_read_records, args=(r_fd, key, records), daemon=True)
            reader.start()
            try:
                proc.stdin.write(key.hex().encode() + b"\n")
                proc.stdin.close()
            except OSError:
                pass
            timed_out = False
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            _kill_tree(proc)
            cgroup.close()
            reader.join(timeout=5)
        finally:
            cgroup.close()
        seconds = time.perf_counter() - t0
        stdout, stderr = _tail(out_path), _tail(err_path)
        out_size = os.path.getsize(out_path) + os.path.getsize(err_path)
    return _classify(proc.returncode, timed_out, stdout, stderr, out_size, records, seconds, level,
                     {"timeout_s": timeout_s, "memory_mb": memory_mb, "fsize_mb": fsize_mb, "nproc": nproc,
                      "pids_cgroup": cgroup.used})


def _kill_tree(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _classify(rc, timed_out, stdout, stderr, out_size, records, seconds, level, limits) -> ExecResult:
    good = [r for r in records if r is not None and r.get("kind", "solve") == "solve"]
    files = {r["name"]: r["text"] for r in records if r is not None and r.get("kind") == "file"}
    last = good[-1] if good else None
    fsize = limits["fsize_mb"] * 1024 * 1024
    sig = -rc if rc is not None and rc < 0 else (rc - 128 if rc is not None and 128 < rc < 160 else None)
    if timed_out:
        status = "timeout"
    elif sig == signal.SIGXCPU:
        status = "cpu_limit"
    elif sig == signal.SIGXFSZ or out_size >= fsize:
        status = "output_limit"
    elif "MemoryError" in stderr or "std::bad_alloc" in stderr:
        status = "memory_limit"
    elif sig is not None:
        status = "killed"
    elif rc != 0:
        status = "error"
    else:
        status = "ok" if last is not None else "no_solve"
    return ExecResult(
        status=status, objective=last["objective"] if last and last["status"] == "optimal" else None,
        reported=last["status"] if last else None, returncode=rc, seconds=seconds, isolation=level,
        stdout_tail=stdout[-2000:], stderr_tail=stderr[-2000:], solver=last["solver"] if last else None,
        solves=len(good), rejected_records=sum(r is None for r in records), files=files,
        printed_objective=parse_printed_objective(stdout), printed_status=parse_printed_status(stdout),
        attested=last, limits=limits)


def run_batch(programs: list[str | dict], timeout_s: float = 120.0, memory_mb: int = 4096) -> list[dict]:
    """Execute many trusted-but-unverified programs (reference programs) in one sandboxed process.

    ``programs`` are code strings or ``{"code", "files": {name: text}}``. Each program gets a fresh
    namespace, its own directory with its files and its own captured stdout; returns per program
    ``{"status", "objective", "reported", "error"}``. Used to verify generated reference programs cheaply.
    """
    items = [p if isinstance(p, dict) else {"code": p} for p in programs]
    with tempfile.TemporaryDirectory(prefix="trex-batch-") as wd:
        rc, out, err, timed_out = _run_trusted([sys.executable, "-I", str(BATCH_WORKER)], json.dumps(items),
                                               timeout_s, memory_mb, wd)
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


def _run_trusted(cmd: list[str], stdin: str, timeout_s: float, memory_mb: int, cwd: str):
    """Run our own worker (reference programs) with rlimits, no network where possible, a killed tree on timeout."""
    prefix = _unshare_prefix() if "netns" in available_levels() else []
    proc = subprocess.Popen(prefix + cmd, cwd=cwd, env=_clean_env(cwd, -1), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, errors="replace",
                            preexec_fn=_trusted_limits(timeout_s, memory_mb))
    timed_out = False
    try:
        out, err = proc.communicate(stdin, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        _kill_tree(proc)
        out, err = proc.communicate()
    return proc.returncode, out or "", err or "", timed_out


def _trusted_limits(cpu_s: float, memory_mb: int):
    def apply() -> None:
        os.setsid()
        cpu = max(1, int(cpu_s) + 1)
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    return apply
