"""The train task (``tasks/train.py``) on a tiny model: a stage's content hash is a function of its inputs and seed
alone (and so is the lifecycle's export to the published layout), and an SFT stage without validation tokens
reports no ``val_loss`` (not 0.0), with one warning."""

from __future__ import annotations

import random
import shutil
import warnings
from pathlib import Path

import pytest

from tests.trainer.helpers import TINY, random_docs, tiny_model
from trainer.data import pack

TEXTS = ["min x + y subject to x <= 3", "max 2 x - y subject to y >= 1", "min 3 x subject to x + y >= 2"] * 8
CHATS = [[{"role": "user", "content": t}, {"role": "assistant", "content": "x = 0"}] for t in TEXTS]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """A curated data directory (cpt, sft, an empty sft_val as ``ordata.curate`` writes one) and a tokenizer."""
    import datasets

    from trainer.tokenizer import train_tokenizer

    root = tmp_path_factory.mktemp("inputs")
    datasets.Dataset.from_list([{"text": t} for t in TEXTS]).save_to_disk(str(root / "data" / "cpt"))
    datasets.Dataset.from_list([{"messages": m} for m in CHATS]).save_to_disk(str(root / "data" / "sft"))
    datasets.Dataset.from_dict({"id": []}).save_to_disk(str(root / "data" / "sft_val"), num_shards=1)
    train_tokenizer(iter(TEXTS), root / "tok", 120, 1)
    return root


def _refs(root: Path) -> tuple[dict, dict]:
    from trex.core.refs import write_manifest

    return write_manifest(root / "data", "data", {}), write_manifest(root / "tok", "tokenizer", {})


def _train(stage: str, root: Path, out: Path, seed: int = 0, tracker=None, monkeypatch=None) -> dict:
    from tasks.common import StageContext
    from tasks.train import train_task
    from trainer.models.deepseek_v4.args import ModelArgs
    from trex.core.config import StageTrainConfig

    if tracker is not None:
        monkeypatch.setattr("tasks.train.start_run", lambda *a, **k: tracker)
    data_ref, tok_ref = _refs(root)
    ctx = StageContext(output_dir=str(out), tracking={"enabled": False, "uri": ""})
    train = StageTrainConfig(steps=3, batch_size=2, seq_len=32 if stage == "cpt" else 64,  # an SFT chat fits in 64
                             warmup_steps=1, log_every=1, ckpt_every=2, async_checkpoint=True)
    return train_task.fn(stage, ModelArgs(**TINY), train, seed, data_ref, tok_ref, None, ctx)


# ------------------------------------------------------------------------------------------ reproducible content
def test_same_inputs_and_seed_give_the_same_content_hash(inputs, tmp_path):
    """Two runs of one stage -- in two output directories, on inputs at two locations, with Python's ``random``
    in another state, as in a fresh process -- write byte-identical files: the DCP ``.metadata`` carries no save
    id or path, ``rng.pt`` seeded RNGs (the session's first CPU peak probe, run inside the first stage, draws from
    none of them), ``model.json`` no tokenizer path, the export nothing run-specific. A different seed trains
    another model, so the hash is not blind."""
    from tasks.checkpoint import export_task
    from tasks.common import StageContext
    from trex.core.refs import dir_files

    moved = tmp_path / "elsewhere" / "inputs"
    shutil.copytree(inputs, moved)
    random.seed(1)
    a = _train("cpt", inputs, tmp_path / "a")
    random.seed(2)
    b = _train("cpt", moved, tmp_path / "b" / "deeper")
    fa, fb = dir_files(Path(a["ref"]["path"])), dir_files(Path(b["ref"]["path"]))
    assert any(k.endswith("/.metadata") for k in fa) and any(k.startswith("export/") for k in fa)
    assert {k for k in fa if fa[k] != fb.get(k)} | (set(fb) - set(fa)) == set()
    assert a["ref"]["hash"] == b["ref"]["hash"]
    # the lifecycle's export to the published layout too (its provenance names the model, not its path)
    hub = [export_task.fn(r["ref"], "hub-bf16", None, None, StageContext(str(Path(r["ref"]["path"]).parents[1]),
                                                                          {"enabled": False, "uri": ""}))
           for r in (a, b)]
    assert hub[0]["ref"]["hash"] == hub[1]["ref"]["hash"]
    c = _train("cpt", inputs, tmp_path / "c", seed=1)
    assert c["ref"]["hash"] != a["ref"]["hash"]


# -------------------------------------------------------------------------------------------------- validation
def test_evaluate_loss_without_label_tokens_is_none():
    from trainer.models.deepseek_v4.training import evaluate_loss

    m = tiny_model()
    assert evaluate_loss(m, pack([], 32, pad_id=0)) is None
    assert evaluate_loss(m, pack([([5, 6, 7], [0, 0, 0])], 32, pad_id=0)) is None  # every label masked
    loss = evaluate_loss(m, pack(random_docs(4), 32, pad_id=0))
    assert isinstance(loss, float) and loss > 0


class _Recorder:
    """A disabled tracker that keeps what the task logs as metrics."""

    def __init__(self):
        from trex.tracking.runs import Tracker

        self.logged: list[dict] = []
        recorder = self

        class Recording(Tracker):
            def metrics(self, metrics, step=0):
                recorder.logged.append(dict(metrics))

        self.tracker = Recording("", None)


@pytest.mark.parametrize("val_rows", [0, 4])
def test_sft_without_validation_tokens_reports_no_val_loss(inputs, tmp_path, monkeypatch, val_rows):
    import datasets

    from flows.common import _headline
    from trex.core.refs import read_manifest

    root = tmp_path / "inputs"
    shutil.copytree(inputs, root)
    if val_rows:
        shutil.rmtree(root / "data" / "sft_val")
        datasets.Dataset.from_list([{"messages": m} for m in CHATS[:val_rows]]).save_to_disk(
            str(root / "data" / "sft_val"))
    rec = _Recorder()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = _train("sft", root, tmp_path / "out", tracker=rec.tracker, monkeypatch=monkeypatch)
    about_val = [str(w.message) for w in caught if "validation split" in str(w.message)]
    logged = {k for m in rec.logged for k in m}
    summary = read_manifest(res["ref"]["path"], "model")["summary"]
    if val_rows:
        assert about_val == []
        assert res["summary"]["val_loss"] > 0 and summary["val_loss"] == res["summary"]["val_loss"]
        assert "val_loss" in logged
        return
    assert len(about_val) == 1 and "is empty" in about_val[0] and str(root / "data") in about_val[0]
    assert "val_loss" not in res["summary"] and "val_loss" not in summary
    assert "loss" in logged and "val_loss" not in logged
    assert "val_loss" not in _headline(res["summary"])
