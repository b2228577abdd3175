import json
import os

import pytest

from eval.extract import extract_program
from ordata.ingest import IngestError, ingest, parse_objective, verify_programs

SOLVES_42 = ("import highspy\nh = highspy.Highs()\nh.silent()\nx = h.addVariable(lb=0, ub=6)\nh.maximize(7 * x)\n"
             "print('Optimal objective:', h.getInfo().objective_function_value)\n")
PROGRAM = f"```python\n{SOLVES_42}```"
FAKE = "```python\nprint('Optimal objective:', 42)\n```"  # prints the optimum, solves nothing


def write_planted(tmp_path):
    lines = [
        json.dumps({"en_question": "Maximise x with x <= 3.", "en_answer": "3"}).encode(),
        b'{"en_question": "broken", ',  # malformed JSON
        b'{"en_question": "caf\xe9 latin-1 bytes", "en_answer": "1"}',  # not UTF-8
        json.dumps({"foo": "no question"}).encode(),  # schema violation
        json.dumps({"question": "Infeasible one", "answer": "No Best Solution"}).encode(),
        json.dumps({"en_question": "Odd answer", "en_answer": "see text"}).encode(),  # unparseable answer
        b"",
        json.dumps({"messages": [{"role": "user", "content": "Solve it"}, {"role": "assistant", "content": PROGRAM}]}).encode(),
        json.dumps([1, 2]).encode(),  # not an object
    ]
    f = tmp_path / "seeds.jsonl"
    f.write_bytes(b"\n".join(lines) + b"\n")
    return f


def test_quarantine_names_file_line_and_reason_and_accounts_for_everything(tmp_path):
    f = write_planted(tmp_path)
    res = ingest([f], licence="MIT")
    acc = res.accounting
    assert acc == {"in": 8, "kept": 3, "quarantined": 5}
    assert acc["in"] == acc["kept"] + acc["quarantined"]
    reasons = {q["origin"]: q["reason"] for q in res.quarantined}
    assert reasons[f"{f}:2"].startswith("malformed JSON")
    assert reasons[f"{f}:3"].startswith("not UTF-8")
    assert "no question field" in reasons[f"{f}:4"]
    assert "neither a number" in reasons[f"{f}:6"]
    assert "not an object" in reasons[f"{f}:9"]
    kept = {r["origin"]: r for r in res.records}
    assert kept[f"{f}:1"]["objective"] == 3.0 and kept[f"{f}:1"]["licence"] == "MIT"
    assert kept[f"{f}:5"]["status"] == "infeasible"
    assert kept[f"{f}:8"]["program"] == SOLVES_42


def test_programs_are_execution_verified(tmp_path):
    res = ingest([write_planted(tmp_path)])
    bad = dict(res.records[0], program="raise SystemExit(3)", origin="x:1")
    fake = dict(res.records[-1], program=extract_program(FAKE), origin="x:2")
    other = dict(res.records[-1], program=SOLVES_42.replace("ub=6", "ub=5"), origin="x:3", objective=42.0,
                 status="optimal")
    slow = dict(res.records[-1], program="while True:\n    pass\n", origin="x:4")
    kept, rejected = verify_programs(res.records + [bad, fake, other, slow], timeout_s=2.0)
    verified = [r for r in kept if r.get("verified")]
    assert len(verified) == 1 and verified[0]["objective"] == 42.0 and verified[0]["isolation"] == "bwrap"
    reasons = {r["origin"]: r["reason"] for r in rejected}
    assert reasons == {"x:1": "program_error", "x:2": "program_printed_without_solve", "x:3": "program_mismatch",
                       "x:4": "program_timeout"}
    assert all(r["isolation"] == "bwrap" for r in rejected)


def test_seed_program_printing_a_fake_optimum_is_rejected_even_when_the_number_is_right(tmp_path):
    f = tmp_path / "fake.jsonl"
    f.write_text(json.dumps({"messages": [{"role": "user", "content": "Maximise 7x with x <= 6."},
                                          {"role": "assistant", "content": FAKE}]}) + "\n")
    rec = dict(ingest([f]).records[0], objective=42.0, status="optimal")  # the printed number is the true optimum
    kept, rejected = verify_programs([rec])
    assert not kept and rejected[0]["reason"] == "program_printed_without_solve"


def test_chat_with_null_or_non_text_content_is_quarantined_with_its_line(tmp_path):
    f = tmp_path / "chats.jsonl"
    parts = [{"type": "text", "text": "Solve "}, {"type": "text", "text": "it"}]
    lines = [
        {"messages": [{"role": "user", "content": None}, {"role": "assistant", "content": PROGRAM}]},
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": [{"type": "image_url"}]}]},
        {"messages": [{"role": "user", "content": parts}, {"role": "assistant", "content": PROGRAM}]},
        {"messages": [{"role": "user", "content": 7}, {"role": "assistant", "content": PROGRAM}]},
    ]
    f.write_text("".join(json.dumps(x) + "\n" for x in lines))
    res = ingest([f])
    reasons = {q["origin"]: q["reason"] for q in res.quarantined}
    assert reasons == {f"{f}:1": "messages[0] (user): content is null",
                       f"{f}:2": "messages[1] (assistant): content is a list with parts that are not text",
                       f"{f}:4": "messages[0] (user): content is a int, not text"}
    assert [r["question"] for r in res.records] == ["Solve it"]
    assert res.accounting == {"in": 4, "kept": 1, "quarantined": 3}


def test_decontamination_questions_include_unparsable_answers_and_are_counted(tmp_path):
    from ordata.ingest import all_questions

    f = write_planted(tmp_path)
    questions, counts = all_questions([f])
    assert "Odd answer" in questions  # its answer is quarantined by the ingest, its question still counts
    assert counts[str(f)] == {"records": 8, "questions": 4, "unparsable_answer": 1, "without_question": 4}


def test_json_and_parquet_inputs(tmp_path):
    j = tmp_path / "bench.json"
    j.write_text(json.dumps([{"question": "q1", "results": {"objective": 5}}, {"en_question": "q2", "en_answer": 7}]))
    import pyarrow as pa
    import pyarrow.parquet as pq

    p = tmp_path / "test.parquet"
    pq.write_table(pa.table({"en_question": ["q3"], "en_answer": ["-1.5"]}), p)
    res = ingest([j, p])
    assert [r["objective"] for r in res.records] == [5.0, 7.0, -1.5]
    assert res.records[2]["origin"] == f"{p}#0"


def test_unreadable_inputs_stop_with_a_clear_error(tmp_path):
    with pytest.raises(IngestError, match="does not exist"):
        ingest([tmp_path / "missing.jsonl"])
    bad = tmp_path / "x.csv"
    bad.write_text("a,b")
    with pytest.raises(IngestError, match="unsupported input format"):
        ingest([bad])
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(IngestError, match="broken.json: not a valid UTF-8 JSON"):
        ingest([broken])
    if os.getuid() != 0:  # root can read anything
        locked = tmp_path / "locked.jsonl"
        locked.write_text("{}")
        locked.chmod(0)
        with pytest.raises(IngestError, match="cannot read"):
            ingest([locked])


def test_parse_objective_markers():
    assert parse_objective("1,234.5") == (1234.5, "optimal")
    assert parse_objective("-99999") == (None, "infeasible")
    assert parse_objective(None) == (None, "unknown")


BENCH = os.environ.get("TREX_BENCHMARKS_DIR")


@pytest.mark.skipif(not BENCH, reason="TREX_BENCHMARKS_DIR is not set (.ci/run sets it to ../shared/benchmarks)")
def test_real_benchmark_files_ingest_without_loss():
    from pathlib import Path

    root = Path(BENCH)
    files = [root / "IndustryOR/original_LLM4OR-mirror/IndustryOR.jsonl", root / "NL4Opt/ORLM245_via_OptMATH/NL4OPT.jsonl",
             root / "SLAI-T-Rex/NL4OPT/test.parquet", root / "OptiBench/ReSocratic_original/OptiBench.json"]
    res = ingest([f for f in files if f.exists()])
    acc = res.accounting
    assert acc["in"] == acc["kept"] + acc["quarantined"] and acc["kept"] > 0.9 * acc["in"]
