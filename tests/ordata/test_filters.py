import json

import datasets

from ordata.curate import curate
from ordata.filters import Decontaminator, exact_dedup, near_dedup, quality
from tests.ordata.test_curate import small_cfg

BASE = ("A regional bakery produces bread and cakes every morning; bread earns 3 dollars per loaf and cakes earn "
        "7 dollars each, while flour is limited to 120 kilograms and oven time to 9 hours in total per day. ")


def test_quality_filters():
    docs = [{"id": 1, "text": "short 1"}, {"id": 2, "text": BASE}, {"id": 3, "text": "x" * 5000 + " 1"},
            {"id": 4, "text": "no digits here at all " * 10}]
    kept, rejected = quality(docs)
    assert [d["id"] for d in kept] == [2]
    assert [r["reason"] for r in rejected] == ["too_short", "too_long", "no_numbers"]


def test_planted_exact_and_near_duplicates_are_caught():
    other = ("Transportation planners ship crates from 3 farms to 4 markets at least cost, subject to supplies "
             "of 40, 55 and 70 crates and demands of 30, 35, 45 and 50 crates in every week of the season.")
    near = BASE.replace("9 hours", "10 hours")  # one word changed
    docs = [{"id": 1, "text": BASE}, {"id": 2, "text": other}, {"id": 3, "text": BASE.upper()}, {"id": 4, "text": near}]
    kept, exact = exact_dedup(docs)
    assert [d["id"] for d in kept] == [1, 2, 4] and exact[0]["id"] == 3
    kept, nearr = near_dedup(kept, threshold=0.7)
    assert [d["id"] for d in kept] == [1, 2] and nearr[0]["id"] == 4 and nearr[0]["reason"] == "near_duplicate"


def test_planted_benchmark_question_is_decontaminated():
    bench = ["A company has two plants that make widgets; plant one can make at most 300 widgets per day and plant two 200."]
    d = Decontaminator(bench)
    planted = "Intro text. " + bench[0][:90] + " and more words follow here."
    assert d.contaminated(planted)
    assert not d.contaminated("A company has two plants that make gadgets; plant one can make at most 300 gadgets per day")


def test_curation_filters_cpt_and_decontaminates_against_benchmark_files(tmp_path):
    sample = curate(small_cfg(seed=5), tmp_path / "probe")
    sft_q = datasets.load_from_disk(str(tmp_path / "probe" / "sft")).to_list()[0]["question"]
    bench = tmp_path / "bench.jsonl"
    bench.write_text(json.dumps({"en_question": sft_q, "en_answer": "1"}) + "\n")
    corpus = tmp_path / "corpus.jsonl"
    lines = [json.dumps({"text": BASE}), json.dumps({"text": BASE}), "{bad json", json.dumps({"text": "tiny 1"})]
    corpus.write_text("\n".join(lines) + "\n")
    info = curate(small_cfg(seed=5, cpt_corpora=[str(corpus)], decontaminate_against=[str(bench)]), tmp_path / "out")
    acc = info["accounting"]
    assert all(a["balanced"] for a in acc.values()), acc
    n_dirty = acc["decontaminate"]["rejected"]["contaminated"]
    assert n_dirty >= 1  # the planted question, and any template sibling sharing one of its 13-grams
    cpt = acc["cpt_filter"]
    assert cpt["quarantined"] == 1 and cpt["rejected"].get("exact_duplicate") == 1 and cpt["rejected"].get("too_short") == 1
    assert info["counts"]["sft"] + info["counts"]["sft_val"] == sample["counts"]["sft"] + sample["counts"]["sft_val"] - n_dirty
    q = (tmp_path / "out" / "quarantine.jsonl").read_text()
    assert f"{corpus}:3" in q
