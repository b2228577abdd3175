"""A real ``mlflow server`` on a localhost port the OS picks (SQLite store, served artifacts) for tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def reserve_port(host: str = "127.0.0.1") -> socket.socket:
    """A socket bound to a port the OS picks (port 0), held for as long as the test needs that port.

    It is bound with SO_REUSEADDR and never listens: connecting there is refused (as with no server), a
    uvicorn server (``mlflow server``, ``prefect server start``: both bind with SO_REUSEADDR) can still bind
    and listen on it, and no other socket is handed the port meanwhile -- not even between a server's stop and
    its restart. (Closing a probe socket and passing its number on would leave the port free for anyone until
    the server binds it.) ``close()`` it once the server is gone for good.
    """
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((host, 0))
    return s


def wait_healthy(url: str, proc: subprocess.Popen, wait_s: float) -> bool:
    """Poll ``url`` until it answers 200 (a server process gives no other signal that it is ready); False when
    ``proc`` exits first or ``wait_s`` passes."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return True
        except OSError:
            time.sleep(0.2)  # the poll interval, not a synchronisation
    return False


class MlflowServer:
    """``start``/``stop`` any number of times on the same port (an outage and the server's return);
    ``close`` (or leaving the ``with`` block) stops it and gives the port back."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self._port_hold = reserve_port()
        self.port = self._port_hold.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self, wait_s: float = 120) -> "MlflowServer":
        self.root.mkdir(parents=True, exist_ok=True)
        cmd = [str(Path(sys.executable).with_name("mlflow")), "server", "--backend-store-uri",
               f"sqlite:///{self.root / 'mlflow.db'}", "--artifacts-destination", str(self.root / "artifacts"),
               "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1"]
        with open(self.root / "server.log", "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        if wait_healthy(self.url + "/health", self.proc, wait_s):
            return self
        self.stop()
        raise RuntimeError(f"mlflow server did not start: {(self.root / 'server.log').read_text()[-2000:]}")

    def stop(self) -> None:
        """Kill the server (the port stays reserved: connections are refused until ``start``)."""
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()
            self.proc = None

    def close(self) -> None:
        self.stop()
        self._port_hold.close()

    def __enter__(self) -> "MlflowServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
