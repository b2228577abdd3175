"""``trex train``: the native parallel engine from the CLI (a torchrun job under the config's layout)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.flows.test_lifecycle_e2e import trex


def test_bad_layout_is_rejected_before_launch(tmp_path):
    r = trex(["train", "cpt", "--data", str(tmp_path), "--config", "configs/micro.yaml", "--nproc-per-node", "3",
              "--set", "parallel.ep=2"], tmp_path / "state")
    assert r.returncode == 2 and "parallel.ep=2 must divide parallel.dp_shard=3" in r.stderr


@pytest.mark.slow
def test_train_cpt_two_processes_expert_parallel(tmp_path):
    state = tmp_path / "state"
    cur = trex(["curate", "cpt", "--config", "configs/micro.yaml"], state)
    assert cur.returncode == 0, cur.stderr[-3000:]
    data = cur.stdout.strip().splitlines()[-1]
    r = trex(["train", "cpt", "--data", data, "--config", "configs/micro.yaml", "--nproc-per-node", "2",
              "--set", "parallel.ep=2"], state)
    assert r.returncode == 0, r.stderr[-5000:]
    out = Path(r.stdout.strip().splitlines()[-1])
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["summary"]["steps"] == 4 and (out / "export" / "model.safetensors").is_file()
    assert not any(f.startswith("parallel/") for f in manifest["files"])  # job files stay out of the hash
    spec = json.loads((state / "outputs" / "jobs" / f"cpt-{out.name}" / "spec.json").read_text())
    assert spec["parallel"]["ep"] == 2 and spec["parallel"]["nproc_per_node"] == 2
