"""A real ``mlflow server`` on a free localhost port (SQLite store, served artifacts) for tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MlflowServer:
    def __init__(self, root: Path, port: int | None = None):
        self.root, self.port = Path(root), port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self, wait_s: float = 90) -> "MlflowServer":
        self.root.mkdir(parents=True, exist_ok=True)
        cmd = [str(Path(sys.executable).with_name("mlflow")), "server", "--backend-store-uri",
               f"sqlite:///{self.root / 'mlflow.db'}", "--artifacts-destination", str(self.root / "artifacts"),
               "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1"]
        log = open(self.root / "server.log", "ab")
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"mlflow server did not start: {(self.root / 'server.log').read_text()[-2000:]}")

    def stop(self) -> None:
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()
            self.proc = None
