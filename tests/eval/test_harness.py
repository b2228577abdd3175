import json
import random

from eval.harness import score
from ordata.families import get_family
from ordata.ir import solve_highs
from trex.config import EvalConfig


def test_score_runs_dps_programs_with_their_data_file_and_groups_results(tmp_path):
    problems, completions = [], []
    for i, (rep, api) in enumerate([("DPS", "pyomo"), ("DT", "gurobipy"), ("DP", "highspy")]):
        spec = get_family("diet").sample(random.Random(i), 2, "LP")
        r = spec.render(rep, api)
        problems.append({"id": f"p{i}", "family": spec.family, "category": spec.category, "representation": rep,
                         "api": api, "question": r.question, "objective": solve_highs(spec.ir).objective,
                         "files": json.dumps({k: v.decode() for k, v in r.files.items()})})
        completions.append(f"Here is the model.\n```python\n{r.program}```")
    completions[2] = "no code at all"
    report = score(problems, completions, EvalConfig(workers=2), tmp_path)
    assert report["n"] == 3 and abs(report["pass@1"] - 2 / 3) < 1e-9
    assert report["per_representation"] == {"DP": 0.0, "DPS": 1.0, "DT": 1.0}
    assert report["no_program_rate"] == 1 / 3
    lines = [json.loads(x) for x in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [x["outcome"] for x in lines] == ["ok", "ok", "no_program"]
