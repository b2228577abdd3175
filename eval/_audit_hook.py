"""The side-effect audit of an untrusted program: every effect outside its own directory, signed, as it happens.

Loaded by :mod:`eval._sandbox_worker` (inside the sandbox) and installed by :func:`install` in each program's
forked child just before the program runs; imports nothing of T-Rex. A Python audit hook
(:func:`sys.addaudithook`: it cannot be removed) sees the program's

- network: ``socket.connect`` / ``bind`` / ``sendto`` / ``sendmsg`` and name lookups (``socket.getaddrinfo``, ...);
- processes: ``subprocess.Popen``, ``os.system``, ``os.exec``, ``os.posix_spawn``, ``os.spawn``, ``os.fork``,
  ``os.forkpty``, signals to other processes (``os.kill`` / ``os.killpg``), and ``subprocess.fork_exec`` (the raw
  primitive under ``subprocess``, which CPython does not audit: it is routed through this hook); an executable
  on the solver-binary list (``policy["binaries"]``, e.g. pulp's CBC) may be started;
- files: ``open.write`` (opening for writing, appending, creating or truncating), removing, renaming, linking,
  ``mkdir``, ``chmod`` / ``chown``, ``truncate``, ``utime``, xattrs, ``shutil.rmtree`` -- of any path outside the
  program's working directory (``/dev/null`` excepted);
- native code: ``ctypes.dlopen`` of a file outside the solver packages (``policy["libraries"]``) or of the
  process itself, ``ctypes.dlsym`` (calling into) any library outside them (a bare soname such as
  ``libc.so.6`` loads from the read-only system paths: it is flagged when used), raw memory through ctypes
  (``ctypes.cdata``, ``ctypes.string_at``), and
  ``import.native`` (a C extension loaded from outside the interpreter's read-only prefixes);
- introspection that could reach this hook: ``gc.get_objects`` / ``get_referrers`` / ``get_referents``.

Each distinct ``(event, detail)`` becomes one line ``<json>\\t<hmac-sha256>`` on the program's record pipe, signed
with the batch's *audit* key (not the solve records' key), **before** the operation proceeds. The hook's state
(the key inside a C HMAC object, the pipe, the counters) lives only in its closure, which nothing but the
interpreter's hook list references, and every function it calls was bound when it was installed, so a program
that monkeypatches ``os``, ``json`` or the builtins does not change what it records. A record that cannot be
delivered -- the pipe closed, replaced (``dup2``) or full -- kills the process (SIGKILL) before the operation:
an effect is recorded or it does not happen. After the program, the worker raises ``trex.audit.seal`` and the
hook signs a seal with its counts; the parent accepts the record as complete only when the sequence numbers are
contiguous and the seal is last (:func:`eval.audit.audit_of`).

What it cannot see: system calls made by native code (a C extension, a solver library, ``os.mkfifo``,
``os.write`` on inherited descriptors). Those meet the sandbox, and the worker checks afterwards, from outside
the program, for files left outside its directory and processes left running (``sandbox.file``,
``sandbox.process``). docs/eval.md lists both.
"""

import _hashlib
import _thread
import os
import signal
import stat
import sys
from json.encoder import c_encode_basestring_ascii  # the C encoder (a program cannot patch it)

MAX_DISTINCT = 64  # distinct (event, detail) records per program; the rest are counted in the seal
MAX_DETAIL = 600  # characters of a record's detail (a record stays below PIPE_BUF: one atomic write)

NETWORK = frozenset({"socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg", "socket.getaddrinfo",
                     "socket.gethostbyname", "socket.gethostbyname_ex", "socket.gethostbyaddr",
                     "socket.getnameinfo"})
PROCESS = frozenset({"os.system", "os.exec", "os.spawn", "os.fork", "os.forkpty", "os.startfile"})
INTROSPECTION = frozenset({"gc.get_objects", "gc.get_referrers", "gc.get_referents"})
MEMORY = frozenset({"ctypes.cdata", "ctypes.string_at", "ctypes.wstring_at"})
# event -> ((path argument, dir_fd argument or None), ...): the paths an event changes
FILES = {"os.remove": ((0, 1),), "os.rmdir": ((0, 1),), "os.rename": ((0, 2), (1, 3)), "os.link": ((1, 3),),
         "os.symlink": ((1, 2),), "os.mkdir": ((0, 2),), "os.chmod": ((0, 2),), "os.chown": ((0, 3),),
         "os.utime": ((0, 3),), "os.truncate": ((0, None),), "os.setxattr": ((0, None),),
         "os.removexattr": ((0, None),), "os.chflags": ((0, None),), "os.lchflags": ((0, None),),
         "shutil.rmtree": ((0, 1),)}
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
HARMLESS = frozenset({"/dev/null"})


WATCHED = (NETWORK | PROCESS | INTROSPECTION | MEMORY | frozenset(FILES)
           | {"open", "import", "subprocess.Popen", "os.posix_spawn", "os.posix_spawnp", "os.kill", "os.killpg",
              "ctypes.dlopen", "ctypes.dlsym", "trex.fork_exec", "trex.audit.seal"})


def _factory(key: bytes, fd: int, workdir: str, policy: dict):
    """The hook and everything it uses, bound now: closure cells only, no module globals or builtins looked up
    at call time (a program can reach and rewrite those)."""
    mac = _hashlib.hmac_new(key, digestmod="sha256")
    write, fstat, kill, getpid, getcwd, lstat, readlink = (os.write, os.fstat, os.kill, os.getpid, os.getcwd,
                                                            os.lstat, os.readlink)
    fspath, fsdecode, is_link, audit = os.fspath, os.fsdecode, stat.S_ISLNK, sys.audit
    enc, sigkill = c_encode_basestring_ascii, signal.SIGKILL
    _isinstance, _str, _int, _len, _repr, _sorted, _any, _all, _bool, _list, _tuple, _base = (
        isinstance, str, int, len, repr, sorted, any, all, bool, list, tuple, BaseException)
    watched, network, process, files, memory, introspection = WATCHED, NETWORK, PROCESS, FILES, MEMORY, INTROSPECTION
    max_distinct, max_detail, write_flags, harmless = MAX_DISTINCT, MAX_DETAIL, WRITE_FLAGS, HARMLESS
    local = _thread._local()
    pipe = fstat(fd)
    pipe_id = (pipe.st_dev, pipe.st_ino)
    binaries = frozenset(policy.get("binaries", ()))
    libraries = _tuple(d.rstrip("/") + "/" for d in policy.get("libraries", ()))
    native = _tuple(d.rstrip("/") + "/" for d in policy.get("native", ()))
    home = workdir.rstrip("/") + "/"
    state = {"seq": 0, "distinct": 0, "counts": {}, "seen": set()}
    import _posixsubprocess  # the primitive under subprocess: from now on only this closure keeps the real one

    raw_fork_exec = _posixsubprocess.fork_exec

    def emit(event: str, detail: str = "", extra: str = "") -> None:
        state["seq"] += 1
        body = ('{"detail": ' + enc(detail[:max_detail]) + ', "event": ' + enc(event) + extra
                + ', "kind": "audit", "seq": ' + _str(state["seq"]) + "}")
        m = mac.copy()
        m.update(body.encode())
        data = (body + "\t" + m.hexdigest() + "\n").encode()
        try:
            st = fstat(fd)
            if (st.st_dev, st.st_ino) != pipe_id or write(fd, data) != _len(data):
                raise OSError
        except _base:  # noqa: BLE001 - the record cannot reach the judge: the effect must not happen
            kill(getpid(), sigkill)

    def record(event: str, detail) -> None:
        detail = detail if _isinstance(detail, _str) else _repr(detail)
        counts = state["counts"]
        counts[event] = counts.get(event, 0) + 1
        k = (event, detail)
        if k in state["seen"] or state["distinct"] >= max_distinct:
            return
        state["seen"].add(k)
        state["distinct"] += 1
        emit(event, detail)

    def real(path: str) -> str:
        """The absolute ``path`` with every symlink resolved (a missing tail kept as written)."""
        parts = [p for p in path.split("/") if p and p != "."]
        out: list = []
        hops = 0
        while parts:
            p = parts.pop(0)
            if p == "..":
                if out:
                    out.pop()
                continue
            cand = "/" + "/".join(out + [p])
            try:
                if is_link(lstat(cand).st_mode) and hops < 40:
                    hops += 1
                    target = readlink(cand)
                    if target.startswith("/"):
                        out = []
                    parts = [q for q in target.split("/") if q and q != "."] + parts
                    continue
            except OSError:
                pass
            out.append(p)
        return "/" + "/".join(out)

    def as_path(value) -> str | None:
        try:
            return fsdecode(fspath(value))
        except (TypeError, ValueError):
            return None

    def path_of(value, dir_fd) -> str | None:
        if value is None or _isinstance(value, _int):
            return None  # a descriptor: its file was opened (and audited) before
        path = as_path(value)
        if path is None:
            return _repr(value)
        if not path.startswith("/"):
            base = getcwd()
            if _isinstance(dir_fd, _int) and dir_fd >= 0:
                try:
                    base = readlink("/proc/self/fd/" + _str(dir_fd))
                except OSError:
                    pass
            path = base + "/" + path
        return real(path)

    def outside(path: str | None) -> bool:
        return path is not None and path not in harmless and not (path + "/").startswith(home)

    def allowed_binary(value) -> bool:
        path = as_path(value)
        return path is not None and real(path if path.startswith("/") else getcwd() + "/" + path) in binaries

    def library_ok(name) -> bool:
        path = None if name is None else as_path(name)
        return path is not None and path.startswith("/") and real(path).startswith(libraries)

    def via_popen() -> bool:
        try:
            return _bool(local.popen)
        except AttributeError:
            return False

    def check(event: str, args) -> None:
        if event == "open":
            path, mode, flags = args[0], args[1], args[2]
            writes = (flags & write_flags) if _isinstance(flags, _int) and flags > 0 else (
                mode is not None and _any(c in _str(mode) for c in "wax+"))
            if writes:
                target = path_of(path, None)
                if outside(target):
                    record("open.write", target)
        elif event == "import":
            if args[0] == "_posixsubprocess":
                record("subprocess.fork_exec", "a fresh copy of _posixsubprocess (its fork_exec is not audited)")
            elif args[1] is not None:
                path = as_path(args[1])
                path = real(path) if path is not None and path.startswith("/") else _repr(args[1])
                if not path.startswith(native):
                    record("import.native", path)
        elif event in files:
            for i, d in files[event]:
                target = path_of(args[i] if i < _len(args) else None,
                                 args[d] if d is not None and d < _len(args) else None)
                if outside(target):
                    record(event, target)
        elif event in network:
            record(event, _repr(args[1:]) if event in ("socket.connect", "socket.bind", "socket.sendto",
                                                       "socket.sendmsg") else _repr(args))
        elif event == "subprocess.Popen":
            exe = args[0]
            if exe is None:
                exe = args[1][0] if _isinstance(args[1], (_list, _tuple)) and args[1] else args[1]
            local.popen = True  # its fork_exec / posix_spawn is judged here, by the executable Popen names
            if not allowed_binary(exe):
                record(event, _repr(args[1]))
        elif event == "os.posix_spawn" or event == "os.posix_spawnp":
            if not via_popen() and not allowed_binary(args[0]):
                record(event, _repr(args[:2]))
            local.popen = False
        elif event in process:
            record(event, _repr(args))
        elif event == "os.kill" or event == "os.killpg":
            if args[0] != getpid() and args[0] != 0:
                record(event, _repr(args))
        elif event == "ctypes.dlopen":  # a bare soname comes from the read-only system paths: using it is dlsym's
            name = None if args[0] is None else as_path(args[0])
            if name is None or ("/" in name and not library_ok(name)):
                record(event, _repr(args[0]))
        elif event == "ctypes.dlsym":
            lib = args[0]
            try:
                name = lib if _isinstance(lib, _int) else lib.__dict__.get("_name")
            except AttributeError:
                name = None
            if not library_ok(name):
                record(event, _repr(name) + ": " + _repr(args[1]))
        elif event in memory or event in introspection:
            record(event, "")
        elif event == "trex.audit.seal":
            counts = state["counts"]
            extra = ', "counts": {' + ", ".join(enc(k) + ": " + _str(counts[k]) for k in _sorted(counts)) + "}"
            emit("audit.seal", "", extra)

    def spawn(spawn_args, box) -> None:
        """``_posixsubprocess.fork_exec``, audited: the executables it may run are judged here."""
        if not via_popen():
            exes = spawn_args[1] if _len(spawn_args) > 1 else None
            if not (exes and _all(allowed_binary(e) for e in exes)):
                record("subprocess.fork_exec", _repr(spawn_args[0]))
        local.popen = False
        box.append(raw_fork_exec(*spawn_args))  # its errors reach the caller

    def hook(event: str, args) -> None:
        if event not in watched:
            return
        try:
            if local.busy:
                return
        except AttributeError:
            pass
        local.busy = True
        try:
            if event == "trex.fork_exec":
                spawn(*args)
                return
            try:
                check(event, args)
            except _base as e:  # noqa: BLE001 - arguments this hook does not understand: recorded, never ignored
                record(event, "arguments not understood (" + _repr(e) + "): " + _repr(args)[:200])
        finally:
            local.busy = False

    def fork_exec(*spawn_args):
        box: list = []
        audit("trex.fork_exec", spawn_args, box)
        return box[0]

    return hook, fork_exec


def install(key: bytes, fd: int, workdir: str, policy: dict) -> None:
    """Audit this process from now on (see the module docstring): in the program's child, once its descriptors
    are set up, just before the program runs. ``policy``: ``binaries`` (executables it may start),
    ``libraries`` (dirs whose libraries ctypes may load), ``native`` (dirs C extensions may be imported from)."""
    import _posixsubprocess

    hook, fork_exec = _factory(key, fd, workdir, policy)
    sys.addaudithook(hook)
    _posixsubprocess.fork_exec = fork_exec


def seal() -> None:
    """After the program: the hook signs the seal (its counts) as the last record."""
    sys.audit("trex.audit.seal")
