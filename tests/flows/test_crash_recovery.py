"""Crash recovery: kill the lifecycle during CPT, run the same command again.

Finished stages come from Prefect's cache, CPT resumes from its last checkpoint, and MLflow holds one CPT
run (resumed, tagged) and one flow run -- not two silent duplicates.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.flows.test_lifecycle_e2e import ROOT, runs_of, trex
from tests.prefect_server import flow_env

STEPS = 20  # the kill comes at step ~4-6 of them: 7+ checkpoints from the end, which a 0.1 s poll cannot miss
SETS = ["--set", f"train.cpt.steps={STEPS}", "--set", "train.cpt.ckpt_every=2", "--set", "train.cpt.log_every=2"]


@pytest.mark.slow
def test_kill_during_cpt_then_rerun_resumes(tmp_path):
    state = tmp_path / "state"
    env = flow_env()
    cmd = [sys.executable, "-m", "trex.cli", "lifecycle", "--config", "configs/micro.yaml", *SETS,
           "--set", f"run.state_dir={state}"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.monotonic() + 300
    killed_at = None
    while time.monotonic() < deadline and proc.poll() is None:
        # published checkpoints only: a staging directory (step_N.tmp) holds COMPLETE just before its rename
        done = [int(p.name[5:]) for p in state.glob("outputs/cpt/*/checkpoints/step_*")
                if p.name[5:].isdigit() and (p / "COMPLETE").is_file()]
        if done and max(done) >= 4:
            killed_at = max(done)
            os.killpg(proc.pid, signal.SIGKILL)
            break
        time.sleep(0.1)
    proc.wait()
    assert killed_at is not None, "CPT never checkpointed (or the run ended before the kill)"

    again = trex(["lifecycle", "--config", "configs/micro.yaml", *SETS], state)
    assert again.returncode == 0, again.stderr[-5000:]
    c, runs = runs_of(state)
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    assert len(parents) == 1, [(r.info.run_name, r.info.status) for r in parents]
    parent = parents[0]
    assert parent.info.status == "FINISHED" and parent.data.tags["trex.resumed"] == "1"
    names = [r.info.run_name for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert "curate (cached)" in names and "tokenizer (cached)" in names  # finished before the kill: cached
    cpt = [r for r in runs if r.info.run_name == "cpt"]
    assert len(cpt) == 1 and cpt[0].info.status == "FINISHED" and cpt[0].data.tags["trex.resumed"] == "1"
    assert cpt[0].data.metrics["resumed_from"] >= killed_at
    steps = sorted(m.step for m in c.get_metric_history(cpt[0].info.run_id, "loss"))
    assert steps[-1] == STEPS and steps[0] == 2  # one run holds the curve from before and after the crash
