"""Safety features of the training loops: the non-finite-step guard, async checkpoints in the parallel
engine, and MFU with an accelerator missing from the peak table."""

from __future__ import annotations

import copy
import json
import logging
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from tests.trainer.helpers import random_docs, tiny_model, tiny_train_cfg
from trainer import checkpoint, metrics
from trainer.data import pack
from trainer.engines import single
from trainer.engines.single import train


def _poison(monkeypatch, bad_steps: set[int], value: float) -> None:
    """The loss (and with it every gradient) of the chosen 1-based steps becomes ``value`` (NaN or Inf)."""
    from trainer.models.deepseek_v4 import training

    calls = [0]
    real = training.loss_fn

    def loss_fn(model, batch):
        calls[0] += 1
        loss, n, mtp, n_mtp = real(model, batch)
        return (loss * value if calls[0] in bad_steps else loss), n, mtp, n_mtp

    monkeypatch.setattr(training, "loss_fn", loss_fn)  # (the engine's CrossEntropy objective calls it)


def _capture_optimizers(monkeypatch) -> list:
    made = []
    real = single.build_optimizers

    def build(model, cfg):
        made.extend(real(model, cfg))
        return made

    monkeypatch.setattr(single, "build_optimizers", build)
    return made


def _snapshot(model, opts) -> dict:
    return {"model": copy.deepcopy(model.state_dict()), "optim": [copy.deepcopy(o.state_dict()["state"]) for o in opts]}


def _same(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return a == b


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_steps_are_skipped_and_counted(tmp_path, monkeypatch, value):
    _poison(monkeypatch, {3, 4}, value)
    opts = _capture_optimizers(monkeypatch)
    data = pack(random_docs(), 32, pad_id=0)
    model = tiny_model()
    snaps, logs = {}, []
    res = train(model, data, tiny_train_cfg(steps=6, log_every=1, ckpt_every=100, max_bad_steps=3), tmp_path,
                seed=0, on_step=lambda s: snaps.__setitem__(s, _snapshot(model, opts)),
                on_log=lambda s, m: logs.append(m))
    assert res.skipped_steps == 2 and [m["skipped_steps"] for m in logs] == [0, 0, 1, 2, 2, 2]
    assert _same(snaps[2], snaps[3]) and _same(snaps[3], snaps[4])  # weights, expert bias, AdamW moments
    assert not _same(snaps[4]["model"], snaps[5]["model"])  # training goes on after the bad steps
    assert all(torch.isfinite(v).all() for v in model.state_dict().values() if v.is_floating_point())


def test_too_many_non_finite_steps_in_a_row_stop_with_a_clear_error(tmp_path, monkeypatch):
    _poison(monkeypatch, set(range(4, 100)), float("nan"))
    data = pack(random_docs(), 32, pad_id=0)
    cfg = tiny_train_cfg(steps=20, ckpt_every=3, max_bad_steps=3, async_checkpoint=True)
    with pytest.raises(FloatingPointError, match=r"3 non-finite steps in a row .*step 6.*train\.max_bad_steps=3"):
        train(tiny_model(), data, cfg, tmp_path, seed=0)
    # the step-3 checkpoint was still in flight (async): it is published before the run stops
    assert checkpoint.find_latest(tmp_path).name == "step_00000003"
    assert not list(tmp_path.glob("*.tmp"))


def test_bad_steps_that_are_not_in_a_row_do_not_stop(tmp_path, monkeypatch):
    _poison(monkeypatch, {2, 4, 6}, float("nan"))
    data = pack(random_docs(), 32, pad_id=0)
    res = train(tiny_model(), data, tiny_train_cfg(steps=7, ckpt_every=100, max_bad_steps=2), tmp_path, seed=0)
    assert res.skipped_steps == 3 and res.steps == 7


def test_unknown_accelerator_peak_gives_unknown_mfu_with_one_warning(tmp_path, monkeypatch):
    monkeypatch.setattr(metrics, "_warned", set())
    with monkeypatch.context() as m, warnings.catch_warnings(record=True) as w:
        m.setattr(torch.cuda, "is_available", lambda: True)
        m.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA B300 SXM6")
        warnings.simplefilter("always")
        assert metrics.training_peak_flops("cuda") is None
        assert metrics.training_peak_flops("cuda") is None
        assert metrics.training_peak_flops("cuda", name="h100") == metrics.PEAK_BF16["h100"]
        with pytest.raises(KeyError):  # the explicit lookup still says what is missing
            metrics.peak_flops("cuda")
    assert [str(x.message) for x in w if "MFU unknown" in str(x.message)] == \
        ["MFU unknown: no peak known for 'nvidia b300 sxm6'; set TREX_DEVICE_PEAK"]

    # a training run on such a device: trains, logs no mfu, reports it as unknown, warns once
    monkeypatch.setenv("TREX_DEVICE_PEAK", "b300")
    data = pack(random_docs(), 32, pad_id=0)
    logs = []
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        res = train(tiny_model(), data, tiny_train_cfg(steps=4, log_every=1, ckpt_every=100), tmp_path, seed=0,
                    on_log=lambda s, m: logs.append(m))
    assert res.steps == 4 and res.mfu is None and len(logs) == 4
    assert not any("mfu" in m for m in logs)
    assert len([x for x in w if "MFU unknown" in str(x.message)]) == 1


def test_known_peak_still_gives_mfu(tmp_path, monkeypatch):
    monkeypatch.setenv("TREX_DEVICE_PEAK", "1e12")
    logs = []
    res = train(tiny_model(), pack(random_docs(), 32, pad_id=0), tiny_train_cfg(steps=2, log_every=1, ckpt_every=100),
                tmp_path, seed=0, on_log=lambda s, m: logs.append(m))
    assert res.mfu > 0 and all(m["mfu"] > 0 for m in logs)


def test_parallel_engine_guard_async_checkpoint_and_unknown_peak(tmp_path):
    """A 2-process gloo job (``parallel/safety_worker.py``): skip and count, stop after N in a row on every
    rank, async checkpoints that resume bit-identically, MFU unknown."""
    worker = Path(__file__).parent / "parallel" / "safety_worker.py"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("TREX_DEVICE_PEAK", None)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           str(worker), "--out", str(tmp_path)], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    r = json.loads((tmp_path / "result.json").read_text())
    skip = r["skip"]
    assert skip["skipped"] == 2 and skip["logged_skipped"] == [0, 0, 1, 2, 2, 2]
    assert skip["changed_by_skipped"] == [] and skip["changed_after"]
    assert skip["mfu"] is None and not skip["mfu_logged"]
    assert r["stop"] and "2 non-finite steps in a row" in r["stop"] and "train.max_bad_steps=2" in r["stop"]
    assert r["stop_all_ranks"] and r["stop_latest"] == "step_00000002"
    a = r["async"]
    assert a["first_latest"] == "step_00000004" and a["resumed_from"] == 4 and a["bit_identical"]
    assert a["complete"] and a["dirs"] == ["latest", "step_00000004", "step_00000006"], a["dirs"]


def test_cpu_peak_is_measured_and_cached_per_dtype_threads_and_capability(tmp_path, monkeypatch):
    """The CPU peak is measured in the run's dtype (bf16 matmuls are emulated, far slower than fp32, on CPUs
    without native bf16), cached per thread count, dtype and CPU capability; an unknown dtype is an error."""
    monkeypatch.setenv("TREX_STATE_DIR", str(tmp_path))
    monkeypatch.delenv("TREX_DEVICE_PEAK", raising=False)
    measured = []

    def fake(n=1024, repeats=5, dtype=torch.float32, budget_s=2.0):
        measured.append(dtype)
        return {torch.float32: 1e11, torch.bfloat16: 4e11}[dtype]

    monkeypatch.setattr(metrics, "measure_cpu_peak", fake)
    monkeypatch.setattr(metrics, "cpu_capability", lambda: "AVX512")
    assert metrics.peak_flops("cpu") == 1e11 and metrics.peak_flops("cpu", dtype="bf16") == 4e11
    assert metrics.peak_flops("cpu", dtype="bf16") == 4e11 and measured == [torch.float32, torch.bfloat16]
    threads = torch.get_num_threads()
    cached = json.loads((tmp_path / "cpu_peak.json").read_text())
    assert cached == {f"{threads}:fp32:AVX512": 1e11, f"{threads}:bf16:AVX512": 4e11}
    monkeypatch.setattr(metrics, "cpu_capability", lambda: "AVX2")  # another machine: measured again
    assert metrics.peak_flops("cpu", dtype="bf16") == 4e11 and len(measured) == 3
    assert metrics.peak_flops("cpu", dtype="bf16", fresh=True) == 4e11 and len(measured) == 4  # a benchmark's probe
    with pytest.raises(KeyError, match="dtype 'fp8'"):
        metrics.peak_flops("cpu", dtype="fp8")


def test_cpu_peak_probe_measures_both_dtypes():
    fp32 = metrics.measure_cpu_peak(n=128, repeats=2)
    bf16 = metrics.measure_cpu_peak(n=128, repeats=2, dtype=torch.bfloat16, budget_s=0.5)
    assert fp32 > 1e6 and bf16 > 1e6


def test_cpu_peaks_apart_measure_in_a_child_process(tmp_path, monkeypatch):
    monkeypatch.setenv("TREX_STATE_DIR", str(tmp_path))
    monkeypatch.delenv("TREX_DEVICE_PEAK", raising=False)
    peaks = metrics.cpu_peaks_apart(1, ("fp32",), probes=2)
    assert list(peaks) == ["fp32"] and peaks["fp32"] > 1e6
    assert (tmp_path / "cpu_peak.json").is_file()  # the child's measurement is cached for the next reader


def test_cpu_peak_cache_is_replaced_whole_and_a_torn_one_is_measured_again(tmp_path, monkeypatch, caplog):
    """Test processes measure at once: a cache another writer left torn (two JSON objects run together, as a
    non-atomic write produced under ``make test -n 3``) is measured again with a warning instead of stopping
    every training run that reads it; writes go through a temporary file and a rename."""
    monkeypatch.setenv("TREX_STATE_DIR", str(tmp_path))
    monkeypatch.delenv("TREX_DEVICE_PEAK", raising=False)
    monkeypatch.setattr(metrics, "measure_cpu_peak", lambda dtype=torch.float32, **_: 2e11)
    monkeypatch.setattr(metrics, "cpu_capability", lambda: "AVX512")
    f = tmp_path / "cpu_peak.json"
    f.write_text('{"1:fp32:AVX512": 7.8e10, "1:bf16:AVX512": 2e11}}')
    with caplog.at_level(logging.WARNING, logger=metrics.__name__):
        assert metrics.peak_flops("cpu") == 2e11
    assert "unreadable CPU peak cache" in caplog.text and str(f) in caplog.text
    assert json.loads(f.read_text()) == {f"{torch.get_num_threads()}:fp32:AVX512": 2e11}
    assert [p.name for p in tmp_path.iterdir()] == ["cpu_peak.json"]  # no temporary file left behind
