"""The short version of ``bench/chaos.py``: SIGKILL inside a synchronous save, inside an asynchronous save
and during the export, resume each, and end bit-identical to an uninterrupted run; then one rank of a
2-process job killed inside an async save: the job ends within seconds (not the collective timeout) and a
restart resumes from the last complete checkpoint, bit-identical. The bench runs as its own process (its
single-process runs are forked from it)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "chaos.py"


def _chaos(tmp_path: Path, *args: str) -> dict:
    out = tmp_path / "chaos.json"
    proc = subprocess.run([sys.executable, str(BENCH), "--quick", "--out", str(tmp_path / "work"), "--json", str(out),
                           *args], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_kills_in_sync_save_async_save_and_export_resume_bit_identical(tmp_path):
    r = _chaos(tmp_path, "--rank-kills", "0")
    assert r["single"] == {"ok": 3, "kills": 3}
    trials = r["trials"]
    assert [t["async"] for t in trials[:2]] == [False, True] and trials[2]["phase"] == "export:weights"
    assert trials[0]["phase"].startswith("save:") and trials[1]["phase"].startswith(("save:", "async:"))
    for t in trials:
        assert t["killed"] and t["identical"] and t["resumed_from"] == t["latest_at_kill"], t
        assert t["export_after_kill"] == "none", t  # the killed export left nothing that looks like an export


def test_killed_rank_fails_fast_and_the_restart_is_bit_identical(tmp_path):
    r = _chaos(tmp_path, "--kills", "0", "--pg-timeout", "120")
    (t,) = r["trials"]
    assert t["killed"] and not t["hung"] and t["identical"] and t["resumed_from"] == t["latest_at_kill"], t
    assert t["exit_after_kill_s"] < 30, t  # torchrun stops the job; nobody waits for the 120 s timeout
