import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROGRAM = ("import json, highspy\nd = json.load(open('data.json'))\nh = highspy.Highs()\nh.silent()\n"
           "x = h.addVariable(lb=0, ub=d['ub'])\nh.maximize(d['c'] * x)\nprint('Optimal objective:', 1)\n")


def trex(*args, timeout=300):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_"))}
    return subprocess.run([sys.executable, "-m", "trex.cli", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_eval_exec_prints_one_attested_json_result(tmp_path):
    (tmp_path / "p.py").write_text(PROGRAM)
    (tmp_path / "data.json").write_text('{"ub": 4, "c": 2.5}')
    res = trex("eval", "exec", "--code", str(tmp_path / "p.py"), "--data", str(tmp_path / "data.json"))
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["status"] == "ok" and out["objective"] == 10.0 and out["solver"] == "highspy"
    assert out["printed_objective"] == 1.0 and out["isolation"] == "bwrap" and out["seconds"] > 0


def test_eval_exec_and_references_name_bad_inputs(tmp_path):
    res = trex("eval", "exec", "--code", str(tmp_path / "missing.py"))
    assert res.returncode == 2 and "missing.py: no such program file" in res.stderr
    res = trex("eval", "references", "--benchmark", "nl4opt", "--data-dir", str(tmp_path))
    assert res.returncode == 2 and "unknown benchmark 'nl4opt'" in res.stderr
    res = trex("eval", "run", "--benchmark", "no-such-bench", "--model", str(tmp_path), "--backend", "openai",
               "--base-url", "http://127.0.0.1:9/v1")
    assert res.returncode == 2 and "no-such-bench" in res.stderr


def test_eval_benchmarks_lists_the_registry():
    res = trex("eval", "benchmarks")
    keys = {json.loads(line)["key"] for line in res.stdout.splitlines()}
    assert {"nl4opt", "optibench", "b4o-feasible", "b4o-orgeval", "mamo-easylp", "mamo-complexlp", "industryor",
            "optmath", "nlp4lp", "complexor", "synthetic"} <= keys


def test_eval_run_refuses_another_models_rows_until_overwrite(tmp_path, monkeypatch):
    """Model B evaluated into model A's results directory: an error naming what differs, not A's rows."""
    from typer.testing import CliRunner

    import eval.backends
    from tests.eval.test_fingerprint import ModelBackend, _model
    from trex.cli import app

    made = []
    monkeypatch.setattr(eval.backends, "make_backend",
                        lambda kind, model, **opts: made.append(ModelBackend(Path(model))) or made[-1])
    a, b = _model(tmp_path / "A", b"weights-A"), _model(tmp_path / "B", b"weights-B")
    fixture = ROOT / "tests/eval/fixtures/benchmarks/orlm.jsonl"
    out = tmp_path / "results"

    def run(model, *extra):
        return CliRunner().invoke(app, ["eval", "run", "--benchmark", "nl4opt-orlm", "--data", str(fixture),
                                        "--model", str(model), "--out", str(out), *extra])

    first = run(a)
    assert first.exit_code == 0, first.output
    fp_a = json.loads(first.output[first.output.index("{\n"):])["nl4opt-orlm"]["fingerprint"]
    again = run(a)
    assert again.exit_code == 0 and made[-1].calls == 0  # same run: resumed, nothing regenerated
    res = run(b)
    assert res.exit_code == 2 and made[-1].calls == 0
    assert str(out / "nl4opt-orlm" / "samples.jsonl") in res.output and "model.sha256" in res.output
    assert "--out" in res.output and "--overwrite" in res.output
    res = run(b, "--overwrite")
    assert res.exit_code == 0, res.output
    fp_b = json.loads(res.output[res.output.index("{\n"):])["nl4opt-orlm"]["fingerprint"]
    report = json.loads((out / "nl4opt-orlm" / "report.json").read_text())
    assert fp_b != fp_a and report["fingerprint"]["hash"] == fp_b and made[-1].calls == report["n"] + report["unjudged"]
