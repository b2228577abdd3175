"""Repair rounds (``eval.repair_rounds``): a program that fails gets its error back and the model answers again.

A sample needs repair when its program failed by what its own run shows (:func:`needs_repair`) -- never by a
comparison with the expected answer, which the model must not learn. The conversation continues with the model's
answer and a user turn quoting the trimmed traceback, the limit it hit or the solver's status with an
irreducible infeasible subsystem where the solver gives one (:func:`eval.prompts.execution_feedback`); the new
answer is executed and judged like the first, up to ``rounds`` times, for any backend (a backend takes
conversations). The harness keeps ``pass@1_first_attempt`` beside the final ``pass@1`` (:func:`repair_summary`).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable

from eval.benchmark_formats import BenchmarkItem
from eval.prompts import execution_feedback, repair_turn

REPAIR_SEED_STRIDE = 7_919_999  # repair round r of a sample is sampled with its seed + r * this stride
# a sample whose program failed on its own terms (the expected answer plays no part): repaired when asked
REPAIRABLE = ("error", "timeout", "cpu_limit", "memory_limit", "output_limit", "killed", "no_solve", "no_program")
# (conversations, their problems' positions, a seed offset) -> completions; (items, answers) -> judged records
Generate = Callable[[list, list[int], int], list]
Execute = Callable[[list[BenchmarkItem], list[str]], list[dict]]


def needs_repair(rec: dict) -> bool:
    """The program failed by what its own run shows: an exception, a limit, no solve, no program, or a solve
    with no attested objective (infeasible, unbounded, a limit). LP-structure items are not repaired."""
    if rec.get("lp_check") is not None:
        return False
    return rec["outcome"] in REPAIRABLE or (rec["outcome"] == "ok" and rec["objective"] is None)


def repair(generate: Generate, execute: Execute, items: list[BenchmarkItem], positions: list[int], messages: list,
           texts: list[str], judged: list[dict], rounds: int) -> list[dict]:
    """Up to ``rounds`` follow-up turns: each failed sample's conversation continues with its answer
    and a user turn quoting what its program did (:func:`eval.prompts.execution_feedback`), and the new answer
    is run and judged. A record keeps its first attempt (``first_attempt``) and the turns (``repairs``: feedback,
    answer, outcome); its ``program``, ``outcome`` and ``verdicts`` are the last answer's, its row's
    ``completion`` the first answer."""
    convo, texts = [list(m) for m in messages], list(texts)
    for rec in judged:
        rec["first_attempt"] = {"outcome": rec["outcome"], "objective": rec["objective"],
                                "verdicts": rec["verdicts"], "side_effects": rec["side_effects"]}
        rec["repairs"] = []
    for r in range(1, rounds + 1):
        todo = [i for i, rec in enumerate(judged) if needs_repair(rec)]
        if not todo:
            break
        turns = [repair_turn(convo[i], texts[i], execution_feedback(judged[i]["outcome"], judged[i]["exec"]))
                 for i in todo]
        answers = generate(turns, [positions[i] for i in todo], r * REPAIR_SEED_STRIDE)
        redone = execute([items[i] for i in todo], [a.text for a in answers])
        for i, turn, answer, rec in zip(todo, turns, answers, redone):
            old = judged[i]
            convo[i], texts[i] = turn, answer.text
            judged[i] = {**rec, "first_attempt": old["first_attempt"],
                         "repairs": old["repairs"] + [{"feedback": turn[-1]["content"], "completion": answer.text,
                                                       "outcome": rec["outcome"]}]}
    return judged


def repair_summary(rows: list[dict], rounds: int) -> dict:
    """How the repair rounds went: samples repaired, rounds each used, and how many failed first and passed last."""
    used: dict[str, int] = defaultdict(int)
    fixed = 0
    for r in rows:
        used[str(len(r.get("repairs") or []))] += 1
        first = (r.get("first_attempt") or {}).get("verdicts") or {}
        fixed += bool(r.get("repairs")) and not first.get("rel") and bool((r.get("verdicts") or {}).get("rel"))
    return {"rounds": rounds, "samples_repaired": sum(v for k, v in used.items() if k != "0"),
            "rounds_used": dict(sorted(used.items())), "fixed": fixed}
