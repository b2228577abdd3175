import json
import subprocess
import sys
from types import SimpleNamespace

from trex.cli.bench import load_bench


def test_kernel_split_sorts_self_time_into_gemm_attention_and_the_rest():
    ev = [SimpleNamespace(key=k, self_cpu_time_total=us) for k, us in [
        ("aten::mm", 4000), ("aten::bmm", 1000), ("aten::_scaled_dot_product_flash_attention_for_cpu", 2000),
        ("aten::_softmax_backward_data", 500), ("aten::mul", 1500), ("aten::copy_", 1000)]]
    split = load_bench("model_bench").kernel_split(ev)
    assert split == {"gemm": 5.0, "attention": 2.5, "other": 2.5, "total": 10.0}


def test_breakdown_bounds_the_native_over_hf_ratio_and_profile_writes_the_top_ops(tmp_path):
    # a script run (its engines run in spawned processes, which need the module importable by path)
    proc = subprocess.run([sys.executable, "bench/model_bench.py", "--batch", "1", "--seq", "64", "--steps", "1",
                           "--rounds", "1", "--threads", "1", "--breakdown", "--profile", str(tmp_path),
                           "--set", "model.hidden_size=64"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    native, hf = out["rows"]["native"], out["rows"]["hf"]
    for row in (native, hf):
        sp = row["split_ms"]
        assert sp["total"] > 0 and abs(sp["gemm"] + sp["attention"] + sp["other"] - sp["total"]) < 1e-6
    assert native["ratio_bound"] == hf["split_ms"]["total"] / (native["split_ms"]["gemm"]
                                                              + native["split_ms"]["attention"])
    assert "native / HF bound if native's 'other' time were zero" in proc.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["profile_hf_fp32.txt", "profile_native_fp32.txt"]
    table = (tmp_path / "profile_native_fp32.txt").read_text()
    assert "aten::mm" in table and "Self CPU" in table
