"""The evaluate-benchmarks flow: a model export on a benchmark file, recorded in MLflow, resumed/cached."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.flows.test_lifecycle_e2e import children, runs_of
from tests.prefect_server import flow_env
from tests.trainer.helpers import tiny_model
from trainer.export import export
from trainer.tokenizer import train_tokenizer

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests/eval/fixtures/benchmarks/orlm.jsonl"
SNIPPET = """
import json, sys
from flows.evaluate import benchmarks_flow
print(json.dumps(benchmarks_flow(model=sys.argv[1], benchmarks=["nl4opt-orlm"], data=sys.argv[2],
                                 config="configs/micro.yaml", overrides=sys.argv[3:])))
"""


@pytest.mark.slow
def test_benchmarks_flow_evaluates_records_and_caches(tmp_path):
    train_tokenizer(["maximise profit subject to hours " * 20, "print('Optimal objective:', 1)"], tmp_path / "tok", 300)
    from trainer.tokenizer import ChatTokenizer

    export(tiny_model(vocab=ChatTokenizer(tmp_path / "tok").vocab_size, max_seq_len=1024), tmp_path / "tok",
           tmp_path / "model")
    state = tmp_path / "state"
    env = flow_env()
    cmd = [sys.executable, "-c", SNIPPET, str(tmp_path / "model"), str(FIXTURE), f"run.state_dir={state}",
           "eval.max_new_tokens=8", "eval.batch_size=4"]
    first = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr[-4000:]
    metrics = json.loads(first.stdout.strip().splitlines()[-1])
    assert 0.0 <= metrics["pass_at_1_nl4opt-orlm"] <= 1.0
    (out,) = list((state / "outputs" / "eval-bench").iterdir())
    rows = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    report = json.loads((out / "report.json").read_text())
    assert len(rows) == report["n"] + report["unjudged"] and report["backend"]["kind"] == "native"
    assert json.loads((out / "manifest.json").read_text())["kind"] == "eval"
    c, runs = runs_of(state)
    (parent,) = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    kid = children(runs, parent.info.run_id)["evaluate-nl4opt-orlm"]
    assert "pass_at_1_rel" in kid.data.metrics and "pass_at_1_abs" in kid.data.metrics
    assert any(a.path == "eval_samples_nl4opt-orlm.json" for a in c.list_artifacts(kid.info.run_id))
    second = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stderr[-4000:]
    _, runs = runs_of(state)
    latest = max((r for r in runs if "mlflow.parentRunId" not in r.data.tags), key=lambda r: r.info.start_time)
    assert "evaluate-nl4opt-orlm (cached)" in children(runs, latest.info.run_id)
