from kernels import registry
from trex.cli.bench import load_bench


def test_step_ab_alternates_and_restores_the_registry(capsys):
    before = registry.get("rms_norm", "cpu")
    out = load_bench("step_ab").main(["--config", "configs/tiny.yaml", "--batch", "1", "--seq", "32", "--steps", "2",
                                      "--threads", "1", "--swap", "rms_norm=kernels.rms_norm:rms_norm_formula"])
    assert out["swapped"] == ["rms_norm"] and len(out["steps"]["old"]) == len(out["steps"]["new"]) == 2
    assert out["speedup"] > 0 and "new/old speed" in capsys.readouterr().out
    assert registry.get("rms_norm", "cpu") is before


def test_step_ab_rejects_a_malformed_swap():
    import pytest

    with pytest.raises(SystemExit, match="op=module:function"):
        load_bench("step_ab").main(["--swap", "rms_norm"])
