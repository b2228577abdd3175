from kernels import registry
from trex.cli.bench import load_bench


def test_step_ab_alternates_and_restores_the_registry(capsys):
    before = registry.get("rms_norm", "cpu")
    out = load_bench("step_ab").main(["--config", "configs/tiny.yaml", "--batch", "1", "--seq", "32", "--steps", "2",
                                      "--threads", "1", "--docs", "3",
                                      "--swap", "rms_norm=kernels.rms_norm:rms_norm_formula"])
    assert out["swapped"] == ["rms_norm"] and len(out["steps"]["old"]) == len(out["steps"]["new"]) == 2
    assert out["speedup"] > 0 and "new/old speed" in capsys.readouterr().out
    assert registry.get("rms_norm", "cpu") is before


def test_step_ab_rejects_a_malformed_swap():
    import pytest

    with pytest.raises(SystemExit, match="op=module:function"):
        load_bench("step_ab").main(["--swap", "rms_norm"])


def test_step_ab_patches_a_model_function_and_the_optimizer_and_restores_them(monkeypatch):
    """``--patch module:attr=module:function`` runs the old side with the replacement (and only it), restoring
    the attribute after; ``--old-adamw foreach`` gives the old side its own optimizer."""
    import torch

    from kernels import moe_chunk_math

    calls = {"eager": 0}
    real_eager = moe_chunk_math.act_eager

    def counting(*a):
        calls["eager"] += 1
        return real_eager(*a)

    monkeypatch.setattr(moe_chunk_math, "counting_act", counting, raising=False)
    before = moe_chunk_math.act
    steps: list = []
    monkeypatch.setattr(torch.optim.AdamW, "step", lambda self, *a, **k: steps.append(self.defaults["foreach"]))
    out = load_bench("step_ab").main(["--config", "configs/tiny.yaml", "--batch", "1", "--seq", "32", "--steps", "2",
                                      "--threads", "1", "--old-adamw", "foreach",
                                      "--patch", "kernels.moe_chunk_math:act=kernels.moe_chunk_math:counting_act"])
    assert out["swapped"] == ["kernels.moe_chunk_math:act", "adamw"]
    assert moe_chunk_math.act is before
    # the old side ran 3 steps (1 warm-up), each through the tiny model's two top-k MoE layers (the hash layer too)
    assert calls["eager"] >= 3 * 2
    assert steps.count(True) == 3 and len(steps) == 6  # the old side's foreach AdamW, the new side's own


def test_step_ab_rejects_a_malformed_patch():
    import pytest

    with pytest.raises(SystemExit, match="module:attr=module:function"):
        load_bench("step_ab").main(["--patch", "kernels.moe_chunk_math:act"])
    with pytest.raises(SystemExit, match="has no attribute"):
        load_bench("step_ab").main(["--patch", "kernels.moe_chunk_math:nothing=kernels.moe_chunk_math:act"])


def test_step_ab_traced_needs_compile():
    import pytest

    with pytest.raises(SystemExit):
        load_bench("step_ab").main(["--traced", "sinkhorn=kernels.sinkhorn:sinkhorn_formula"])


def test_step_ab_old_backend_runs_the_old_side_on_another_backend_and_restores_the_choice(monkeypatch):
    """``--old-backend hc_pre=reference``: the old side's steps run the reference hc_pre (hc_mixes and the Sinkhorn
    inside it are chosen then), the new side the registry's preferred C++ kernel; the overrides are restored."""
    from kernels.hc_pre import hc_pre_formula

    calls = {"reference": 0}
    real = hc_pre_formula

    def counting(*a):
        calls["reference"] += 1
        return real(*a)

    monkeypatch.setitem(registry._IMPLS["hc_pre"], "reference", counting)
    before = registry.overrides()
    out = load_bench("step_ab").main(["--config", "configs/tiny.yaml", "--batch", "1", "--seq", "32", "--steps", "2",
                                      "--threads", "1", "--old-backend", "hc_pre=reference"])
    assert out["swapped"] == ["hc_pre=reference"]
    # the old side: 3 steps (1 warm-up) x (3 blocks x 2 + the head + the MTP block's 2 + its head); the new side none
    assert calls["reference"] == 3 * 10
    assert registry.overrides() == before and registry.select("hc_pre", "cpu") == "cpp"


def test_step_ab_rejects_an_unknown_backend():
    import pytest

    with pytest.raises(SystemExit, match="op=backend"):
        load_bench("step_ab").main(["--old-backend", "hc_pre"])
    with pytest.raises(KeyError, match="no available 'triton' backend"):
        load_bench("step_ab").main(["--old-backend", "hc_pre=triton"])
