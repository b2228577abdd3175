"""Every layout of the parallel engine trains exactly like one process (tiny V4, fp32, fixed data, gloo).

Each run is a gloo job of ``worker.py``'s ranks, forked from a process that has imported it
(``forkrun.py``: the imports cost a fresh rank more than its steps): 5 AdamW steps, per-step losses from rank 0 and the final
parameters and buffers gathered to full tensors. Tolerance 1e-5 on both (measured: losses within ~5e-7,
weights within ~2e-6; what differs is only the order of floating-point sums).

AdamW's epsilon is 1e-6 here, not the default 1e-8: at the first layer the mHC streams are identical copies
of the embedding, so the Sinkhorn mixing weights get a gradient that is zero in exact arithmetic and ~1e-10
rounding noise in practice; AdamW divides by sqrt(v) and turns that noise into lr-sized steps of random
sign (1e-4 differences after 5 steps, for any two different summation orders). A larger epsilon keeps
those elements quiet without changing any real update measurably.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.trainer.parallel.forkrun import run_forked

WORKER = Path(__file__).with_name("worker.py")
FOUR_LAYERS = {"num_layers": 4, "layer_types": ["sliding_attention", "compressed_sparse_attention",
                                                "heavily_compressed_attention", "sliding_attention"],
               "mlp_layer_types": ["hash_moe", "moe", "moe", "moe"]}
MTP = {"mtp_layers": 1}
TRAIN = {"adam_eps": 1e-6}
MUON = {"optimizer": "muon", "muon_ns_dtype": "fp32"}  # bf16 Newton-Schulz turns 1e-7 into bf16 ulps

# (name, processes, layout, model[, train]) -- model and train variants pick the single-process reference
LAYOUTS = [
    ("DP2-FSDP", 2, {}, {}),
    ("TP2", 2, {"tp": 2}, {}),
    ("EP2", 2, {"ep": 2}, {}),
    ("EP4", 4, {"ep": 4}, {}),
    ("PP2-1F1B-MTP", 2, {"pp": 2}, MTP),  # uneven split (2+1 layers); the MTP head on the last stage
    ("PP2-interleaved", 2, {"pp": 2, "vpp": 2, "pp_schedule": "interleaved_1f1b"}, FOUR_LAYERS),
    ("PP2-ZBV", 2, {"pp": 2, "vpp": 2, "pp_schedule": "zbv"}, FOUR_LAYERS),
    ("PP2-DualPipeV", 2, {"pp": 2, "vpp": 2, "pp_schedule": "dualpipev"}, FOUR_LAYERS),
    ("PP2xEP2", 4, {"pp": 2, "ep": 2}, {}),
    ("DP2xEP2xTP2", 4, {"ep": 2, "tp": 2}, {}),
    ("PP2xTP2xEP2", 8, {"pp": 2, "ep": 2, "tp": 2}, {}),
    ("DP2xEP2xTP2-SP", 4, {"ep": 2, "tp": 2, "sequence_parallel": True}, {}),
    ("PP2xTP2-SP-MTP", 4, {"pp": 2, "tp": 2, "sequence_parallel": True}, MTP),
    ("HSDP2x2-EP2", 4, {"dp_replicate": 2, "ep": 2, "reshard_after_forward": False}, {}),  # expert replicas
    ("DP2xEP2xTP2-Muon", 4, {"ep": 2, "tp": 2}, {}, MUON),  # orthogonalises whole matrices from shards
]
LAYOUTS = [x if len(x) == 5 else (*x, {}) for x in LAYOUTS]


def run_worker(out: Path, nproc: int, layout: dict, model: dict, steps: int = 5, env: dict | None = None,
               extra: list[str] | None = None, timeout: float = 600, train: dict | None = None,
               torchrun: bool = False) -> subprocess.CompletedProcess:
    """A job of ``nproc`` ranks: forked (``forkrun.py``), or with ``torchrun`` under a real ``torchrun``."""
    args = ["--layout", json.dumps(layout), "--model", json.dumps(model), "--train", json.dumps({**TRAIN, **(train or {})}),
            "--steps", str(steps), "--out", str(out), "--ckpt", str(out / "ckpt"), *(extra or [])]
    if not torchrun:
        return run_forked(args, nproc, out / "logs", env=env, timeout=timeout)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", str(WORKER), *args]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env)


def finished(out: Path, proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads((out / "losses.json").read_text())


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    refs = {}
    for model, train in {(json.dumps(x[3], sort_keys=True), json.dumps(x[4], sort_keys=True)) for x in LAYOUTS}:
        out = tmp_path_factory.mktemp("ref")
        finished(out, run_worker(out, 1, {}, json.loads(model), extra=["--weights"], train=json.loads(train)))
        refs[model, train] = out
    return refs


@pytest.mark.parametrize("name,nproc,layout,model,train", LAYOUTS, ids=[x[0] for x in LAYOUTS])
def test_layout_equals_single_process(name, nproc, layout, model, train, references, tmp_path):
    ref = references[json.dumps(model, sort_keys=True), json.dumps(train, sort_keys=True)]
    got = finished(tmp_path, run_worker(tmp_path, nproc, layout, model, extra=["--weights"], train=train))
    want = json.loads((ref / "losses.json").read_text())
    assert sorted(got["losses"]) == sorted(want["losses"]) and len(want["losses"]) == 5
    for step, loss in want["losses"].items():
        assert abs(got["losses"][step] - loss) <= 1e-5, (name, step, got["losses"][step], loss)
    w_ref, w_got = torch.load(ref / "weights.pt"), torch.load(tmp_path / "weights.pt")
    assert set(w_ref) == set(w_got)
    worst = max(((w_got[k].float() - w_ref[k].float()).abs().max().item(), k) for k in w_ref)
    assert worst[0] <= 1e-5, (name, worst)
    assert abs(want["losses"]["5"] - want["losses"]["1"]) > 1e-3  # it trained: the comparison is not vacuous
