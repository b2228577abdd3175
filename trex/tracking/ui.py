"""The local UIs (``make ui`` / ``trex ui``): a Prefect server and an MLflow server on localhost.

``start`` launches both (own process groups; logs and pids under ``<state>/ui/``), waits until they answer,
and writes ``<state>/ui.json`` with their URLs. While they are up, every ``trex`` command and every flow run
reports to them: :func:`detect` (used by the config's default tracking URI and by the CLI for
``PREFECT_API_URL``) finds them from that file with a quick health probe; when they are down, T-Rex falls
back to the SQLite MLflow store and Prefect's ephemeral API. Both servers keep their state in the state
directory: Prefect under ``<state>/prefect`` (SQLite), MLflow in ``<state>/mlflow.db`` with artifacts in
``<state>/mlartifacts`` -- the same stores the offline runs write, so the UIs show those runs too.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from functools import lru_cache
from pathlib import Path

from trex.tracking.store import keep_prefect_template, seed_prefect_db, seed_sqlite

UI_FILE = "ui.json"


def _bin(name: str) -> str:
    return str(Path(sys.executable).with_name(name))


def _healthy(url: str, timeout: float = 0.5) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status == 200
    except OSError:
        return False


def urls(host: str, prefect_port: int, mlflow_port: int) -> dict:
    return {"prefect_api": f"http://{host}:{prefect_port}/api", "prefect_ui": f"http://{host}:{prefect_port}",
            "mlflow": f"http://{host}:{mlflow_port}"}


@lru_cache(maxsize=8)
def _detect_cached(state_dir: str, bucket: int) -> dict | None:
    f = Path(state_dir) / UI_FILE
    if not f.is_file():
        return None
    try:
        info = json.loads(f.read_text())
    except ValueError:
        return None
    up = _healthy(info["mlflow"] + "/health") and _healthy(info["prefect_api"] + "/health")
    return info if up else None


def detect(state_dir: str | Path) -> dict | None:
    """The running UIs' URLs for this state directory, or None (re-probed at most every 30 s)."""
    if os.environ.get("TREX_NO_UI"):
        return None
    return _detect_cached(str(Path(state_dir).resolve()), int(time.monotonic() // 30))


def start(state_dir: str | Path, host: str = "127.0.0.1", prefect_port: int = 4200, mlflow_port: int = 5000,
          wait_s: float = 120.0) -> dict:
    state = Path(state_dir).resolve()
    logs = state / "ui"
    logs.mkdir(parents=True, exist_ok=True)
    info = urls(host, prefect_port, mlflow_port)
    env = {**os.environ, "PREFECT_HOME": str(state / "prefect"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "PREFECT_API_URL": info["prefect_api"]}
    (state / "mlartifacts").mkdir(parents=True, exist_ok=True)
    seed_sqlite(state / "mlflow.db")  # new stores: copies of migrated empty ones (trex.tracking.store)
    seed_prefect_db(state / "prefect")
    procs = {
        "prefect": [_bin("prefect"), "server", "start", "--host", host, "--port", str(prefect_port)],
        "mlflow": [_bin("mlflow"), "server", "--backend-store-uri", f"sqlite:///{state / 'mlflow.db'}",
                   "--artifacts-destination", str(state / "mlartifacts"), "--host", host, "--port", str(mlflow_port),
                   "--workers", "1"],
    }
    pids = {}
    for name, cmd in procs.items():
        with open(logs / f"{name}.log", "ab") as out:
            pids[name] = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                          start_new_session=True).pid
    info["pids"] = pids
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if _healthy(info["mlflow"] + "/health") and _healthy(info["prefect_api"] + "/health"):
            (state / UI_FILE).write_text(json.dumps(info, indent=2))
            keep_prefect_template(state / "prefect")  # the first migrated database: the template of new ones
            _detect_cached.cache_clear()
            return info
        time.sleep(1.0)
    stop(state, pids)
    raise RuntimeError(f"the UIs did not come up within {wait_s:.0f} s; see {logs}/prefect.log and mlflow.log")


def stop(state_dir: str | Path, pids: dict | None = None) -> None:
    state = Path(state_dir).resolve()
    f = state / UI_FILE
    if pids is None and f.is_file():
        pids = json.loads(f.read_text()).get("pids", {})
    for pid in (pids or {}).values():
        try:
            os.killpg(pid, signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            pass
    f.unlink(missing_ok=True)
    _detect_cached.cache_clear()
