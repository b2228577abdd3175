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
    assert out["printed_objective"] == 1.0 and out["isolation"] in ("bwrap", "netns") and out["seconds"] > 0


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
