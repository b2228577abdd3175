"""Repair dialogues for SFT: a verified program mutated into one that fails, its real error, then the fix.

``data.sft.repair_fraction`` of the SFT problems answered by a program also become a five-turn chat:

    system, user (the problem), assistant (the mutated program; ``"train": False``: context, not a target),
    user (``eval.prompts.PROGRAM_REPAIR`` quoting what the sandbox reported: the trimmed traceback),
    assistant (the verified program: the target)

which is exactly the conversation evaluation's repair rounds (``eval.repair_rounds``) hold, so the model learns to
read an error and fix its program. A mutation (:data:`MUTATIONS`, chosen per problem from a seeded order) must make
the program fail by itself: a data key misspelt (``KeyError``), a solver method misnamed (``AttributeError``), an
import dropped (``NameError``). Every mutant runs in the sandbox like any program; only one that stops with an error
(and no side effect) gives a dialogue, its error the one quoted. Accounting (``repair``): ``in`` = the problems tried,
``kept`` = dialogues, rejected ``repair_no_mutation`` (nothing to mutate) or ``repair_mutant_did_not_fail``.
"""

from __future__ import annotations

import json
import random
import re
from collections import Counter

from eval.prompts import PROGRAM_REPAIR, SYSTEM_PROMPT, execution_feedback, user_prompt
from eval.sandbox import Program, preload_for, run_programs
from ordata.render import assistant_answer

# solver-API calls and a wrong name for each (an AttributeError when the program runs)
WRONG_METHODS = {"highspy": [(".addVariable(", ".addVar("), (".addConstr(", ".addConstraint("),
                             (".maximize(", ".maximise("), (".minimize(", ".minimise(")],
                 "gurobipy": [(".addVar(", ".addVariable("), (".addConstr(", ".addConstraint("),
                              (".setObjective(", ".setObj(")],
                 "pyomo": [("pyo.Var(", "pyo.Variable("), ("pyo.Constraint(", "pyo.Constraints("),
                           ("pyo.Objective(", "pyo.Objectives(")]}


def _data_key(program: str, files: dict, rng: random.Random) -> str | None:
    """A key of the data file read by the program, misspelt at one of its uses (KeyError)."""
    keys = set()
    for text in files.values():
        try:
            data = json.loads(text)
        except ValueError:
            continue
        if isinstance(data, dict):
            keys |= {k for k in data if isinstance(k, str)}
    used = [m for m in re.finditer(r"\[(['\"])(\w+)\1\]", program) if m.group(2) in keys]
    if not used:
        return None
    m = rng.choice(used)
    return program[:m.start(2)] + m.group(2) + "_values" + program[m.end(2):]


def _method(program: str, api: str, rng: random.Random) -> str | None:
    """A solver method called by its wrong name (AttributeError)."""
    options = [(a, b) for a, b in WRONG_METHODS.get(api, []) if a in program]
    if not options:
        return None
    right, wrong = rng.choice(options)
    return program.replace(right, wrong, 1)


def _import(program: str, rng: random.Random) -> str | None:
    """An import the program needs, dropped (NameError)."""
    lines = program.splitlines(keepends=True)
    imports = [i for i, line in enumerate(lines) if re.match(r"(import \w+|from \w+ import)", line)
               and not line.startswith("from __future__")]
    if not imports:
        return None
    del lines[rng.choice(imports)]
    return "".join(lines)


MUTATIONS = ("data_key", "method", "import")


def mutate(row: dict, rng: random.Random) -> tuple[str, str] | None:
    """``(mutation, program)``: the first mutation of a seeded order that applies to ``row``'s program; None if none."""
    files = json.loads(row["files"]) if isinstance(row["files"], str) else dict(row["files"] or {})
    for name in rng.sample(MUTATIONS, len(MUTATIONS)):
        program = {"data_key": lambda: _data_key(row["program"], files, rng),
                   "method": lambda: _method(row["program"], row["api"], rng),
                   "import": lambda: _import(row["program"], rng)}[name]()
        if program is not None and program != row["program"]:
            return name, program
    return None


def repair_dialogues(rows: list[dict], cfg, rejections: list[dict]) -> tuple[list[dict], dict]:
    """Repair dialogues for ``data.sft.repair_fraction`` of ``rows`` (verified SFT problems with programs), and the
    stage's accounting (module docstring). Seeded by ``data.seed``."""
    rng = random.Random(cfg.seed * 7919 + 17)
    n = round(len(rows) * cfg.sft.repair_fraction)
    chosen = rng.sample(rows, min(n, len(rows))) if n else []
    mutants, tried = [], Counter()
    for row in chosen:
        got = mutate(row, random.Random(f"{cfg.seed}:{row['id']}"))
        if got is None:
            rejections.append({"id": row["id"], "family": row["family"], "reason": "repair_no_mutation",
                               "stage": "repair"})
            continue
        mutants.append((row, *got))
        tried[got[0]] += 1
    results = run_programs([Program(p, json.loads(r["files"]) if isinstance(r["files"], str) else r["files"])
                            for r, _, p in mutants], cfg.program_timeout_s, memory_mb=4096, isolation=cfg.isolation,
                           allow_unisolated=cfg.allow_unisolated, preload=preload_for(cfg.apis), workers=cfg.workers,
                           setting="data.isolation") if mutants else []
    out = []
    for (row, how, program), res in zip(mutants, results):
        if res.status != "error" or res.side_effects:
            rejections.append({"id": row["id"], "family": row["family"], "reason": "repair_mutant_did_not_fail",
                               "stage": "repair", "detail": f"{how}: {res.status}"})
            continue
        feedback = execution_feedback("error", res.to_dict())
        messages = [{"role": "system", "content": SYSTEM_PROMPT},
                    {"role": "user", "content": user_prompt(row["question"], row["api"], "code_only")},
                    {"role": "assistant", "content": f"```python\n{program}```", "train": False},
                    {"role": "user", "content": PROGRAM_REPAIR.format(problem=feedback)},
                    {"role": "assistant", "content": assistant_answer(row, "code_only")}]
        keep = ("family", "category", "representation", "api", "question", "files", "objective", "status")
        out.append({"id": f"{row['id']}-repair", **{k: row[k] for k in keep}, "style": "repair",
                    "messages": messages, "question_source": row.get("question_source", "template"),
                    "answer_source": f"repair:{how}"})
    return out, {"in": len(chosen), "kept": len(out), "quarantined": 0, "mutations": dict(tried)}
