import os
import warnings

import pytest
import torch

from tests.trainer.helpers import random_docs, tiny_model, tiny_train_cfg
from trainer import checkpoint
from trainer.data import IGNORE, pack, trim_padding
from trainer.export import export, load_export, same_weights
from trainer.engines.single import train


def test_pack_masks_and_boundaries():
    docs = [([1, 2, 3, 4], [0, 0, 1, 1]), ([5, 6, 7], [1, 1, 1]), ([8] * 40, [1] * 40)]
    p = pack(docs, 10, pad_id=0)
    assert p.stats["truncated"] == 1 and p.stats["documents"] == 3
    row = p.labels[0].tolist()
    # doc 1: labels only where the *next* token is in the loss mask; no label across the boundary
    assert row[:4] == [IGNORE, 3, 4, IGNORE] and row[4:7] == [6, 7, IGNORE]
    assert p.doc_ids[0].tolist()[:8] == [0, 0, 0, 0, 1, 1, 1, -1]
    assert p.position_ids[0].tolist()[:7] == [0, 1, 2, 3, 0, 1, 2]


def test_training_reduces_loss(tmp_path):
    data = pack(random_docs(16), 32, pad_id=0)
    m = tiny_model()
    logs = []
    train(m, data, tiny_train_cfg(steps=30, ckpt_every=100), tmp_path, seed=0, on_log=lambda s, x: logs.append(x["loss"]))
    assert logs[-1] < logs[0] * 0.8


@pytest.mark.parametrize("async_checkpoint", [False, True])
def test_exact_resume_is_bit_identical(tmp_path, async_checkpoint):
    data = pack(random_docs(), 32, pad_id=0)
    cfg = tiny_train_cfg(async_checkpoint=async_checkpoint)
    straight = tiny_model()
    train(straight, data, cfg, tmp_path / "a", seed=1)
    resumed = tiny_model()
    r1 = train(resumed, data, cfg, tmp_path / "b", seed=1, stop_after=10)  # as if killed after step 10
    assert r1.steps == 10
    fresh = tiny_model(seed=99)  # a new process: different init, state comes from the checkpoint
    r2 = train(fresh, data, cfg, tmp_path / "b", seed=1)
    assert r2.resumed_from == 10
    assert same_weights(straight, fresh)


def test_torn_checkpoint_falls_back(tmp_path):
    data = pack(random_docs(), 32, pad_id=0)
    m = tiny_model()
    train(m, data, tiny_train_cfg(steps=10, keep_last=3), tmp_path, seed=0)
    latest = checkpoint.find_latest(tmp_path)
    assert latest.name == "step_00000010"
    os.remove(latest / "COMPLETE")  # torn: killed before the marker was written
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        found = checkpoint.find_latest(tmp_path)
    assert found.name == "step_00000005" and any("torn checkpoint" in str(x.message) for x in w)
    r = train(tiny_model(), data, tiny_train_cfg(steps=10, keep_last=3), tmp_path, seed=0)
    assert r.resumed_from == 5


def test_retention_keeps_last_n(tmp_path):
    data = pack(random_docs(), 32, pad_id=0)
    train(tiny_model(), data, tiny_train_cfg(steps=20, ckpt_every=5, keep_last=2), tmp_path, seed=0)
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_00000015", "step_00000020"]
    assert (tmp_path / "latest").read_text().strip() == "step_00000020"


def test_export_round_trip(tmp_path):
    m = tiny_model(seed=5)
    (tmp_path / "tok").mkdir()
    export(m, tmp_path / "tok", tmp_path / "exp")
    back = load_export(tmp_path / "exp")
    assert same_weights(m, back)
    ids = torch.randint(0, 97, (2, 7))
    m.eval()
    torch.testing.assert_close(m(ids), back(ids))


KILL_SCRIPT = """
import os, signal, sys
sys.path.insert(0, {root!r})
from tests.trainer.helpers import random_docs, tiny_model, tiny_train_cfg
from trainer.data import pack
from trainer.engines.single import train
data = pack(random_docs(), 32, pad_id=0)
def on_step(step):
    if step == 11:  # the step-10 checkpoint is on disk; die mid-run with no chance to clean up
        os.kill(os.getpid(), signal.SIGKILL)
train(tiny_model(), data, tiny_train_cfg(optimizer={opt!r}), {ckpt!r}, seed=1, on_step=on_step)
"""


def test_hard_kill_then_resume_is_bit_identical_to_straight_training(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[2])
    data = pack(random_docs(), 32, pad_id=0)
    for opt in ("adamw", "muon"):
        straight = tiny_model()
        train(straight, data, tiny_train_cfg(optimizer=opt), tmp_path / f"a-{opt}", seed=1)
        ckpt = str(tmp_path / f"b-{opt}")
        proc = subprocess.run([sys.executable, "-c", KILL_SCRIPT.format(root=root, opt=opt, ckpt=ckpt)],
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == -9, proc.stderr[-2000:]
        assert checkpoint.find_latest(ckpt).name == "step_00000010"
        resumed = tiny_model(seed=99)
        r = train(resumed, data, tiny_train_cfg(optimizer=opt), ckpt, seed=1)
        assert r.resumed_from == 10 and same_weights(straight, resumed), opt


def test_mtp_wsd_and_activation_checkpointing(tmp_path):
    from trainer.optim import LrSchedule

    f = LrSchedule(tiny_train_cfg(steps=100, warmup_steps=10, schedule="wsd", decay_fraction=0.2, min_lr_ratio=0.1))
    assert f(5) < 1 and f(10) == f(79) == 1.0 and 0.1 < f(90) < 1.0 and abs(f(100) - 0.1) < 1e-9
    data = pack(random_docs(16), 32, pad_id=0)
    logs = {}
    weights = {}
    for ac in ("none", "moe", "block"):
        m = tiny_model(mtp_layers=1)
        seen = []
        train(m, data, tiny_train_cfg(steps=6, ckpt_every=100, log_every=2, activation_checkpointing=ac),
              tmp_path / ac, seed=0, on_log=lambda s, x: seen.append(x))
        logs[ac], weights[ac] = seen, m.state_dict()
    assert "mtp_loss" in logs["none"][-1] and logs["none"][-1]["mfu"] > 0
    for ac in ("moe", "block"):  # recomputation changes memory, not the math
        assert [x["loss"] for x in logs[ac]] == [x["loss"] for x in logs["none"]]
        assert all(torch.allclose(weights[ac][k].float(), weights["none"][k].float()) for k in weights["none"])


def test_export_loads_in_transformers_with_the_same_logits(tmp_path):
    from transformers import AutoModelForCausalLM

    m = tiny_model(seed=5).eval()
    (tmp_path / "tok").mkdir()
    export(m, tmp_path / "tok", tmp_path / "exp")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "exp", dtype=torch.float32).eval()
    ids = torch.randint(0, 97, (2, 19))
    with torch.no_grad():
        torch.testing.assert_close(hf(input_ids=ids).logits, m(ids), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("streams_fp32", [False, True])  # mHC residual streams in bf16 (V4's) or fp32
@pytest.mark.parametrize("mtp_layers", [0, 1])  # the MTP head's hidden state is bf16 under autocast
def test_bf16_autocast_training_is_finite_and_learns(tmp_path, mtp_layers, streams_fp32):
    data = pack(random_docs(16), 32, pad_id=0)
    logs = []
    train(tiny_model(mtp_layers=mtp_layers, hc_streams_fp32=streams_fp32), data,
          tiny_train_cfg(steps=20, ckpt_every=100, dtype="bf16"), tmp_path, seed=0,
          on_log=lambda s, x: logs.append(x["loss"]))
    assert all(torch.isfinite(torch.tensor(logs))) and logs[-1] < logs[0]


def test_the_residual_streams_take_the_autocast_dtype_unless_kept_in_fp32():
    """Under autocast the mHC streams are in the autocast dtype (as V4's bf16 code keeps them), or fp32 with
    ``hc_streams_fp32``; every layer keeps their dtype; without autocast they are the embedding's dtype."""
    from trainer.models.deepseek_v4.model import expand_streams

    h = torch.randn(2, 5, 8)
    assert expand_streams(h, 3).shape == (2, 5, 3, 8) and expand_streams(h, 3).dtype == torch.float32
    seen = {}
    for fp32 in (False, True):
        m = tiny_model(mtp_layers=1, hc_streams_fp32=fp32)
        hooks = [layer.register_forward_hook(lambda mod, args, out, fp32=fp32: seen.setdefault(fp32, set()).update(
            {args[0].dtype, out.dtype})) for layer in [*m.layers, m.mtp[0].block]]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            m.forward_train(torch.randint(0, 97, (2, 12)))
        for hk in hooks:
            hk.remove()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert expand_streams(h, 2, fp32).dtype == (torch.float32 if fp32 else torch.bfloat16)
    assert seen == {False: {torch.bfloat16}, True: {torch.float32}}


def test_trim_padding_cuts_only_columns_that_are_padding_in_every_row():
    docs = [([1, 2, 3], [1, 1, 1]), ([4] * 9, [1] * 9), ([5] * 6, [1] * 6)]
    p = pack(docs, 16, pad_id=0)  # rows of 16: [3 + 9 tokens, 4 padding], [6 tokens, 10 padding]
    batch = p.batch(torch.arange(len(p)))
    trimmed = trim_padding(batch, multiple=4)
    assert trimmed["input_ids"].shape == (2, 12)  # the last real token is column 11
    assert all(torch.equal(trimmed[k], batch[k][:, :12]) for k in batch)
    assert trim_padding(batch, multiple=16)["input_ids"].shape == (2, 16)  # rounded up: nothing to cut
    full = pack([([7] * 16, [1] * 16)], 16, pad_id=0)
    assert trim_padding(full.batch(torch.arange(1)))["input_ids"].shape == (1, 16)


def test_trimmed_padding_changes_no_loss_and_no_gradient():
    """Padding is a document of its own that no real token attends to: cutting it changes nothing a real token
    computes (every attention type, MTP, the indexers' loss)."""
    from trainer.models.deepseek_v4.training import loss_fn

    data = pack(random_docs(8), 48, pad_id=0)
    batch = data.batch(torch.arange(len(data)))
    trimmed = trim_padding(batch, multiple=8)
    assert trimmed["input_ids"].shape[1] < 48
    results = []
    for b in (batch, trimmed):
        m = tiny_model(mtp_layers=1, max_seq_len=64)
        loss, n, mtp, n_mtp = loss_fn(m, b)
        (loss + mtp).backward()
        results.append((loss.item(), n, mtp.item(), n_mtp, {k: p.grad.clone() for k, p in m.named_parameters()
                                                           if p.grad is not None}))
    (l0, n0, m0, k0, g0), (l1, n1, m1, k1, g1) = results
    assert (n0, k0) == (n1, k1)
    assert l1 == pytest.approx(l0, rel=1e-5) and m1 == pytest.approx(m0, rel=1e-5)
    for name, g in g0.items():
        torch.testing.assert_close(g1[name], g, rtol=1e-4, atol=1e-6, msg=name)
