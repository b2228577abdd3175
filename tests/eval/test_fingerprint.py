"""Run fingerprints: rows are resumed only by the run that wrote them (same model, backend, prompt, sampling,
benchmark data, scoring); the report states its fingerprint and covers only its rows."""

import json
import shutil
from pathlib import Path

import pytest

from eval import harness
from eval.backends import Completion
from eval.benchmark_formats import BenchmarkItem
from eval.benchmarks import load_benchmark
from eval.harness import (
    FingerprintMismatch,
    build_report,
    evaluate_items,
    model_identity,
    prompt_hash,
    read_samples,
    run_fingerprint,
)
from tests.eval.test_harness import CannedBackend
from trex.core.config import EvalConfig
from trex.core.refs import write_manifest

FIXTURES = Path(__file__).parent / "fixtures" / "benchmarks"


class ModelBackend(CannedBackend):
    """A canned backend that describes itself as a native backend over a model directory."""

    def __init__(self, model_dir: Path, answer: str = "no code"):
        super().__init__({"": answer})
        self.model_dir = model_dir

    def describe(self):
        return {"kind": "native", "model": str(self.model_dir), "params": None, "options": {"batch_size": 16},
                "stats": {}}


def _model(path: Path, weights: bytes) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text('{"hidden_size": 8}')
    (path / "tokenizer.json").write_text('{"vocab": {}}')
    (path / "model.safetensors").write_bytes(weights)
    return path


def _items(n=3):
    # answers without a program: nothing runs in the sandbox, every item is judged (no_program -> fail)
    return [BenchmarkItem(id=f"q{i}", question=f"[q{i}] maximise x", files={}, ground_truth=1.0, status="optimal",
                          category="LP", source="test") for i in range(n)]


def test_model_b_cannot_reuse_model_a_rows(tmp_path):
    a, b = _model(tmp_path / "A", b"weights-A"), _model(tmp_path / "B", b"weights-B")
    out = tmp_path / "results"
    first = ModelBackend(a)
    report_a = evaluate_items(first, _items(), out, EvalConfig(), "nl4opt")
    assert first.calls == 3
    second = ModelBackend(b)
    with pytest.raises(FingerprintMismatch) as e:
        evaluate_items(second, _items(), out, EvalConfig(), "nl4opt")
    msg = str(e.value)
    assert str(out / "samples.jsonl") in msg and "model.sha256" in msg and "--out" in msg and "--overwrite" in msg
    old, new = report_a["fingerprint"]["components"]["model"]["sha256"], model_identity(str(b))["sha256"]
    assert f"{old!r} -> {new!r}" in msg
    assert second.calls == 0 and len(read_samples(out)) == 3  # nothing of A's was reused, nothing appended
    report_b = evaluate_items(second, _items(), out, EvalConfig(), "nl4opt", overwrite=True)
    assert second.calls == 3 and report_b["n"] == 3
    assert {r["fingerprint"]["hash"] for r in read_samples(out)} == {report_b["fingerprint"]["hash"]}
    assert report_b["fingerprint"]["hash"] != report_a["fingerprint"]["hash"]


def test_same_fingerprint_resumes_without_regenerating(tmp_path):
    model = _model(tmp_path / "A", b"weights")
    first = ModelBackend(model)
    evaluate_items(first, _items(2), tmp_path / "r", EvalConfig(), "nl4opt")
    again = ModelBackend(model)
    report = evaluate_items(again, _items(3), tmp_path / "r", EvalConfig(workers=1), "nl4opt")  # workers: not output
    assert again.calls == 1 and report["n"] == 3  # only the new item was generated
    assert [r["id"] for r in read_samples(tmp_path / "r")] == ["q0", "q1", "q2"]
    once_more = ModelBackend(model)
    assert evaluate_items(once_more, _items(3), tmp_path / "r", EvalConfig(), "nl4opt")["n"] == 3
    assert once_more.calls == 0


@pytest.mark.parametrize("change", [{"temperature": 0.6}, {"top_p": 0.9}, {"seed": 7}, {"max_new_tokens": 64},
                                    {"rel_tol": 1e-4}, {"timeout_s": 5.0}])
def test_changed_sampling_or_scoring_setting_is_not_reused(tmp_path, change):
    model = _model(tmp_path / "A", b"weights")
    evaluate_items(ModelBackend(model), _items(), tmp_path / "r", EvalConfig(), "nl4opt")
    backend = ModelBackend(model)
    with pytest.raises(FingerprintMismatch, match=f"{next(iter(change))}: "):
        evaluate_items(backend, _items(), tmp_path / "r", EvalConfig(**change), "nl4opt")
    assert backend.calls == 0


def test_changed_prompt_backend_option_or_scoring_version_is_not_reused(tmp_path, monkeypatch):
    model = _model(tmp_path / "A", b"weights")
    evaluate_items(ModelBackend(model), _items(), tmp_path / "r", EvalConfig(), "nl4opt")
    with pytest.raises(FingerprintMismatch, match="prompt.api: None -> 'pyomo'; prompt.sha256"):
        evaluate_items(ModelBackend(model), _items(), tmp_path / "r", EvalConfig(), "nl4opt", api="pyomo")
    with pytest.raises(FingerprintMismatch, match="prompt.template: 'reference' -> 'synthetic'"):
        evaluate_items(ModelBackend(model), _items(), tmp_path / "r", EvalConfig(), "nl4opt", template="synthetic")
    other = ModelBackend(model)
    other.describe = lambda: {**ModelBackend(model).describe(), "options": {"batch_size": 4}}
    with pytest.raises(FingerprintMismatch, match="backend.options.batch_size: 16 -> 4"):
        evaluate_items(other, _items(), tmp_path / "r", EvalConfig(), "nl4opt")
    monkeypatch.setattr(harness, "SCORING_VERSION", harness.SCORING_VERSION + 1)
    with pytest.raises(FingerprintMismatch, match="scoring.version"):
        evaluate_items(ModelBackend(model), _items(), tmp_path / "r", EvalConfig(), "nl4opt")


def test_changed_benchmark_file_is_not_reused(tmp_path):
    data = tmp_path / "bench.jsonl"
    shutil.copy(FIXTURES / "orlm.jsonl", data)
    model = _model(tmp_path / "A", b"weights")

    def run(backend):
        loaded = load_benchmark("nl4opt-orlm", data)
        return evaluate_items(backend, loaded.items, tmp_path / "r", EvalConfig(), "nl4opt-orlm",
                              benchmark_hash=loaded.content_hash, benchmark_files=loaded.hashed_files)

    first = ModelBackend(model)
    report = run(first)
    assert report["fingerprint"]["components"]["benchmark"] == {
        "name": "nl4opt-orlm", "sha256": load_benchmark("nl4opt-orlm", data).content_hash[:16], "files": 1}
    same = ModelBackend(model)
    run(same)
    assert same.calls == 0
    data.write_text(data.read_text().replace('"30.0"', '"31.0"'))  # one ground truth corrected
    changed = ModelBackend(model)
    with pytest.raises(FingerprintMismatch, match="benchmark.sha256"):
        run(changed)
    assert changed.calls == 0


def test_benchmark_hash_covers_the_files_read_not_their_location(tmp_path):
    copy = tmp_path / "elsewhere.jsonl"
    shutil.copy(FIXTURES / "orlm.jsonl", copy)
    original = load_benchmark("nl4opt-orlm", FIXTURES / "orlm.jsonl")
    assert load_benchmark("nl4opt-orlm", copy).content_hash == original.content_hash
    b4o = tmp_path / "b4o"
    shutil.copytree(FIXTURES / "b4o", b4o)
    before = load_benchmark("b4o-feasible", b4o)
    assert before.hashed_files > 1  # the records and the data / reference-LP files they name
    lp = next(p for p in sorted(b4o.rglob("*")) if p.is_file() and p.name != "test.jsonl")
    lp.write_text(lp.read_text() + "\n")
    assert load_benchmark("b4o-feasible", b4o).content_hash != before.content_hash


def test_report_states_the_fingerprint_and_covers_only_its_rows(tmp_path):
    model = _model(tmp_path / "A", b"weights")
    report = evaluate_items(ModelBackend(model), _items(2), tmp_path / "r", EvalConfig(), "nl4opt")
    fp = report["fingerprint"]
    assert len(fp["hash"]) == 12 and set(fp["components"]) == {"model", "backend", "prompt", "sampling", "benchmark",
                                                               "scoring", "execution"}
    assert fp["components"]["sampling"] == {"temperature": 0.0, "top_p": 1.0, "max_new_tokens": 256, "seed": 42,
                                            "stop": []}
    assert fp["components"]["model"]["from"] == "files" and fp["components"]["backend"] == {
        "kind": "native", "options": {"batch_size": 16}}
    assert json.loads((tmp_path / "r" / "report.json").read_text())["fingerprint"] == fp
    rows = read_samples(tmp_path / "r")
    assert all(r["fingerprint"] == fp for r in rows)
    foreign = [{**rows[0], "id": "x", "verdicts": {"rel": True, "abs": True, "orlm": True},
                "fingerprint": {"hash": "0" * 12, "components": {}}}]
    mixed = build_report(rows + foreign, EvalConfig(), fingerprint=fp)
    assert mixed["n"] == 2 and mixed["pass@1"] == 0.0 and mixed["fingerprint"] == fp


def test_rows_without_a_fingerprint_are_not_resumed(tmp_path):
    out = tmp_path / "r"
    out.mkdir()
    (out / "samples.jsonl").write_text(json.dumps({"benchmark": "nl4opt", "id": "q0", "outcome": "ok",
                                                   "verdicts": {"rel": True, "abs": True, "orlm": True}}) + "\n")
    with pytest.raises(FingerprintMismatch, match="before run fingerprints"):
        evaluate_items(ModelBackend(_model(tmp_path / "A", b"w")), _items(), out, EvalConfig(), "nl4opt")


def test_model_identity_from_manifest_files_or_endpoint(tmp_path):
    stage = tmp_path / "stage"
    _model(stage / "export", b"weights")
    ref = write_manifest(stage, "model", {})
    by_manifest = {"sha256": ref["hash"][:16], "from": "manifest"}
    assert model_identity(str(stage)) == by_manifest == model_identity(str(stage / "export"))
    assert model_identity(str(stage), model_hash=ref["hash"])["sha256"] == by_manifest["sha256"]
    plain = _model(tmp_path / "hf", b"weights")
    before = model_identity(str(plain))
    assert before["from"] == "files" and before["files"] == 3
    (plain / "README.md").write_text("notes")  # not a weight/config/tokenizer file
    assert model_identity(str(plain)) == before
    (plain / "model.safetensors").write_bytes(b"other weights")
    assert model_identity(str(plain))["sha256"] != before["sha256"]
    assert model_identity("trex", "openai", "http://127.0.0.1:8000/v1") == {"endpoint": "http://127.0.0.1:8000/v1",
                                                                           "name": "trex"}
    served = {"kind": "openai", "model": "trex", "options": {"base_url": "http://h:1/v1", "max_concurrency": 8}}
    fp = run_fingerprint(served, EvalConfig(), "nl4opt")
    assert fp["components"]["backend"] == {"kind": "openai", "options": {}}  # connection handling is not output
    moved = run_fingerprint({**served, "options": {"base_url": "http://h:2/v1", "max_concurrency": 2}}, EvalConfig(),
                            "nl4opt")
    assert moved["hash"] != fp["hash"]


def test_prompt_hash_follows_the_rendered_template():
    assert prompt_hash("reference", None) == prompt_hash("reference", None)
    assert len({prompt_hash("reference", None), prompt_hash("reference", "pyomo"), prompt_hash("synthetic", None)}) == 3
    with pytest.raises(ValueError, match="unknown prompt template"):
        prompt_hash("nope", None)
