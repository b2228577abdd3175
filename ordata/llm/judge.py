"""Judging what an endpoint wrote, without trusting it.

- Programs: executed in the sandbox that runs every untrusted program (:func:`eval.sandbox.run_programs`: a
  batch per bubblewrap sandbox, one forked process with its data files per program) and judged by the **last
  attested solve** against the instance's HiGHS optimum (``|p-g|/(|g|+1) <= 1e-6``; an infeasible instance needs
  an attested infeasible solve) -- exactly as curated reference programs are (``ordata/curate.py: verify``). What
  a program prints is a diagnostic, never the verdict. The reasons are :func:`eval.sandbox.rejection_reason`'s
  (``program_mismatch``, ``program_printed_without_solve``, ``program_error``, ...) plus ``no_program``.
- Rewrites: every number of the rendered problem must still appear as often as before (``rewrite_number_missing``:
  one was dropped or altered), no number may be added (``rewrite_number_added``), a DPS problem must still name
  its data file and every key of it in backticks, as the rendered problem does (``rewrite_key_missing``).
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass

from eval.benchmark_formats import BenchmarkItem
from eval.prompts import reference_messages
from eval.audit import side_effect_detail
from eval.sandbox import SOLVER_PRELOAD, Program, rejection_reason, run_programs
from eval.scoring import REL_TOL, is_correct
from trex.core.config import DataConfig

DATA_FILE = "data.json"
_NUMBER = re.compile(r"(?<![\w.])\d+(?:\.\d+)?(?!\w)")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
_PROBLEM = re.compile(r"<problem>(.*?)(?:</problem>|$)", re.DOTALL)


@dataclass
class Verdict:
    """``reason`` None: the program reproduced the instance's optimum. ``detail`` (for the records) compares with the
    truth; ``feedback`` (for a repair turn) says what went wrong without revealing the optimum."""

    reason: str | None
    detail: str = ""
    feedback: str = ""
    objective: float | None = None
    reported: str | None = None
    isolation: str | None = None


def judge_programs(programs: list[str | None], rows: list[dict], cfg: DataConfig) -> list[Verdict]:
    """Run ``programs[i]`` with ``rows[i]``'s data files in the sandbox and judge it against ``rows[i]``'s optimum."""
    todo = [i for i, p in enumerate(programs) if p is not None]
    verdicts = [Verdict("no_program", "the answer has no ```python block",
                        "the answer contains no complete ```python code block")] * len(programs)
    if not todo:
        return verdicts
    batch = max(1, -(-len(todo) // cfg.workers))
    results = run_programs([Program(programs[i], json.loads(rows[i]["files"])) for i in todo], cfg.program_timeout_s,
                           memory_mb=4096, isolation=cfg.isolation, allow_unisolated=cfg.allow_unisolated,
                           preload=SOLVER_PRELOAD, workers=cfg.workers, batch_size=batch, setting="data.isolation")
    for i, res in zip(todo, results):
        row = rows[i]
        reason = rejection_reason(res, is_correct(res.objective, res.reported, row["objective"], row["status"], REL_TOL))
        attested = f"attested {res.reported} {res.objective} (printed {res.printed_objective})"
        detail = (side_effect_detail(res) if res.side_effects else
                  f"{attested} vs solver {row['status']} {row['objective']}" if res.status in ("ok", "no_solve")
                  else f"{res.status}: {res.stderr_tail[-300:]}")
        verdicts[i] = Verdict(reason, detail if reason else attested, _feedback(reason, res), res.objective,
                              res.reported, res.isolation)
    return verdicts


def model_messages(row: dict, question: str) -> list[dict]:
    """The reference prompt asking an endpoint to model ``question`` with the instance's data files and solver API
    (the forward-modelling check and self-distillation)."""
    item = BenchmarkItem(id=row["id"], question=question, files=json.loads(row["files"]), ground_truth=row["objective"],
                         status=row["status"], category=row["category"], source="data-engine")
    return reference_messages(item, row["api"])


def _feedback(reason: str | None, res) -> str:
    if reason is None:
        return ""
    if reason.startswith("side-effect: "):
        return (f"it had a side effect ({side_effect_detail(res, 3)}): a program may only read its data files, build the model, solve it "
                "and print the result -- no network, no other processes, no files outside its working directory")
    if reason == "program_mismatch":
        got = "it is infeasible" if res.reported == "infeasible" else f"{res.reported}, objective {res.objective}"
        return (f"the solver's result ({got}) is not this problem's; check every data value, the objective "
                "sense and every constraint against the text")
    if reason == "program_printed_without_solve":
        return "the program printed a result without solving a model with the solver"
    if reason == "program_no_solve":
        return "the program finished without solving a model"
    if reason == "program_error":
        return f"it stopped with an error:\n{res.stderr_tail[-1500:]}"
    return f"it was stopped ({res.status.replace('_', ' ')})"


def numbers(text: str) -> Counter:
    """The numbers written in ``text`` (as values: ``5`` and ``5.0`` are one), with their counts."""
    return Counter(float(m) for m in _NUMBER.findall(_THOUSANDS.sub("", text)))


def extract_problem(text: str) -> str:
    """The rewritten problem between ``<problem>`` tags (an unclosed last tag counts), else ''."""
    found = [m.strip() for m in _PROBLEM.findall(text) if m.strip()]
    return found[-1] if found else ""


def _g(x: float) -> str:
    return f"{x:g}"


def check_rewrite(original: str, rewritten: str, representation: str, files: dict[str, str]) -> tuple[str, str] | None:
    """``(reason, detail)`` when a rewrite cannot be kept on its text alone, else None."""
    if not rewritten:
        return "rewrite_no_text", "no text between <problem> and </problem>"
    if " ".join(rewritten.split()) == " ".join(original.split()):
        return "rewrite_unchanged", "the rewrite is the original text"
    before, after = numbers(original), numbers(rewritten)
    missing, added = before - after, after - before
    if missing:
        return "rewrite_number_missing", ("these numbers of the problem are missing or were changed: "
                                          + ", ".join(_g(x) for x in sorted(missing.elements())))
    if added:
        return "rewrite_number_added", ("these numbers are not in the problem: "
                                        + ", ".join(_g(x) for x in sorted(added.elements())))
    if representation == "DPS" and DATA_FILE in files:
        gone = [f"`{k}`" for k in json.loads(files[DATA_FILE]) if f"`{k}`" not in rewritten]
        if DATA_FILE not in rewritten:
            gone.insert(0, DATA_FILE)
        if gone:
            return "rewrite_key_missing", "the data file or these keys of it (in backticks) are not named: " + \
                ", ".join(gone)
    return None
