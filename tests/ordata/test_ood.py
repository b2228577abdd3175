"""The out-of-distribution held-out split: families and a representation / answer-style combination withheld
from training, drawn after every other split so the in-distribution splits are byte-identical with or without it."""

import datasets

from ordata.curate import curate
from trex.core.config import DataConfig
from trex.core.refs import dir_files

BASE = dict(sft={"samples": 10}, eval={"problems": 4}, cpt={"documents": 4}, max_size=3, infeasible_rate=0.0)


def test_ood_split_is_drawn_last_from_withheld_families_and_representations(tmp_path):
    curate(DataConfig(**BASE), tmp_path / "without")
    info = curate(DataConfig(**BASE, ood={"problems": 8, "families": ["diet", "blending"],
                                          "representations": ["DP", "DT"]}), tmp_path / "with")
    plain, ood = dir_files(tmp_path / "without"), dir_files(tmp_path / "with")
    # the in-distribution splits, their rejections and the quarantine: the same bytes with the OOD split as without
    assert {k: v for k, v in ood.items() if not k.startswith("eval_ood/")} == plain
    rows = datasets.load_from_disk(str(tmp_path / "with" / "eval_ood")).to_list()
    assert len(rows) == info["counts"]["eval_ood"] == 8
    assert {r["family"] for r in rows} == {"diet", "blending"} and {r["representation"] for r in rows} == {"DP", "DT"}
    assert {r["question_source"] for r in rows} == {"template"}
    assert not {r["family"] for r in rows} & (set(info["per_family"]["sft"]) | set(info["per_family"]["cpt"]))
    assert info["ood"]["withheld_from_training"] == ["DT/code"]
    assert all(a["balanced"] for a in info["accounting"].values())
    assert info["accounting"]["verify"]["in"] == 10 + 4 + 4 + 8


def test_withheld_combination_never_reaches_the_sft_set(tmp_path):
    cfg = DataConfig(**{**BASE, "sft": {"samples": 12, "val_fraction": 0.0}}, representations=["DP", "DT"],
                     answer_styles=["code_only", "math_model"],
                     ood={"problems": 2, "families": ["diet"], "representations": ["DT"], "withhold": ["DT/code_only"]})
    info = curate(cfg, tmp_path)
    sft = datasets.load_from_disk(str(tmp_path / "sft")).to_list()
    combos = {(r["representation"], r["style"]) for r in sft}
    assert ("DT", "code_only") not in combos and ("DT", "math_model") in combos
    assert {("DP", "code_only"), ("DP", "math_model")} <= combos
    assert info["ood"]["withheld_from_training"] == ["DT/code"]
    assert {r["representation"] for r in datasets.load_from_disk(str(tmp_path / "eval_ood")).to_list()} == {"DT"}
