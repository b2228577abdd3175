"""One Prefect API server for the whole test session, shared by the subprocess tests that run flows.

Without it every ``trex lifecycle`` / ``trex retrain`` a test spawns starts Prefect's ephemeral server in its
fresh state directory: about 24 s on this 2-core machine (11 s of database migrations, then the server's own
start), paid some twenty times per suite. ``conftest.py`` starts this server once (``prefect server start
--no-services --no-ui`` on a free port, its own ``PREFECT_HOME`` in the session's state directory) when the
collected tests include any under ``tests/flows/``, and :func:`flow_env` points a subprocess at it. Tests of
the ephemeral behaviour itself (``test_python_dash_m_trex_uses_the_configured_state_dir``) and the operations
test, which runs its own server and worker, do not use it.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

API_ENV = "TREX_TEST_PREFECT_API"  # set by conftest while the shared server is up


def flow_env(strip: tuple[str, ...] = ("PREFECT_", "MLFLOW_", "TREX_")) -> dict[str, str]:
    """``os.environ`` without the variables a subprocess test must not inherit (``strip``), pointed at the
    session's Prefect server when one is up (else the subprocess starts its own ephemeral one)."""
    api = os.environ.get(API_ENV)
    env = {k: v for k, v in os.environ.items() if not k.startswith(strip)}
    if api:
        env["PREFECT_API_URL"] = api
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(home: Path, timeout: float = 180.0) -> tuple[subprocess.Popen, str]:
    """Start the server with ``PREFECT_HOME=home``; ``(process, api url)`` once ``/api/health`` answers. Its
    database starts as a copy of a migrated one where the machine has kept one (``trex.tracking.store``)."""
    from trex.tracking.store import keep_prefect_template, seed_prefect_db

    home.mkdir(parents=True, exist_ok=True)
    seed_prefect_db(home)
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_HOME=str(home), PREFECT_SERVER_ANALYTICS_ENABLED="false", PREFECT_LOGGING_LEVEL="WARNING")
    prefect = Path(sys.executable).with_name("prefect")
    log = open(home / "server.log", "wb")
    proc = subprocess.Popen([str(prefect), "server", "start", "--host", "127.0.0.1", "--port", str(port),
                             "--no-services", "--no-ui"], env=env, stdout=log, stderr=subprocess.STDOUT)
    api = f"http://127.0.0.1:{port}/api"
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the tests' Prefect server exited ({proc.returncode}): {home / 'server.log'}")
        try:
            with urllib.request.urlopen(f"{api}/health", timeout=2) as r:
                if r.status == 200:
                    keep_prefect_template(home)
                    return proc, api
        except OSError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"the tests' Prefect server did not answer within {timeout:.0f} s: "
                               f"{home / 'server.log'}")
        time.sleep(0.25)  # polling a server's health endpoint, not synchronising tests


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
