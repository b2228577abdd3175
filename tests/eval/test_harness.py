import json
import random

import pytest

from eval.backends import Completion
from eval.benchmark_formats import BenchmarkItem
from eval.harness import build_report, evaluate_items, read_samples
from eval.scoring import objective_passes, verdicts
from ordata.families import get_family
from ordata.ir import solve_highs
from trex.core.config import EvalConfig


class CannedBackend:
    """Answers each prompt with a prepared completion (keyed by the item id in the user message)."""

    def __init__(self, answers: dict[str, str]):
        self.answers, self.calls = answers, 0

    def generate(self, messages_list, params):
        self.calls += len(messages_list)
        out = []
        for m in messages_list:
            question = next(x["content"] for x in m if x["role"] == "user")  # a repair turn keeps the first one
            key = next(k for k in self.answers if k in question)
            out.append(Completion(self.answers[key], 10, 20, "stop"))
        return out

    def describe(self):
        return {"kind": "canned"}


def _items():
    items, answers = [], {}
    for i, (rep, api) in enumerate([("DPS", "pyomo"), ("DT", "gurobipy"), ("DP", "highspy"), ("DP", "highspy")]):
        spec = get_family("diet").sample(random.Random(i), 2, "LP")
        r = spec.render(rep, api)
        tag = f"[problem-{i}]"
        items.append(BenchmarkItem(id=f"p{i}", question=f"{tag} {r.question}", ground_truth=solve_highs(spec.ir).objective,
                                   status="optimal", category=spec.category, source="test",
                                   files={k: v.decode() for k, v in r.files.items()},
                                   extra={"family": spec.family, "representation": rep, "api": api}))
        answers[tag] = f"Here is the model.\n```python\n{r.program}```"
    answers["[problem-2]"] = "no code at all"
    # prints the right optimum but solves a different problem: judged by the attested solve, it fails
    fake = ("import highspy\nh = highspy.Highs()\nh.silent()\nx = h.addVariable(lb=0, ub=1)\nh.maximize(x)\n"
            f"print('Optimal objective:', {items[3].ground_truth})")
    answers["[problem-3]"] = f"```python\n{fake}\n```"
    return items, answers


def test_evaluate_items_judges_attested_solves_and_groups_results(tmp_path):
    items, answers = _items()
    backend = CannedBackend(answers)
    report = evaluate_items(backend, items, tmp_path, EvalConfig(workers=2), "synthetic", template="synthetic")
    assert report["n"] == 4 and report["pass@1"] == 0.5
    assert report["pass@1_by_rule"] == {"rel": 0.5, "abs": 0.5, "orlm": 0.5}
    assert report["per_representation"]["DPS"]["pass@1_rel"] == 1.0 and report["per_representation"]["DT"]["pass@1_rel"] == 1.0
    assert report["no_program_rate"] == 0.25 and report["outcomes"]["no_program"] == 1
    rows = read_samples(tmp_path)
    assert [r["outcome"] for r in rows] == ["ok", "ok", "no_program", "ok"]
    fake = rows[3]
    assert fake["exec"]["printed_objective"] == pytest.approx(items[3].ground_truth) and fake["objective"] == 1.0
    assert fake["verdicts"] == {"rel": False, "abs": False, "orlm": False}
    assert rows[0]["messages"][-1]["role"] == "user" and rows[0]["solver"] == "pyomo"
    assert json.loads((tmp_path / "report.json").read_text())["n"] == 4


def test_a_crashed_run_resumes_where_it_stopped(tmp_path):
    items, answers = _items()
    first = CannedBackend(answers)
    evaluate_items(first, items[:2], tmp_path, EvalConfig(workers=2, batch_size=1), "synthetic", template="synthetic")
    with open(tmp_path / "samples.jsonl", "a") as f:
        f.write('{"benchmark": "synthetic", "id": "p2", "torn')  # a crash in the middle of a line
    again = CannedBackend(answers)
    report = evaluate_items(again, items, tmp_path, EvalConfig(workers=2), "synthetic", template="synthetic")
    assert again.calls == 2 and report["n"] == 4  # only the two missing items were generated
    assert [r["id"] for r in read_samples(tmp_path)] == ["p0", "p1", "p2", "p3"]


def test_scoring_rules_side_by_side():
    assert objective_passes(1e7 + 1e-3, 1e7, "rel") and not objective_passes(1e7 + 1e-3, 1e7, "abs")
    assert objective_passes(0.5 + 5e-7, 0.5, "abs") and objective_passes(0.5 + 5e-7, 0.5, "rel")
    assert objective_passes(104.0, 100.0, "orlm") and not objective_passes(106.0, 100.0, "orlm")
    assert not objective_passes(104.0, 100.0, "rel") and not objective_passes(None, 1.0, "rel")
    assert objective_passes(0.001, 0.0, "orlm") and not objective_passes(0.01, 0.0, "orlm")
    assert verdicts(None, "infeasible", None, "infeasible") == {"rel": True, "abs": True, "orlm": True}
    assert verdicts(None, "infeasible_or_unbounded", None, "infeasible")["rel"] is False
    assert verdicts(5.0, "optimal", None, "unknown") is None
    with pytest.raises(ValueError, match="unknown rule"):
        objective_passes(1.0, 1.0, "approx")


def test_report_counts_unjudged_items_separately():
    rows = [{"benchmark": "b", "id": "1", "outcome": "ok", "verdicts": {"rel": True, "abs": True, "orlm": True}},
            {"benchmark": "b", "id": "2", "outcome": "timeout", "verdicts": {"rel": False, "abs": False, "orlm": False}},
            {"benchmark": "b", "id": "3", "outcome": "ok", "verdicts": None}]
    report = build_report(rows, EvalConfig())
    assert report["n"] == 2 and report["unjudged"] == 1 and report["pass@1"] == 0.5
    assert report["execution_error_rate"] == 0.5 and report["per_benchmark"]["b"]["n"] == 2


def test_lp_output_items_are_judged_by_structure(tmp_path):
    pytest.importorskip("networkx")
    ref = tmp_path / "ref.lp"
    ref.write_text("Maximize\n obj: 3 x + 2 y\nSubject To\n c1: x + y <= 4\n c2: x + 3 y <= 6\nBounds\n x <= 3\nEnd\n")
    item = BenchmarkItem(id="lp1", question="[lp-1] maximise", ground_truth=None, status="unknown", category="LP",
                         source="test", files={}, extra={"scoring": "lp_structure", "reference_lp": str(ref)})
    same = ("import highspy\nh = highspy.Highs()\nh.silent()\ny = h.addVariable(lb=0, name='b')\n"
            "x = h.addVariable(lb=0, ub=3, name='a')\nh.addConstr(3 * y + x <= 6)\nh.addConstr(y + x <= 4)\n"
            "h.maximize(2 * y + 3 * x)\nh.writeModel('model.lp')\n")
    out = tmp_path / "run"
    report = evaluate_items(CannedBackend({"[lp-1]": f"```python\n{same}```"}), [item], out, EvalConfig(), "b4o-orgeval")
    row = read_samples(out)[0]
    assert row["lp_check"]["equivalent"] is True and report["pass@1"] == 1.0
    other = same.replace("<= 6", "<= 7")
    report = evaluate_items(CannedBackend({"[lp-1]": f"```python\n{other}```"}), [item], tmp_path / "run2", EvalConfig(),
                            "b4o-orgeval")
    assert report["pass@1"] == 0.0


class SeededBackend(CannedBackend):
    """Right on problem 0 always, on problem 1 only when request ``i``'s seed ``params.seed + i`` is even,
    never on 2 and 3 (as ``_items`` answers them): a sampled model's verdicts."""

    def __init__(self, answers, wrong: str):
        super().__init__(answers)
        self.wrong, self.seeds = wrong, []

    def generate(self, messages_list, params):
        out = super().generate(messages_list, params)
        for i, m in enumerate(messages_list):
            self.seeds.append(params.seed + i)
            if "[problem-1]" in m[-1]["content"] and (params.seed + i) % 2:
                out[i] = Completion(self.wrong, 10, 20, "stop")
        return out


def test_several_samples_per_problem_give_pass_at_k_and_an_interval_and_resume(tmp_path):
    items, answers = _items()
    wrong = answers["[problem-3]"]
    cfg = EvalConfig(workers=2, samples=4, temperature=0.6, batch_size=4)
    backend = SeededBackend(answers, wrong)
    evaluate_items(backend, items[:2], tmp_path, cfg.model_copy(update={"samples": 2}), "synthetic",
                   template="synthetic")  # a first run that stopped after two samples of each problem
    again = SeededBackend(answers, wrong)
    report = evaluate_items(again, items, tmp_path, cfg, "synthetic", template="synthetic")
    assert again.calls == 4 * 4 - 2 * 2  # only the missing (problem, sample) pairs were generated
    rows = read_samples(tmp_path)
    assert sorted((r["id"], r["sample"]) for r in rows) == sorted((f"p{i}", j) for i in range(4) for j in range(4))
    assert len(set(backend.seeds + again.seeds)) == 16  # every (problem, sample) had a seed of its own
    p1 = [r["verdicts"]["rel"] for r in sorted(rows, key=lambda r: r["sample"]) if r["id"] == "p1"]
    assert p1 == [(cfg.seed + 1 + j * 1_000_003) % 2 == 0 for j in range(4)]
    share = sum(p1) / 4
    assert report["pass@1"] == pytest.approx((1.0 + share + 0 + 0) / 4)
    assert report["problems"] == 4 and report["n"] == 16 and report["sampling"]["samples_per_problem"] == 4
    # pass@k: problem 0 always, problem 1 once it has one correct sample among k
    from eval.stats import pass_at_k
    for k in (1, 2, 4):
        assert report["pass@k"][str(k)] == pytest.approx((1 + pass_at_k(4, sum(p1), k)) / 4)
    ci = report["pass@1_ci"]
    assert ci["method"].startswith("percentile bootstrap") and ci["low"] <= report["pass@1"] <= ci["high"]
    assert report["per_family"]["diet"]["problems"] == 4


def test_one_sample_per_problem_reports_a_wilson_interval(tmp_path):
    items, answers = _items()
    report = evaluate_items(CannedBackend(answers), items, tmp_path, EvalConfig(workers=2), "synthetic",
                            template="synthetic")
    from eval.stats import wilson
    assert report["pass@1_ci"]["method"] == "wilson"
    assert (report["pass@1_ci"]["low"], report["pass@1_ci"]["high"]) == pytest.approx(wilson(2, 4))
    assert report["pass@k"] == {"1": 0.5}


def test_side_effects_are_listed_and_fail_only_when_configured(tmp_path):
    """A correct program that also opens a socket keeps its score (its effects listed in report.json, the rows and
    the sample table) unless eval.side_effects=fail, which scores it 0; the plain correct programs pass either way."""
    from tasks.evaluate import sample_table

    items, answers = _items()
    program = answers["[problem-0]"].split("```python\n", 1)[1].rsplit("```", 1)[0]
    answers["[problem-0]"] = ("```python\nimport socket\ns = socket.socket()\ns.settimeout(1)\ntry:\n"
                              "    s.connect(('10.0.0.9', 80))\nexcept OSError:\n    pass\n" + program + "```")
    reports = {}
    for mode in ("report", "fail"):
        out = tmp_path / mode
        reports[mode] = evaluate_items(CannedBackend(answers), items, out, EvalConfig(workers=1, side_effects=mode),
                                       "synthetic", template="synthetic")
        rows = {r["id"]: r for r in read_samples(out)}
        assert rows["p0"]["side_effects"] == ["socket.connect"] and rows["p1"]["side_effects"] == []
        effects = reports[mode]["side_effects"]
        assert effects["samples"] == 1 and effects["by_kind"] == {"socket.connect": 1}
        assert effects["listed"][0]["id"] == "p0" and "10.0.0.9" in effects["listed"][0]["side_effects"][0]["detail"]
        assert {r["id"]: r["side_effects"] for r in sample_table(out)}["p0"] == "socket.connect"
        assert json.loads((out / "report.json").read_text())["side_effects"]["samples"] == 1
    assert reports["report"]["pass@1"] == 0.5 and reports["fail"]["pass@1"] == 0.25
    assert reports["report"]["fingerprint"]["hash"] != reports["fail"]["fingerprint"]["hash"]
