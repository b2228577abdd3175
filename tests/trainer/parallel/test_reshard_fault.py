"""Checkpoints reshard across layouts; a dead rank ends the whole job quickly."""

from __future__ import annotations

import shutil
import time

from tests.trainer.parallel.test_equivalence import finished, run_worker


def test_save_pp2xep2_resume_ep4_and_single(tmp_path):
    straight = tmp_path / "straight"
    want = finished(straight, run_worker(straight, 1, {}, {}, steps=10))["losses"]
    first = tmp_path / "pp2xep2"
    got = finished(first, run_worker(first, 4, {"pp": 2, "ep": 2}, {}, steps=10,
                                     extra=["--stop-after", "5", "--ckpt-every", "5"]))
    assert sorted(got["losses"], key=int) == [str(s) for s in range(1, 6)]
    for layout, nproc, name in (({"ep": 4}, 4, "ep4"), ({}, 1, "single")):
        out = tmp_path / name
        shutil.copytree(first / "ckpt", out / "ckpt")
        res = finished(out, run_worker(out, nproc, layout, {}, steps=10))
        assert res["resumed_from"] == 5
        assert sorted(res["losses"], key=int) == [str(s) for s in range(6, 11)]
        for step, loss in res["losses"].items():
            assert abs(loss - want[step]) <= 1e-5, (name, step, loss, want[step])


def test_killed_rank_ends_job_within_timeout(tmp_path):
    timeout_s = 20
    t0 = time.monotonic()
    proc = run_worker(tmp_path, 2, {"ep": 2}, {}, steps=10, timeout=120, torchrun=True,
                      env={"TREX_FAULT_RANK": "1", "TREX_FAULT_STEP": "2", "TREX_TEST_TIMEOUT": str(timeout_s)})
    elapsed = time.monotonic() - t0
    assert proc.returncode != 0
    assert "TREX_FAULT" in proc.stderr + proc.stdout
    assert elapsed < timeout_s + 30, elapsed  # start-up (~5 s) + the collective timeout at most
    assert not (tmp_path / "losses.json").exists()


def test_bf16_fsdp_mixed_precision_with_ep_and_tp_tracks_fp32(tmp_path):
    """bf16 compute (FSDP2 param_dtype bf16, fp32 reduce; expert shards cast) under DP2xEP2xTP2 and
    block recomputation: the losses stay within bf16 noise of the fp32 single-process run."""
    ref = finished(tmp_path / "fp32", run_worker(tmp_path / "fp32", 1, {}, {}))["losses"]
    got = finished(tmp_path / "bf16", run_worker(tmp_path / "bf16", 4, {"ep": 2, "tp": 2}, {},
                                                 train={"dtype": "bf16", "activation_checkpointing": "block"}))
    for step, loss in ref.items():
        assert abs(got["losses"][step] - loss) < 5e-3, (step, got["losses"][step], loss)


def test_bf16_gradient_reduction_tracks_fp32(tmp_path):
    """``parallel.reduce_dtype: bf16`` (FSDP2 reduces gradients in bf16, as DeepSpeed's bf16 mode does): DP2 bf16
    training stays within bf16 noise of the fp32 single-process run, and the switch reaches FSDP (its losses
    are not those of the fp32 reduction)."""
    ref = finished(tmp_path / "fp32", run_worker(tmp_path / "fp32", 1, {}, {}))["losses"]
    runs = {r: finished(tmp_path / f"dp2_{r}", run_worker(tmp_path / f"dp2_{r}", 2, {"reduce_dtype": r}, {},
                                                         train={"dtype": "bf16"}))["losses"] for r in ("fp32", "bf16")}
    for step, loss in ref.items():
        for r in runs:
            assert abs(runs[r][step] - loss) < 5e-3, (r, step, runs[r][step], loss)
    assert runs["bf16"] != runs["fp32"]


def test_bf16_pipeline_without_data_parallelism_tracks_fp32(tmp_path):
    """PP2 in bf16 with no data parallelism (no FSDP mixed precision): the stages exchange the bf16 streams in
    bf16 buffers (the schedule had declared fp32 ones from FSDP's parameter dtype: every loss was NaN), and with
    ``hc_streams_fp32`` the fp32 streams in fp32 buffers; both within bf16 noise of the fp32 single process."""
    ref = finished(tmp_path / "fp32", run_worker(tmp_path / "fp32", 1, {}, {}))["losses"]
    for streams_fp32 in (False, True):
        name = f"pp2_bf16_{streams_fp32}"
        got = finished(tmp_path / name, run_worker(tmp_path / name, 2, {"pp": 2}, {"hc_streams_fp32": streams_fp32},
                                                   train={"dtype": "bf16"}))["losses"]
        for step, loss in ref.items():
            assert abs(got[step] - loss) < 5e-3, (streams_fp32, step, got[step], loss)
