"""Repair dialogues (data.sft.repair_fraction): a verified program mutated into one that fails, its real error, the
fix; the failed attempt is context, never a target."""

from __future__ import annotations

import json
import random

import datasets

from ordata.curate import curate
from ordata.families import get_family
from ordata.repair import mutate
from tests.ordata.test_curate import small_cfg


def _row(rep: str, api: str, seed: int = 0) -> dict:
    spec = get_family("transportation").sample(random.Random(seed), 2, "LP")
    r = spec.render(rep, api)
    return {"id": f"t{seed}", "program": r.program, "api": api,
            "files": json.dumps({k: v.decode() for k, v in r.files.items()})}


def test_each_mutation_applies_where_it_can():
    seen = set()
    for seed in range(12):
        for rep, api in (("DPS", "highspy"), ("DP", "gurobipy"), ("DPS", "pyomo")):
            got = mutate(_row(rep, api, seed), random.Random(seed))
            assert got is not None and got[1] != _row(rep, api, seed)["program"]
            seen.add(got[0])
    assert seen == {"data_key", "method", "import"}


def test_curation_adds_repair_dialogues_with_the_real_error(tmp_path):
    cfg = small_cfg(sft={"samples": 16, "val_fraction": 0.0, "repair_fraction": 0.5}, representations=["DPS"])
    info = curate(cfg, tmp_path)
    acc = info["accounting"]["repair"]
    assert acc["in"] == 8 and acc["balanced"] and acc["kept"] >= 6, acc
    rows = datasets.load_from_disk(str(tmp_path / "sft")).to_list()
    repairs = [r for r in rows if r["style"] == "repair"]
    assert len(repairs) == acc["kept"] and info["counts"]["sft"] == 16 + acc["kept"]
    for r in repairs:
        m = r["messages"]
        assert [x["role"] for x in m] == ["system", "user", "assistant", "user", "assistant"]
        assert m[2]["train"] is False and m[4]["train"] is not False
        assert "Executing your program in the sandbox failed" in m[3]["content"]
        assert any(e in m[3]["content"] for e in ("KeyError", "AttributeError", "NameError")), m[3]["content"]
        original = next(x for x in rows if x["id"] == r["id"].removesuffix("-repair"))
        assert m[4]["content"] == original["messages"][2]["content"] != m[2]["content"]


def test_the_failed_attempt_is_never_a_target(tmp_path):
    from trainer.tokenizer import ChatTokenizer, train_tokenizer

    texts = ["maximise 3 x + 4 y subject to x + y <= 10", "import highspy\nh = highspy.Highs()"] * 20
    train_tokenizer(iter(texts), tmp_path / "tok", 300, 1)
    tok = ChatTokenizer(tmp_path / "tok")
    chat = [{"role": "user", "content": "maximise x"}, {"role": "assistant", "content": "BROKEN PROGRAM"},
            {"role": "user", "content": "it failed"}, {"role": "assistant", "content": "FIXED PROGRAM"}]
    ids, mask = tok.encode_chat([*chat[:1], {**chat[1], "train": False}, *chat[2:]])
    learned = tok.decode([i for i, k in zip(ids, mask) if k])
    assert "FIXED" in learned and "BROKEN" not in learned
    ids2, mask2 = tok.encode_chat(chat)
    assert ids2 == ids and "BROKEN" in tok.decode([i for i, k in zip(ids2, mask2) if k])
