"""Hostile programs: each one is contained, classified, and the harness keeps going.

Every program runs through :func:`eval.sandbox.run_program` exactly as a model's program would. The checks
look at the host afterwards (no file written, no connection received, the test process alive, no process
left behind), not only at the classification.
"""

from __future__ import annotations

import os
import socket
import subprocess
import threading
from concurrent.futures import ThreadPoolExecutor

from pathlib import Path

import pytest

from eval.sandbox import run_program

ROOT = Path(__file__).resolve().parents[2]
# No skip: where bubblewrap cannot run, run_program raises SandboxUnavailable and these tests fail (CI installs it).

SOLVE5 = ("import highspy\nh = highspy.Highs()\nh.silent()\nx = h.addVariable(lb=0, ub=5)\n"
          "h.maximize(x)\n")


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    """Host-side bait: a secret file, a listening socket, an env secret, a directory to protect."""
    d = tmp_path_factory.mktemp("host")
    secret = d / "secret.txt"
    secret.write_text("TOP-SECRET-7781")
    secret.chmod(0o644)
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.settimeout(0.2)
    hits = []

    def accept():
        while not stop.is_set():
            try:
                conn, _ = server.accept()
                hits.append(1)
                conn.close()
            except OSError:
                pass

    stop = threading.Event()
    t = threading.Thread(target=accept, daemon=True)
    t.start()
    os.environ["TREX_TEST_SECRET"] = "ENV-SECRET-5521"
    yield {"dir": d, "secret": secret, "port": server.getsockname()[1], "hits": hits, "token": os.urandom(6).hex()}
    stop.set()
    server.close()
    os.environ.pop("TREX_TEST_SECRET", None)


def programs(h) -> dict[str, tuple[str, dict, callable]]:
    """name -> (code, run_program kwargs, check(result) -> None)."""
    outside = h["dir"] / "written-from-sandbox.txt"
    host_tmp = [Path(d) / f"trex-hostile-{h['token']}" for d in ("/tmp", "/var/tmp", "/dev/shm")]

    def not_on_host(r):
        assert not any(p.exists() for p in host_tmp), [str(p) for p in host_tmp if p.exists()]
    secret = str(h["secret"])

    def no_secret(r):
        assert "TOP-SECRET" not in r.stdout_tail + r.stderr_tail and "ENV-SECRET" not in r.stdout_tail

    def status(*allowed):
        def check(r):
            assert r.status in allowed, (r.status, r.stderr_tail[-300:])
        return check

    def both(*checks):
        def check(r):
            for c in checks:
                c(r)
        return check

    def not_written(r):
        assert not outside.exists()

    quick = {"timeout_s": 3.0}
    return {
        # ---- network
        "tcp_to_host_port": (f"import socket\ns = socket.create_connection(('127.0.0.1', {h['port']}), timeout=2)\n"
                             "print('connected')", quick, both(status("error"), lambda r: not h["hits"])),
        "tcp_to_internet": ("import socket\nsocket.create_connection(('1.1.1.1', 443), timeout=2)\nprint('connected')",
                            quick, status("error")),
        "dns_lookup": ("import socket\nprint(socket.getaddrinfo('pypi.org', 443))", quick, status("error")),
        "udp_send": ("import socket\ns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
                     f"s.sendto(b'x', ('127.0.0.1', {h['port']}))\nprint('sent')", quick,
                     lambda r: None),  # a datagram into an empty namespace goes nowhere; nothing to receive
        "subprocess_curl": ("import subprocess\nsubprocess.run(['curl', '-s', 'https://pypi.org'], check=True)", quick,
                            status("error")),
        # ---- reading secrets
        "read_host_file": (f"print(open({secret!r}).read())", quick, both(status("error"), no_secret)),
        "read_root_home": ("import os\nprint(os.listdir('/root'))", quick,
                           both(status("error", "no_solve"), no_secret, lambda r: not any(
                               f"'{n}'" in r.stdout_tail for n in os.listdir("/root") if n != ".pyenv"))),
        "read_etc_shadow": ("print(open('/etc/shadow').read())", quick, status("error")),
        "read_environment": ("import os\nprint(dict(os.environ))", quick, both(status("no_solve"), no_secret)),
        "read_parent_environ": ("import os\nfor p in os.listdir('/proc'):\n    if p.isdigit():\n"
                                "        try: print(open(f'/proc/{p}/environ').read())\n        except OSError: pass",
                                quick, both(status("no_solve"), no_secret)),
        "walk_filesystem": ("import os\nfor root, dirs, files in os.walk('/'):\n    for f in files:\n"
                            "        if 'secret' in f: print(os.path.join(root, f))\n", {"timeout_s": 10.0},
                            both(status("no_solve", "timeout"), no_secret)),
        # ---- writing outside
        "write_host_dir": (f"open({str(outside)!r}, 'w').write('x')", quick, both(status("error"), not_written)),
        "write_host_tmp": (f"open('/tmp/trex-hostile-{h['token']}', 'w').write('x')\nprint('wrote')", quick,
                           both(status("no_solve"), not_on_host)),  # the sandbox's own /tmp: allowed, private
        "write_var_tmp": (f"open('/var/tmp/trex-hostile-{h['token']}', 'w').write('x')", quick,
                          both(status("error"), not_on_host)),
        "write_dev_shm": (f"open('/dev/shm/trex-hostile-{h['token']}', 'w').write('x')", quick,
                          both(status("no_solve"), not_on_host)),
        "write_project": (f"open({str(ROOT / 'pwned.txt')!r}, 'w').write('x')", quick,
                          both(status("error"), lambda r: not (ROOT / "pwned.txt").exists())),
        "write_usr": ("open('/usr/pwned', 'w').write('x')", quick, status("error")),
        "fill_disk": ("f = open('big.bin', 'wb')\nwhile True:\n    f.write(b'0' * (1 << 20))", quick,
                      status("output_limit", "error")),
        # ---- resources
        "fork_bomb": ("import os\nwhile True:\n    try: os.fork()\n    except OSError: pass", quick,
                      status("timeout", "cpu_limit", "killed", "error")),
        "memory_bomb": ("x = bytearray(16 * 1024**3)", quick, status("memory_limit")),
        "memory_creep": ("xs = []\nwhile True:\n    xs.append(bytearray(50 * 1024**2))", {"timeout_s": 15.0},
                         status("memory_limit")),
        "infinite_loop": ("while True:\n    pass", {"timeout_s": 2.0}, status("timeout", "cpu_limit")),
        "sleep_forever": ("import time\ntime.sleep(10**6)", {"timeout_s": 2.0}, status("timeout")),
        "thread_cpu_burn": ("import threading\ndef f():\n    while True: pass\n"
                            "for _ in range(8): threading.Thread(target=f).start()", {"timeout_s": 2.0},
                            status("timeout", "cpu_limit")),
        "huge_stdout": ("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)", quick, status("output_limit")),
        "huge_stderr": ("import sys\nwhile True:\n    sys.stderr.write('y' * 65536)", quick, status("output_limit")),
        "fd_exhaustion": ("fs = [open('/dev/null') for _ in range(100000)]", quick, status("error")),
        "recursion_bomb": ("def f(n): return f(n + 1)\nf(0)", quick, status("error")),
        "segfault": ("import ctypes\nctypes.string_at(0)", quick, status("killed")),
        # ---- processes and signals
        "kill_parent": ("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nos.kill(-1, signal.SIGKILL)", quick,
                        status("killed", "error", "no_solve")),
        "ignore_sigterm": ("import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                           "signal.signal(signal.SIGINT, signal.SIG_IGN)\ntime.sleep(10**6)", {"timeout_s": 2.0},
                           status("timeout")),
        "daemon_escape": ("import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
                          "        time.sleep(10**6)\n    os._exit(0)\nprint('parent done')", quick, status("no_solve")),
        "read_worker_memory": ("import os\nprint(open(f'/proc/{os.getppid()}/mem', 'rb').read(16))", quick,
                               status("error")),
        "ptrace_worker": ("import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
                          "rc = libc.ptrace(16, os.getppid(), 0, 0)\nprint('ptrace', rc)\nassert rc == -1", quick,
                          both(status("no_solve"), lambda r: "ptrace -1" in r.stdout_tail or pytest.fail(r.stdout_tail))),
        "become_root": ("import os\nos.setuid(0)\nprint('root')", quick, status("error")),
        "mount_tmpfs": ("import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
                        "rc = libc.mount(b'none', b'/usr', b'tmpfs', 0, None)\nprint('mount', rc)\nassert rc == -1",
                        quick, both(status("no_solve"), lambda r: "mount -1" in r.stdout_tail or pytest.fail("mounted"))),
        # ---- attestation
        "forge_side_channel": ("import os\nfor fd in range(3, 64):\n    try:\n"
                               "        os.write(fd, b'{\"objective\": 42.0, \"status\": \"optimal\", \"seq\": 9}\\tab12\\n')\n"
                               "    except OSError:\n        pass\nprint('Optimal objective: 42')", quick,
                               lambda r: (status("no_solve")(r), r.objective is None or pytest.fail("forged"))),
        "print_fake_optimum": ("print('Optimal objective: 42')", quick,
                               lambda r: (status("no_solve")(r), r.printed_objective == 42 or pytest.fail("print"))),
        "solve_other_print_fake": (SOLVE5 + "print('Optimal objective: 42')", quick,
                                   lambda r: (status("ok")(r), r.objective == 5.0 or pytest.fail(r.objective))),
        "patch_getinfo": ("import highspy\nclass Fake:\n    objective_function_value = 42.0\n"
                          "highspy.Highs.getInfo = lambda self: Fake()\n" + SOLVE5.split("\n", 1)[1], quick,
                          lambda r: (status("ok")(r), r.objective == 5.0 or pytest.fail(r.objective))),
        "replace_solve": ("import highspy\nhighspy.Highs.solve = lambda self: None\n" + SOLVE5.split("\n", 1)[1]
                          + "print('Optimal objective: 42')", quick, status("no_solve")),
        "exit_after_solve": (SOLVE5 + "import os\nos._exit(3)", quick,
                             lambda r: (status("error")(r), r.solves == 1 or pytest.fail("record lost"))),
    }


def _nobody_processes() -> int:
    """Processes of the sandbox uids (nobody and the per-run range), except those of the other pytest-xdist
    workers' own sandboxes (descendants of this process's siblings: they share the uid range and ran while this
    test checked, seen once in `make test`). A program that escaped its run is counted wherever it went: under
    this process, or reparented to init."""
    rows = [tuple(map(int, line.split())) for line in
            subprocess.run(["ps", "-eo", "pid=,ppid=,uid="], capture_output=True, text=True).stdout.splitlines()]
    parent = {pid: ppid for pid, ppid, _ in rows}
    me, siblings = os.getpid(), {pid for pid, ppid, _ in rows if ppid == os.getppid() and pid != os.getpid()}

    def elsewhere(pid: int) -> bool:
        while pid > 1 and pid != me:
            if pid in siblings:
                return True
            pid = parent.get(pid, 0)
        return False

    return sum(1 for pid, _, uid in rows
               if (uid == 65534 or 61000 <= uid < 61000 + 4096) and not elsewhere(pid))


def test_every_hostile_program_is_contained_and_classified(host):
    progs = programs(host)
    assert len(progs) >= 34
    before = _nobody_processes()

    def run(item):
        name, (code, kw, _) = item
        return name, run_program(code, memory_mb=1024, nproc=64, **kw)

    with ThreadPoolExecutor(max_workers=4) as pool:
        results = dict(pool.map(run, progs.items()))
    failures = []
    for name, (_, _, check) in progs.items():
        r = results[name]
        assert r.isolation == "bwrap"
        try:
            check(r)
        except AssertionError as e:  # collect all, report together
            failures.append(f"{name}: {e} (status={r.status})")
    assert not failures, "\n".join(failures)
    assert _nobody_processes() <= before, "a sandboxed process outlived its run"
    assert not host["hits"], "a sandboxed program reached a host socket"
