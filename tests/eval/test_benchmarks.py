"""Benchmark loaders (eval/benchmarks.py, eval/benchmark_formats.py) and prompts (eval/prompts.py).

Unit tests read the small hand-written fixtures under fixtures/benchmarks/; the integration tests read
the real benchmark copy under $TREX_BENCHMARKS_DIR and are skipped when it is unset.
"""

import json
import os
from pathlib import Path

import pytest

from eval.benchmark_formats import BenchmarkItem, SkipItem, parse_answer
from eval.benchmarks import BENCHMARKS, list_benchmarks, load_benchmark, resolve_source
from eval.prompts import APIS, LP_FILE, TEMPLATES, build_messages

FIX = Path(__file__).parent / "fixtures" / "benchmarks"
REQUIRED = ("nl4opt", "optibench", "b4o-feasible", "b4o-orgeval", "mamo-easylp", "mamo-complexlp", "industryor",
            "optmath", "nlp4lp", "complexor", "synthetic")


def _item(**kw) -> BenchmarkItem:
    base = dict(id="x", question="Minimise x subject to x >= 1.", files={}, ground_truth=1.0, status="optimal",
                category="LP", source="test", extra={})
    return BenchmarkItem(**{**base, **kw})


# ------------------------------------------------------------------------------------------ answers

def test_parse_answer_is_explicit():
    assert parse_answer("1,234.5").value == 1234.5 and parse_answer(3).status == "optimal"
    t = parse_answer("No Best Solution")
    assert (t.value, t.status) == (None, "infeasible") and "No Best Solution" in t.note
    assert parse_answer("-99999").value == -99999.0  # a sentinel only where the benchmark says so
    t = parse_answer("-99999", frozenset({-99999.0}))
    assert t.status == "infeasible" and "sentinel" in t.note
    assert parse_answer(None).status == "unknown" and parse_answer("unbounded").status == "unknown"
    assert parse_answer([700]).value == 700.0
    with pytest.raises(SkipItem, match="neither a number"):
        parse_answer("about five")
    with pytest.raises(SkipItem):
        parse_answer(True)


# ------------------------------------------------------------------------------------------ formats

def test_orlm_jsonl_with_sentinels_markers_and_skips():
    b = load_benchmark("industryor", FIX / "orlm.jsonl")
    assert b.rows == 6 and len(b.items) + len(b.skipped) == b.rows
    by_id = {i.id: i for i in b.items}
    assert by_id["0"].ground_truth == 30.0 and by_id["0"].category == "LP" and by_id["0"].extra["difficulty"] == "Easy"
    assert by_id["1"].status == "infeasible" and by_id["1"].ground_truth is None
    assert by_id["2"].status == "infeasible" and "sentinel" in by_id["2"].extra["truth_note"]
    assert by_id["2"].category == "MILP" and by_id["2"].extra["question_type"] == "MIP"
    assert by_id["3"].ground_truth == 1234.5
    reasons = dict(b.skipped)
    assert "orlm.jsonl:5" in reasons["4"] and "about five units" in reasons["4"]
    assert "orlm.jsonl:6" in reasons["5"] and "no question" in reasons["5"]
    assert b.counts == {"rows": 6, "items": 4, "skipped": 2, "optimal": 2, "infeasible": 2, "unknown": 0}
    # the same file under a benchmark without sentinels keeps -99999 as a number
    assert {i.id: i for i in load_benchmark("nl4opt", FIX / "orlm.jsonl")}["2"].ground_truth == -99999.0


def test_llmopt_mamo_and_optibench_formats():
    llm = load_benchmark("nl4opt", FIX / "llmopt.jsonl").items
    assert [(i.id, i.ground_truth, i.extra["ori"]) for i in llm] == [("0", 8.0, "0_toy"), ("1", 1.0, "1_toy")]
    mamo = load_benchmark("mamo-easylp", FIX / "mamo.jsonl").items
    assert [(i.id, i.ground_truth, i.extra["type"]) for i in mamo] == [("1", 170.0, "easy_lp"), ("2", 16.0, "easy_lp")]
    opti = load_benchmark("optibench", FIX / "optibench.json")
    assert [i.ground_truth for i in opti] == [6.0, 3.0] and "optibench.json#1" in opti.items[1].extra["origin"]
    reso = load_benchmark("optibench", FIX / "resocratic.json")
    assert [i.ground_truth for i in reso] == [10.0]
    assert reso.skipped[0][0] == "1" and "cannot tell which one" in reso.skipped[0][1]


def test_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"en_question": ["Maximise x with x <= 2.", "Minimise y with y >= 3."],
                             "en_answer": ["2.0", "3"]}), tmp_path / "test.parquet")
    b = load_benchmark("nl4opt", tmp_path / "test.parquet")
    assert [(i.id, i.ground_truth) for i in b] == [("0", 2.0), ("1", 3.0)]


def test_malformed_line_names_file_and_line():
    with pytest.raises(ValueError, match=r"malformed\.jsonl:3: malformed JSON"):
        load_benchmark("nl4opt", FIX / "malformed.jsonl")


def test_malformed_json_array_names_file_and_line(tmp_path):
    (tmp_path / "bad.json").write_text('[\n {"en_question": "q", "en_answer": 1},\n {"en_question": \n]')
    with pytest.raises(ValueError, match=r"bad\.json:4"):
        load_benchmark("optibench", tmp_path / "bad.json")


def test_duplicate_ids_are_an_error():
    with pytest.raises(ValueError, match="duplicate id '7'.*duplicate_ids.jsonl:1"):
        load_benchmark("mamo-easylp", FIX / "duplicate_ids.jsonl")


def test_limit_stops_after_n_items_and_accounts_for_rows_read():
    b = load_benchmark("industryor", FIX / "orlm.jsonl", limit=2)
    assert [i.id for i in b] == ["0", "1"] and b.rows == 2 and not b.skipped
    b = load_benchmark("industryor", FIX / "orlm.jsonl", limit=100)
    assert len(b) == 4 and b.rows == 6
    with pytest.raises(ValueError, match="limit"):
        load_benchmark("industryor", FIX / "orlm.jsonl", limit=0)


def test_b4o_feasible_gives_data_file_and_reference_lp():
    b = load_benchmark("b4o-feasible", FIX / "b4o")  # a directory holding test.jsonl
    assert b.rows == 2 and len(b.items) == 1
    item = b.items[0]
    assert item.id == "B4O_1" and item.ground_truth == 33.0 and item.status == "optimal" and item.category == "LP"
    assert json.loads(item.files["data.json"]) == {"capacity": [4, 6], "profit": [3, 5], "budget": 7}
    lp = Path(item.extra["reference_lp"])
    assert lp.is_absolute() and lp.is_file() and lp.name == "model_1_problem1.lp"
    assert item.extra["scoring"] == "objective" and item.extra["initial_data_path"] == "Toy_[var1]"
    assert b.skipped[0][0] == "B4O_2" and "data_2_missing.json" in b.skipped[0][1] and "test.jsonl:2" in b.skipped[0][1]


def test_b4o_orgeval_is_scored_structurally(tmp_path):
    rows = [json.loads(x) for x in (FIX / "b4o" / "test.jsonl").read_text().splitlines()]
    for r in rows:
        del r["optimal_value"]
    (tmp_path / "test.jsonl").write_text("\n".join(json.dumps(r) for r in rows[:1]))
    (tmp_path / "lp_final").symlink_to(FIX / "b4o" / "lp_final")
    (tmp_path / "lp_code").symlink_to(FIX / "b4o" / "lp_code")
    item = load_benchmark("b4o-orgeval", tmp_path / "test.jsonl").items[0]
    assert item.ground_truth is None and item.status == "unknown" and item.extra["scoring"] == "lp_structure"
    assert Path(item.extra["reference_lp"]).is_file() and "data.json" in item.files


def test_coe_problem_dirs():
    b = load_benchmark("complexor", FIX / "coe")
    assert [i.id for i in b] == ["knapsack", "prob_2", "prob_10"]  # natural order
    k, p2, p10 = b.items
    assert json.loads(k.files["data.json"]) == {"values": [4, 3], "weights": [2, 2], "capacity": 2}
    assert k.ground_truth == 4.0 and "capacity" in k.extra["gt_model"] and Path(k.extra["dir"]).is_dir()
    assert p10.ground_truth == 9.0  # sample.json as one {input, output} object
    assert p2.status == "unknown" and p2.ground_truth is None and "null" in p2.extra["truth_note"]
    assert b.skipped == [("no_description", f"{FIX / 'coe' / 'no_description'}: no question text")]


def test_nlp4lp_dirs_and_empty_solution():
    b = load_benchmark("nlp4lp", FIX / "nlp4lp")
    assert [i.id for i in b] == ["0", "1", "10"]
    assert b.items[0].ground_truth == 18.0 and json.loads(b.items[0].files["data.json"])["Budget"] == 100
    empty = b.items[1]
    assert empty.status == "unknown" and empty.ground_truth is None
    assert "infeasible or unbounded" in empty.extra["truth_note"]


def test_consolidated_rows_and_qa_rows_for_a_dir_benchmark(tmp_path):
    row = {"id": "7", "description": "Minimise 2x with x >= 3.", "answer": "6.0",
           "solution": {"variables": {"x": 3.0}, "objective": 6.0}, "parameters": {"Coef": 2}}
    qa = {"question": "Minimise x with x >= 4.", "answer": 4, "index": 8}
    (tmp_path / "c.jsonl").write_text(json.dumps(row) + "\n" + json.dumps(qa) + "\n")
    b = load_benchmark("nlp4lp", tmp_path / "c.jsonl")
    assert [(i.id, i.ground_truth, bool(i.files)) for i in b] == [("7", 6.0, True), ("8", 4.0, False)]


def _save_synthetic(path: Path) -> None:
    import datasets

    rows = [{"id": "s0", "question": "A diet problem ... Data are in data.json.", "objective": 12.5,
             "status": "optimal",
             "family": "diet", "category": "LP", "representation": "DPS", "api": "pyomo",
             "files": json.dumps({"data.json": '{"cost": [1, 2]}'})},
            {"id": "s1", "question": "An infeasible knapsack ...", "objective": None, "status": "infeasible",
             "family": "knapsack", "category": "IP", "representation": "DP", "api": "highspy", "files": "{}"}]
    datasets.Dataset.from_list(rows).save_to_disk(str(path))


def test_synthetic_split_and_its_training_prompt(tmp_path):
    from eval.prompts import SYSTEM_PROMPT, user_prompt

    _save_synthetic(tmp_path / "eval")
    b = load_benchmark("synthetic", tmp_path / "eval")
    s0, s1 = b.items
    assert (s0.ground_truth, s0.status, s0.category, s0.extra["family"]) == (12.5, "optimal", "LP", "diet")
    assert s0.files == {"data.json": '{"cost": [1, 2]}'} and s1.status == "infeasible"
    msgs = build_messages(s0, "synthetic")
    assert msgs == [{"role": "system", "content": SYSTEM_PROMPT},
                    {"role": "user", "content": user_prompt(s0.question, "pyomo")}]
    assert build_messages(s0, "synthetic", api="gurobipy")[1]["content"] == user_prompt(s0.question, "gurobipy")
    with pytest.raises(ValueError, match="highspy"):
        build_messages(s0, "synthetic", api="pulp")
    with pytest.raises(ValueError, match="pass a path"):
        load_benchmark("synthetic")


def test_item_round_trips_and_feeds_the_harness():
    item = load_benchmark("b4o-feasible", FIX / "b4o").items[0]
    assert json.loads(json.dumps(item.to_dict()))["extra"]["scoring"] == "objective"
    row = item.as_problem("b4o-feasible")
    assert row["objective"] == 33.0 and row["representation"] == "DPS" and "data.json" in json.loads(row["files"])
    with pytest.raises(ValueError, match="status"):
        _item(status="solved")


# ------------------------------------------------------------------------------------------ registry

def test_registry_and_source_resolution(monkeypatch):
    assert set(REQUIRED) <= set(BENCHMARKS)
    listing = {r["key"]: r for r in list_benchmarks()}
    assert set(listing) == set(BENCHMARKS) and listing["b4o-orgeval"]["scoring"] == "lp_structure"
    with pytest.raises(ValueError, match="unknown benchmark 'nope'.*nl4opt"):
        load_benchmark("nope")
    spec = BENCHMARKS["industryor"]
    assert resolve_source(spec, "CardinalOperations/IndustryOR") == ("hub", "CardinalOperations/IndustryOR")
    with pytest.raises(FileNotFoundError):
        resolve_source(spec, "missing/file.jsonl")
    monkeypatch.delenv("TREX_BENCHMARKS_DIR", raising=False)
    with pytest.raises(ValueError, match="TREX_BENCHMARKS_DIR"):
        load_benchmark("industryor")
    monkeypatch.setenv("TREX_BENCHMARKS_DIR", str(FIX))  # relative paths resolve under the root
    assert len(load_benchmark("mamo-easylp", "mamo.jsonl")) == 2


# ------------------------------------------------------------------------------------------ prompts

def test_reference_prompt_names_api_tags_and_data_keys_not_values():
    item = load_benchmark("b4o-feasible", FIX / "b4o").items[0]
    system, user = (m["content"] for m in build_messages(item))
    assert "gurobipy" in system and "<think>" in system and "<model>" in system and "<python>" in system
    assert "```python" in system and item.question in user
    assert "`data.json`" in user and "`capacity` (list[2] of number)" in user and "`budget` (number)" in user
    assert "[4, 6]" not in user  # keys and shapes, not the values
    assert "Optimal objective:" in user and "Status: infeasible" in user and LP_FILE not in user
    for api in APIS:
        msgs = build_messages(item, api=api)
        assert APIS[api].name in msgs[0]["content"] and APIS[api].imports in msgs[1]["content"]


def test_reference_prompt_variants_and_errors():
    plain = build_messages(_item())[1]["content"]
    assert "# Data" not in plain and "data.json" not in plain
    orgeval = _item(extra={"scoring": "lp_structure"}, files={"data.json": "{}"})
    lp = build_messages(orgeval, api="highspy")[1]["content"]
    assert LP_FILE in lp and "writeModel" in lp
    with pytest.raises(ValueError, match="unknown prompt template 'fewshot'; valid: reference, synthetic"):
        build_messages(_item(), "fewshot")
    with pytest.raises(ValueError, match="unknown solver api 'cplex'.*gurobipy.*scipy"):
        build_messages(_item(), api="cplex")
    assert TEMPLATES == ("reference", "synthetic")


# ------------------------------------------------------------------------------------------ real data

BENCH = os.environ.get("TREX_BENCHMARKS_DIR")
needs_data = pytest.mark.skipif(not BENCH, reason="TREX_BENCHMARKS_DIR is not set (point it at the shared "
                                                  "benchmarks directory, e.g. /work/shared/benchmarks)")
# benchmark -> (items, skipped, {status: count}) on the shared copy (see its README.md)
EXPECTED = {
    "nl4opt": (289, 0, {"optimal": 289}),
    "nl4opt-orlm": (245, 0, {"optimal": 228, "infeasible": 17}),
    "nl4opt-lpwp": (288, 0, {"optimal": 281, "unknown": 7}),
    "optibench": (600, 0, {"optimal": 600}),
    "b4o-feasible": (344, 0, {"optimal": 344}),
    "b4o-orgeval": (394, 0, {"unknown": 394}),
    "mamo-easylp": (652, 0, {"optimal": 652}),
    "mamo-complexlp": (211, 0, {"optimal": 211}),
    "industryor": (100, 0, {"optimal": 97, "infeasible": 3}),
    "industryor-v2": (100, 0, {"optimal": 100}),
    "optmath": (166, 0, {"optimal": 166}),
    "nlp4lp": (269, 0, {"optimal": 242, "unknown": 27}),
    "complexor": (18, 0, {"optimal": 18}),
    "complexor-44": (44, 0, {"optimal": 44}),
}


def _raw_rows(path: Path) -> int:
    """Rows in a source, counted independently of the loaders."""
    if path.is_dir():
        return sum(p.is_dir() for p in path.iterdir())
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_metadata(path).num_rows
    text = path.read_text()
    return len(json.loads(text)) if text.lstrip().startswith("[") else sum(bool(x.strip()) for x in text.splitlines())


@needs_data
def test_every_public_benchmark_is_registered_with_expected_counts():
    assert set(EXPECTED) == {k for k in BENCHMARKS if k != "synthetic"}


@needs_data
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_real_benchmark_loads_with_expected_counts(name):
    n_items, n_skipped, status = EXPECTED[name]
    b = load_benchmark(name)
    assert b.rows == _raw_rows(Path(BENCH) / BENCHMARKS[name].default_path)
    assert len(b.items) + len(b.skipped) == b.rows, "every row is an item or a recorded skip"
    assert (len(b.items), len(b.skipped)) == (n_items, n_skipped), b.skipped[:5]
    assert {k: v for k, v in b.counts.items() if k in ("optimal", "infeasible", "unknown") and v} == status
    for item in b.items:
        assert item.question and (item.status == "optimal") == (item.ground_truth is not None)
        assert item.status == "optimal" or item.extra.get("truth_note")
        if name.startswith("b4o"):
            assert Path(item.extra["reference_lp"]).is_file() and json.loads(item.files["data.json"])
    msgs = build_messages(b.items[0])
    assert len(msgs) == 2 and b.items[0].question in msgs[1]["content"]


@needs_data
def test_real_b4o_feasible_ground_truth_matches_the_file():
    b = load_benchmark("b4o-feasible")
    rows = [json.loads(x) for x in (Path(BENCH) / BENCHMARKS["b4o-feasible"].default_path).read_text().splitlines()
            if x.strip()]
    assert [i.ground_truth for i in b] == [float(r["optimal_value"]) for r in rows]
    assert [Path(i.extra["reference_lp"]).name for i in b] == [Path(r["reference_lp_path"]).name for r in rows]
