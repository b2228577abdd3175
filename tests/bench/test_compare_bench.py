"""``bench/compare_bench.py``'s harness: a layout whose job fails is run again once, and the failure is reported
in the result (gloo jobs can abort in teardown after their measurement); a second failure stops the benchmark."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from trainer.torchrun import EngineError

ROOT = Path(__file__).resolve().parents[2]


def _bench():
    spec = importlib.util.spec_from_file_location("compare_bench_under_test", ROOT / "bench" / "compare_bench.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _fake_run(fail_first: int):
    calls = []

    def run_layout(engine, nproc, *_a, **_k):
        calls.append((engine, nproc))
        if len(calls) <= fail_first:
            raise EngineError("python -m torch.distributed.run ... failed (exit 1)\nterminate called without an "
                              "active exception")
        steps = [{"step": s, "loss": 7.0 - s, "tokens_per_s": 1000.0 * nproc, "mfu": 0.1} for s in (1, 2, 3)]
        return {"per_step": steps, "final_loss": 4.0, "peak_mem_mb": [100.0] * nproc, "wall_s": 1.0}

    return run_layout, calls


def test_a_failed_job_is_run_again_once_and_reported(tmp_path, monkeypatch):
    bench = _bench()
    run_layout, calls = _fake_run(fail_first=1)
    monkeypatch.setattr(bench, "run_layout", run_layout)
    monkeypatch.setattr(bench, "machine_peak", lambda cores, dtype="fp32": 1e11)
    result = bench.compare("configs/tiny.yaml", steps=3, batch=2, seq=16, rounds=1, layouts="native:1,deepspeed:1",
                           out=str(tmp_path), log_mlflow=False)
    assert calls == [("native", 1), ("native", 1), ("deepspeed", 1)]
    assert [f["layout"] for f in result["failures"]] == ["native:1"]
    assert "terminate called" in result["failures"][0]["error"]
    assert result["ratios"]["native1_over_deepspeed1"] == pytest.approx(1.0)
    assert result["compiled"] is False  # tiny's train.cpt.compile: both engines eager, and the header says so
    assert result["rows"]["native:1"]["tokens_per_s_steps"] == [[1000.0] * 3]  # every step kept, the first too


def test_a_job_that_fails_twice_stops_the_benchmark(tmp_path, monkeypatch):
    bench = _bench()
    run_layout, _ = _fake_run(fail_first=2)
    monkeypatch.setattr(bench, "run_layout", run_layout)
    monkeypatch.setattr(bench, "machine_peak", lambda cores, dtype="fp32": 1e11)
    with pytest.raises(EngineError):
        bench.compare("configs/tiny.yaml", steps=3, batch=2, seq=16, rounds=1, layouts="native:1",
                      out=str(tmp_path), log_mlflow=False)


def test_the_jobs_run_under_the_wait_policy_asked_for_and_the_result_says_which(tmp_path, monkeypatch):
    import trainer.torchrun

    bench = _bench()
    envs = []

    def launch(spec, workdir, nproc, on_metrics=None, on_line=None, target=None, env=None):
        envs.append(env)
        for s in (1, 2, 3):
            on_metrics(s, {"loss": 7.0 - s, "tokens_per_s": 1000.0, "mfu": 0.1})
        return {"final_loss": 4.0, "peak_mem_mb": [100.0] * nproc}

    monkeypatch.setattr(trainer.torchrun, "launch", launch)
    monkeypatch.setattr(bench, "machine_peak", lambda cores, dtype="fp32": 1e11)
    for asked, expected in ((None, "ACTIVE"), ("passive", "PASSIVE")):
        envs.clear()
        kw = {} if asked is None else {"wait_policy": asked}
        result = bench.compare("configs/tiny.yaml", steps=3, batch=2, seq=16, rounds=1, layouts="native:1,deepspeed:2",
                               out=str(tmp_path / expected), log_mlflow=False, **kw)
        assert [e["OMP_WAIT_POLICY"] for e in envs] == [expected, expected]
        assert result["omp_wait_policy"] == expected
    with pytest.raises(ValueError, match="wait policy"):
        bench.compare("configs/tiny.yaml", steps=3, batch=2, seq=16, rounds=1, layouts="native:1",
                      out=str(tmp_path / "bad"), log_mlflow=False, wait_policy="spin")


def test_layouts_take_integer_and_named_parallel_keys():
    """``engine:N[:key=value/...]``: integers stay integers (0 for a false flag), names stay strings."""
    bench = _bench()
    assert bench.parse_layout("native:2:reshard_after_forward=0/reduce_dtype=bf16") == (
        "native", 2, {"reshard_after_forward": 0, "reduce_dtype": "bf16"})
    assert bench.parse_layout("deepspeed:1") == ("deepspeed", 1, {})
    with pytest.raises(ValueError, match="expected native"):
        bench.parse_layout("fsdp:2")


def test_each_jobs_checkpoint_is_removed_once_its_metrics_are_read(tmp_path, monkeypatch):
    """A campaign at bench_20m wrote ~0.7 GB of weights and optimizer state per job and kept them all (~8 GB):
    the job's ``ckpt`` directory goes once the job returns, its other files and the comparison's JSON stay."""
    import trainer.torchrun

    bench = _bench()
    seen = []

    def launch(spec, workdir, nproc, on_metrics=None, on_line=None, target=None, env=None):
        ckpt = Path(workdir) / "ckpt" / "step_00000003"
        ckpt.mkdir(parents=True)
        (ckpt / "weights.bin").write_bytes(b"0" * 1024)
        (Path(workdir) / "job.log").write_text("ran")
        seen.append(Path(workdir))
        for s in (1, 2, 3):
            on_metrics(s, {"loss": 7.0 - s, "tokens_per_s": 1000.0, "mfu": 0.1})
        return {"final_loss": 4.0, "peak_mem_mb": [100.0] * nproc}

    monkeypatch.setattr(trainer.torchrun, "launch", launch)
    monkeypatch.setattr(bench, "machine_peak", lambda cores, dtype="fp32": 1e11)
    bench.compare("configs/tiny.yaml", steps=3, batch=2, seq=16, rounds=2, layouts="native:1,deepspeed:2",
                  out=str(tmp_path), log_mlflow=False)
    assert len(seen) == 4
    for workdir in seen:
        assert not (workdir / "ckpt").exists() and (workdir / "job.log").read_text() == "ran"
    assert (tmp_path / "compare.json").exists()


def test_each_ratio_comes_with_its_ceiling_one_over_the_baselines_mfu(tmp_path, monkeypatch, capsys):
    """Same FLOPs per token, one peak: native / baseline tokens/s is a ratio of MFUs, so a native step at 100 %
    of the peak would reach ``1 / baseline MFU``: the result, the printed table and MLflow's metrics carry it;
    with a device's peak per process (``TREX_DEVICE_PEAK``) or none (MFU unknown) there is no ceiling."""
    bench = _bench()
    mfu = {"native": 0.5, "deepspeed": 0.4}
    speed = {"native": 500.0, "deepspeed": 400.0}

    def run_layout(engine, nproc, *_a, **_k):
        steps = [{"step": s, "loss": 7.0 - s, "tokens_per_s": speed[engine], "mfu": mfu[engine]}
                 for s in (1, 2, 3)]
        return {"per_step": steps, "final_loss": 4.0, "peak_mem_mb": [100.0] * nproc, "wall_s": 1.0}

    monkeypatch.setattr(bench, "run_layout", run_layout)
    monkeypatch.setattr(bench, "machine_peak", lambda cores, dtype="fp32": 1e11)
    result = bench.compare("configs/tiny.yaml", steps=3, batch=2, seq=16, rounds=1,
                           layouts="native:1,native:2:reshard_after_forward=0,deepspeed:1", out=str(tmp_path),
                           log_mlflow=False)
    assert result["ratios"] == pytest.approx({"native1_over_deepspeed1": 1.25,
                                              "native2reshard_after_forward0_over_deepspeed1": 1.25})
    assert result["ratio_ceilings"] == pytest.approx({"native1_over_deepspeed1": 2.5,
                                                      "native2reshard_after_forward0_over_deepspeed1": 2.5})
    out = capsys.readouterr().out
    assert "native1 / deepspeed1: 1.25x  (ceiling 2.50x: the baseline runs at 40.0% of the peak)" in out
    monkeypatch.setattr(bench, "machine_peak", lambda cores, dtype="fp32": None)  # TREX_DEVICE_PEAK names one
    result = bench.compare("configs/tiny.yaml", steps=3, batch=2, seq=16, rounds=1, layouts="native:1,deepspeed:2",
                           out=str(tmp_path / "device_peak"), log_mlflow=False)
    assert result["ratio_ceilings"] == {} and result["ratios"]["native1_over_deepspeed2"] == pytest.approx(1.25)
    mfu.update(native=None, deepspeed=None)  # an accelerator missing from the peak table
    result = bench.compare("configs/tiny.yaml", steps=3, batch=2, seq=16, rounds=1, layouts="native:1,deepspeed:1",
                           out=str(tmp_path / "no_peak"), log_mlflow=False)
    assert result["rows"]["native:1"]["mfu"] is None and result["ratio_ceilings"] == {}
    assert "ceiling" not in capsys.readouterr().out.split("throughput")[-1]
