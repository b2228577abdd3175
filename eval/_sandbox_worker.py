"""The process inside the sandbox that runs a batch of untrusted programs, one forked child each.

Started by :mod:`eval.sandbox` as ``python -I _sandbox_worker.py BOOT_PATH AUDIT_PATH WORK_ROOT`` inside the
sandbox (bubblewrap), as the sandbox's unprivileged uid; imports nothing of T-Rex. Protocol on stdin: two hex
lines (the batch's attestation key and its audit key), then one JSON document ``{"preload": [...],
"collect": [...], "limits": {...}, "audit": {policy}, "programs": [{"code": str, "files": {name: base64}},
...]}``. On stdout: ``{"ready": ...}`` once the preloads are imported, then one JSON line per program, in
order::

    {"i", "rc", "signal", "timed_out", "seconds", "stdout", "stderr", "out_size", "records": [line, ...],
     "found": [{"event", "detail"}, ...]}

Per program: a fresh working directory ``WORK_ROOT/p<i>`` with its files; a child forked from this (warm,
solver-instrumented) interpreter, in its own session, with rlimits (CPU seconds, address space above the
worker's own, file size, open files, no core dumps), stdout/stderr to private files and a private pipe for
its signed solve records (so no program can write records for another). After the child ends (or its wall
clock runs out) every other process of the sandbox is killed, the records are drained to EOF, and the
working directory, ``/tmp`` and ``/dev/shm`` are emptied before the next program starts: nothing of one
program is alive or on disk when the next one runs. Before that sweep the worker looks, from outside the program,
for what it left behind: processes still running (``sandbox.process``) and files outside its directory in the
sandbox's writable places (``sandbox.file``): the part of the side-effect audit (:mod:`eval._audit_hook`, installed
in each child) that native code cannot evade. The worker is not dumpable (no ptrace, no
``/proc/<pid>/mem`` for its children); a program that kills it ends the batch, and the parent reruns the
remaining programs in a fresh sandbox.
"""

import atexit
import base64
import builtins
import ctypes
import importlib.util
import io
import json
import os
import resource
import select
import shutil
import signal
import sys
import threading
import time
import traceback
import types

MAX_RECORDS = 4 * 1024 * 1024
TAIL = 4000
SCRUB = ("/tmp", "/dev/shm")


def _load_boot(path: str, name: str = "_trex_attest_boot"):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _not_dumpable() -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE, 0
    except (OSError, AttributeError):
        pass


def _vm_bytes() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _tail(path: str) -> tuple[str, int]:
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            f.seek(max(0, size - TAIL))
            return f.read().decode(errors="replace"), size
    except OSError:
        return "", 0


def _remove(func, p: str) -> None:
    """``func(p)`` (unlink or rmdir), once more after making ``p`` and its directory writable (the program may
    have made them read-only); what still cannot go is left."""
    try:
        func(p)
    except OSError:
        try:
            os.chmod(os.path.dirname(p), 0o700)
            os.chmod(p, 0o700, follow_symlinks=False)
            func(p)
        except (OSError, NotImplementedError):
            pass


def _empty(path: str, dev: int | None = None) -> None:
    """Remove everything below ``path``, never crossing into another mount: the read-only binds of the Python
    prefixes may lie below ``/tmp`` (a virtual environment under ``/tmp/...``), and walking them after every
    program cost seconds and removed nothing. A program cannot mount (no privileges), so every other device
    below ``path`` is one of the sandbox's own binds."""
    try:
        dev = os.lstat(path).st_dev if dev is None else dev
    except OSError:
        return
    try:
        entries = list(os.scandir(path))
    except OSError:  # a directory the program made unreadable
        try:
            os.chmod(path, 0o700)
            entries = list(os.scandir(path))
        except OSError:
            return
    for e in entries:
        try:
            if e.is_dir(follow_symlinks=False):
                if e.stat(follow_symlinks=False).st_dev != dev:
                    continue
                _empty(e.path, dev)
                _remove(os.rmdir, e.path)
            else:
                _remove(os.unlink, e.path)
        except OSError:
            pass


def _keep() -> set[int]:
    """This worker, its ancestors and the namespace's init: the processes that are not a program's."""
    keep = {os.getpid(), 1}
    p = os.getppid()
    while p > 1 and p not in keep:
        keep.add(p)
        try:
            with open(f"/proc/{p}/stat") as f:
                p = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return keep


def _left_running(child: int) -> list[str]:
    """The command lines of the sandbox's processes other than the worker's own and the program's (``child``):
    what the program started and left running (exited ones included, until their parent reaps them)."""
    keep = _keep() | {child}
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) not in keep:
            try:
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            except OSError:
                continue
            found.append(f"pid {name}: {cmd or '(exited)'}"[:300])
    return found


def _listing(roots: tuple[str, ...]) -> set[str]:
    """Every path below ``roots`` on their own devices (the sandbox's writable tmpfs mounts, never a bound prefix)."""
    out: set[str] = set()

    def walk(path: str, dev: int) -> None:
        try:
            entries = list(os.scandir(path))
        except OSError:
            return
        for e in entries:
            try:
                st = e.stat(follow_symlinks=False)
            except OSError:
                continue
            if st.st_dev != dev:
                continue
            out.add(e.path)
            if e.is_dir(follow_symlinks=False):
                walk(e.path, dev)

    for r in roots:
        try:
            walk(r, os.lstat(r).st_dev)
        except OSError:
            pass
    return out


def _kill_others() -> None:
    """SIGKILL every process of the sandbox but this one and its ancestors, until none is left."""
    keep = _keep()
    for _ in range(1000):
        found = False
        for name in os.listdir("/proc"):
            if name.isdigit() and int(name) not in keep:
                try:
                    with open(f"/proc/{name}/stat") as f:
                        if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                            continue  # exited (its descriptors are closed); its parent reaps it
                    os.kill(int(name), signal.SIGKILL)
                    found = True
                except (OSError, IndexError):
                    pass
        while True:  # reap what was ours (the worker may be the namespace's init)
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
        if not found:
            return


def _scrub_ipc() -> None:
    """Remove System V IPC objects a program left (the IPC namespace lives as long as the batch)."""
    left = False
    for kind in ("shm", "sem", "msg"):
        try:
            with open(f"/proc/sysvipc/{kind}") as f:
                left = left or len(f.read().splitlines()) > 1
        except OSError:
            pass
    if left and shutil.which("ipcrm"):
        pid = os.fork()
        if pid == 0:
            os.execvp("ipcrm", ["ipcrm", "--all"])
        os.waitpid(pid, 0)


def _run_main(path: str) -> None:
    """Run ``path`` as ``__main__`` (what ``python path`` does), in a fresh module."""
    with open(path, "rb") as f:
        source = f.read()
    main = types.ModuleType("__main__")
    main.__file__ = path
    main.__builtins__ = builtins
    sys.modules["__main__"] = main
    exec(compile(source, path, "exec"), main.__dict__)


def _child(boot, audit, auditing: dict, wd: str, wfd: int, out: str, err: str, limits: dict, base_vm: int, collect: list):
    """In the forked child: limits, private descriptors, its own home and temporary directory (its working
    directory), the side-effect audit, then the program as ``__main__``; the audit's seal after it."""
    code = 1
    try:
        os.setsid()
        cpu = max(1, int(limits["timeout_s"]) + 1)
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        mem = base_vm + limits["memory_mb"] * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
        fs = limits["fsize_mb"] * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_FSIZE, (fs, fs))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        null = os.open(os.devnull, os.O_RDONLY)
        o = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        e = os.open(err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(null, 0)
        os.dup2(o, 1)
        os.dup2(e, 2)
        fd = os.dup2(wfd, 3)
        os.closerange(4, 1 << 16)
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
        sys.stdin = open(0, closefd=False)
        sys.stdout = io.TextIOWrapper(open(1, "wb", closefd=False), line_buffering=False)
        sys.stderr = io.TextIOWrapper(open(2, "wb", closefd=False), line_buffering=True)
        boot.set_fd(fd)
        os.chdir(wd)
        os.environ["HOME"] = os.environ["TMPDIR"] = wd  # temporary files (pulp's, tempfile's) stay in its directory
        if "tempfile" in sys.modules:
            sys.modules["tempfile"].tempdir = wd
        sys.argv = ["program.py"]
        sys.path.insert(0, wd)
        atexit._clear()  # the worker's own exit handlers are not the program's
        audit.install(auditing["key"], fd, wd, auditing["policy"])
        try:
            _run_main(os.path.join(wd, "program.py"))
            code = 0
            threading._shutdown()  # as at a normal interpreter exit: wait for the program's non-daemon threads
        except SystemExit as x:
            code = 0 if x.code is None else (x.code if isinstance(x.code, int) else 1)
            if not isinstance(x.code, (int, type(None))):
                print(x.code, file=sys.stderr)
        except MemoryError:
            os.write(2, b"MemoryError\n")
            code = 1
        except BaseException:  # noqa: BLE001 - an untrusted program's failure, reported as such
            traceback.print_exc()
            code = 1
        try:
            atexit._run_exitfuncs()  # the program's own exit handlers, as at a normal exit
        except BaseException:  # noqa: BLE001
            pass
        if collect:
            boot.collect(collect)
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError, MemoryError):
                pass
        audit.seal()
    except BaseException:  # noqa: BLE001 - never return into the worker's loop
        try:
            os.write(2, traceback.format_exc().encode()[-2000:])
        except OSError:
            pass
    os._exit(code & 0xFF)


def _run_one(boot, audit, auditing: dict, i: int, prog: dict, root: str, limits: dict, base_vm: int,
             collect: list, private: bool, before: set[str]) -> dict:
    """Run program ``i`` in a forked child; its report. ``before``: the writable places' listing before it ran
    (private sandboxes only: what is new afterwards outside its directory, it wrote)."""
    wd = os.path.join(root, f"p{i}")
    os.mkdir(wd, 0o700)
    files = {**(prog.get("files") or {}), "program.py": base64.b64encode(prog["code"].encode()).decode()}
    for name, blob in files.items():
        with open(os.path.join(wd, os.path.basename(name)), "wb") as f:
            f.write(base64.b64decode(blob))
    out, err = os.path.join(root, f".out{i}"), os.path.join(root, f".err{i}")
    r, w = os.pipe()
    sys.stdout.flush()
    t0 = time.monotonic()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        _child(boot, audit, auditing, wd, w, out, err, limits, base_vm, collect)
    os.close(w)
    deadline = t0 + limits["timeout_s"]
    pidfd = os.pidfd_open(pid)
    buf, status, timed_out, truncated = bytearray(), None, False, False
    reading = True
    while status is None:
        left = deadline - time.monotonic()
        if left <= 0:
            timed_out = True
            break
        ready, _, _ = select.select([pidfd] + ([r] if reading else []), [], [], left)
        if r in ready:
            chunk = os.read(r, 65536)
            if not chunk:
                reading = False
            elif len(buf) < MAX_RECORDS:
                buf += chunk
            else:
                truncated = True
        if pidfd in ready:
            _, status = os.waitpid(pid, 0)
    seconds = time.monotonic() - t0
    found = [{"event": "sandbox.process", "detail": p} for p in (_left_running(pid) if private else [])]
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if private:  # a namespace of our own: nothing else may live on (never on the host's process table)
        _kill_others()
    if status is None:
        try:
            _, status = os.waitpid(pid, 0)
        except ChildProcessError:
            status = 9  # reaped by the sweep: it was killed
    os.close(pidfd)
    os.set_blocking(r, False)
    while True:  # every writer is dead now (in a private namespace): drain what is left
        try:
            chunk = os.read(r, 65536)
        except BlockingIOError:
            break
        if not chunk:
            break
        if len(buf) < MAX_RECORDS:
            buf += chunk
        else:
            truncated = True
    os.close(r)
    if private:  # files it left outside its own directory (the writable places are the sandbox's own)
        own = (wd, out, err)
        new = sorted(p for p in _listing((root, *SCRUB)) - before
                     if not any(p == o or p.startswith(o + "/") for o in own))
        found += [{"event": "sandbox.file", "detail": p} for p in new[:32]]
    stdout, n_out = _tail(out)
    stderr, n_err = _tail(err)
    sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
    rc = os.WEXITSTATUS(status) if os.WIFEXITED(status) else -sig
    for path in (wd, out, err):
        if os.path.isdir(path):
            _empty(path)
            shutil.rmtree(path, ignore_errors=True)
        elif os.path.exists(path):
            os.unlink(path)
    if private:  # the sandbox's own working root, /tmp and /dev/shm (never the host's)
        for d in (root, *SCRUB):
            _empty(d)
        _scrub_ipc()
    lines = [ln.decode(errors="replace") for ln in bytes(buf).split(b"\n") if ln]
    return {"i": i, "rc": rc, "signal": sig, "timed_out": timed_out, "seconds": seconds, "stdout": stdout,
            "stderr": stderr, "out_size": n_out + n_err, "records": lines, "records_truncated": truncated,
            "found": found}


def main() -> None:
    boot_path, audit_path, root = sys.argv[1], sys.argv[2], sys.argv[3]
    _not_dumpable()
    boot = _load_boot(boot_path)
    audit = _load_boot(audit_path, "_trex_audit_hook")
    boot.configure(bytes.fromhex(sys.stdin.readline().strip() or "00"))
    auditing = {"key": bytes.fromhex(sys.stdin.readline().strip() or "00")}
    job = json.loads(sys.stdin.read())
    auditing["policy"] = job.get("audit") or {}
    sys.stdin.close()
    boot.install()
    boot.want_iis(job.get("iis", False))
    preloaded = []
    for name in job.get("preload", []):
        try:
            __import__(name)
            preloaded.append(name)
        except Exception:  # noqa: BLE001 - a missing optional solver is the program's problem, not ours
            pass
    base_vm = _vm_bytes()
    out = sys.stdout
    out.write(json.dumps({"ready": preloaded, "vm_mb": base_vm >> 20}) + "\n")
    out.flush()
    private = job.get("private", False)
    for i, prog in enumerate(job["programs"]):
        before = _listing((root, *SCRUB)) if private else set()
        report = _run_one(boot, audit, auditing, i, prog, root, job["limits"], base_vm, job.get("collect", []),
                          private, before)
        out.write(json.dumps(report) + "\n")
        out.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
