import os
import warnings

import torch

from tests.trainer.helpers import random_docs, tiny_model, tiny_train_cfg
from trainer import checkpoint
from trainer.data import IGNORE, pack
from trainer.export import export, load_export, same_weights
from trainer.loop import train


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


def test_exact_resume_is_bit_identical(tmp_path):
    data = pack(random_docs(), 32, pad_id=0)
    cfg = tiny_train_cfg()
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
