"""Repair rounds: a failed program's error goes back to the model, which answers again (eval.repair_rounds)."""

from __future__ import annotations

import json

from eval.backends import OpenAIBackend
from eval.harness import evaluate_items, read_samples
from eval.prompts import execution_feedback
from eval.repair import needs_repair
from eval.serve import background_server
from tests.eval.test_harness import CannedBackend, _items
from trex.core.config import EvalConfig

CRASH = "```python\nraise RuntimeError('boom: the data key is called costs')\n```"
INFEASIBLE = ("```python\nimport highspy\nh = highspy.Highs()\nh.silent()\nx = h.addVariable(lb=0, ub=2, name='x')\n"
              "h.addConstr(x >= 3, name='need_x')\nh.minimize(x)\n```")


def _endpoint(answers: dict[str, str], stubborn: set[str] = frozenset()):
    """An OpenAI-compatible endpoint: a first answer that crashes; after a repair turn quoting the error, the right
    program (a ``stubborn`` problem crashes every time). Every conversation it received is kept."""
    from fastapi import FastAPI

    app, seen = FastAPI(), []

    @app.post("/v1/chat/completions")
    async def chat(body: dict):
        msgs = body["messages"]
        seen.append(msgs)
        tag = next(k for k in answers if k in msgs[1]["content"])
        repaired = len(msgs) > 2 and "boom: the data key is called costs" in msgs[-1]["content"]
        text = answers[tag] if repaired and tag not in stubborn else CRASH
        return {"choices": [{"message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 3, "completion_tokens": 4}}

    return app, seen


def test_an_endpoint_that_fixes_its_crash_after_seeing_the_error(tmp_path):
    items, answers = _items()
    answers["[problem-2]"] = answers["[problem-1]"].replace("[problem-1]", "[problem-2]")  # every item has a program
    items[2] = items[1].__class__(**{**items[1].__dict__, "id": "p2",
                                     "question": items[1].question.replace("[problem-1]", "[problem-2]")})
    items[3] = items[0].__class__(**{**items[0].__dict__, "id": "p3",
                                     "question": items[0].question.replace("[problem-0]", "[problem-3]")})
    answers["[problem-3]"] = answers["[problem-0]"]
    app, seen = _endpoint(answers)
    with background_server(app) as url:
        backend = OpenAIBackend("scripted", base_url=f"{url}/v1", backoff_s=0.01)
        report = evaluate_items(backend, items, tmp_path / "r2", EvalConfig(workers=1, repair_rounds=2),
                                "synthetic", template="synthetic")
        assert report["pass@1_first_attempt"] == 0.0 and report["pass@1"] >= 0.95
        assert report["repair"] == {"rounds": 2, "samples_repaired": 4, "rounds_used": {"1": 4}, "fixed": 4}
        turn = seen[-1]
        assert [m["role"] for m in turn] == ["system", "user", "assistant", "user"] and turn[2]["content"] == CRASH
        assert "RuntimeError: boom: the data key is called costs" in turn[3]["content"]
        rows = read_samples(tmp_path / "r2")
        assert all(r["first_attempt"]["outcome"] == "error" and r["outcome"] == "ok" for r in rows)
        assert all(r["completion"] == CRASH and len(r["repairs"]) == 1 for r in rows)
        saved = json.loads((tmp_path / "r2" / "report.json").read_text())
        assert saved["pass@1_first_attempt"] == 0.0 and saved["pass@1"] == report["pass@1"]

        none = evaluate_items(backend, items, tmp_path / "r0", EvalConfig(workers=1), "synthetic", template="synthetic")
        assert none["pass@1"] == none["pass@1_first_attempt"] == 0.0 and none["repair"]["samples_repaired"] == 0
        assert none["fingerprint"]["hash"] != report["fingerprint"]["hash"]


def test_a_program_that_never_recovers_uses_every_round(tmp_path):
    items, answers = _items()
    items, answers = items[:2], {k: v for k, v in answers.items() if k in ("[problem-0]", "[problem-1]")}
    app, seen = _endpoint(answers, stubborn={"[problem-1]"})
    with background_server(app) as url:
        backend = OpenAIBackend("scripted", base_url=f"{url}/v1", backoff_s=0.01)
        report = evaluate_items(backend, items, tmp_path, EvalConfig(workers=1, repair_rounds=3), "synthetic",
                                template="synthetic")
    assert report["pass@1"] == 0.5 and report["repair"]["rounds_used"] == {"1": 1, "3": 1}
    assert max(len(m) for m in seen) == 2 + 2 * 3  # the conversation grows by a turn pair per round


def test_an_infeasible_model_is_repaired_with_its_iis(tmp_path):
    items, answers = _items()
    items, tag = items[:1], "[problem-0]"
    backend = CannedBackend({tag: INFEASIBLE})
    report = evaluate_items(backend, items, tmp_path, EvalConfig(workers=1, repair_rounds=1), "synthetic",
                            template="synthetic")
    row = read_samples(tmp_path)[0]
    assert row["first_attempt"]["outcome"] == "ok" and row["first_attempt"]["objective"] is None
    feedback = row["repairs"][0]["feedback"]
    assert "reported the model as infeasible" in feedback and "constraints need_x" in feedback
    assert "bounds x" in feedback and report["repair"]["samples_repaired"] == 1


def test_only_failures_by_the_programs_own_run_are_repaired():
    """A wrong but attested optimum is not repaired: the expected answer never reaches the model."""
    ok = {"outcome": "ok", "objective": 3.0, "verdicts": {"rel": False}}
    assert not needs_repair(ok)
    assert needs_repair({"outcome": "ok", "objective": None}) and needs_repair({"outcome": "no_program", "objective": None})
    assert needs_repair({"outcome": "timeout", "objective": None})
    assert not needs_repair({"outcome": "lp_only", "objective": None, "lp_check": {"error": "x"}})
    assert execution_feedback("timeout", None) == "it did not finish within its time limit"
    assert "Traceback" in execution_feedback("error", {"stderr_tail": "noise\nTraceback (most recent call last):\nX"})
