"""Start the ranks of ``worker.py`` as forks of one process that has already imported it.

A fresh rank spends ~5-6 s of CPU importing torch, DTensor, DCP and pipelining before its first step (5.3 s
measured on 2 AVX2 cores: more than half of a 5-step PP2xTP2xEP2 job). The layout tests start some 70 ranks,
so each pytest worker keeps one ``multiprocessing`` fork server with ``worker.py`` preloaded and forks every
rank from it: the same rank code, process group (gloo over a TCP store on a free port, torchrun's environment
variables) and exit path, without the imports. Jobs whose subject is the launch itself -- a killed rank
ending the job, the product's ``trainer.torchrun`` -- still run under ``torchrun``.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import subprocess
import sys
import time
from multiprocessing.connection import wait
from pathlib import Path

_CTX = None


def _context():
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(["tests.trainer.parallel.worker"])
    return _CTX


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(argv: list[str], env: dict[str, str], log: str) -> None:
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ.update(env)
    sys.argv = ["worker.py", *argv]
    from tests.trainer.parallel import worker

    worker.main()  # ends the process (exit_rank)


def run_forked(argv: list[str], nproc: int, log_dir: Path, env: dict[str, str] | None = None,
               timeout: float = 600) -> subprocess.CompletedProcess:
    """Run ``worker.py argv`` on ``nproc`` forked ranks; like ``torchrun``, a rank that fails ends the others.
    Returns a ``CompletedProcess`` whose output is every rank's log, rank by rank."""
    log_dir.mkdir(parents=True, exist_ok=True)
    port = str(_free_port())
    procs, logs = [], []
    for rank in range(nproc):
        rank_env = {**(env or {}), "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc),
                    "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        logs.append(log_dir / f"rank{rank}.log")
        p = _context().Process(target=_rank, args=(argv, rank_env, str(logs[-1])), daemon=True)
        p.start()
        procs.append(p)
    deadline = time.monotonic() + timeout
    timed_out = False
    while alive := [p for p in procs if p.exitcode is None]:
        failed = any(p.exitcode for p in procs)
        timed_out = time.monotonic() > deadline
        if failed or timed_out:
            for p in alive:
                p.kill()
            break
        wait([p.sentinel for p in alive], timeout=max(0.0, deadline - time.monotonic()))  # returns at an exit
    for p in procs:
        p.join()
    out = "".join(f"--- rank {i} (exit {p.exitcode}) ---\n{log.read_text() if log.exists() else ''}"
                  for i, (p, log) in enumerate(zip(procs, logs)))
    if timed_out:
        raise subprocess.TimeoutExpired(["worker.py", *argv], timeout, output=out)
    code = next((p.exitcode for p in procs if p.exitcode), 0)
    return subprocess.CompletedProcess(["worker.py", *argv], code, stdout="", stderr=out)
