"""Verified instances rendered as training text: SFT chats (three answer styles), CPT documents, seed records.

An SFT answer is the template's (the reference program, the math model, or both) unless self-distillation
(``ordata/llm/distill.py``) stored a verified answer in the row (``distilled``: the endpoint model's reasoning,
mathematical model and program, whose program's attested solve reproduced the optimum); then the style is
assembled from those parts, the reasoning first as ``<think>...</think>``. Every chat records where its question
and its answer came from (``question_source``, ``answer_source``: ``template``, ``rewrite@<model>``,
``distilled@<model>``, ``seed:<source>``).
"""

from __future__ import annotations

from eval.prompts import SYSTEM_PROMPT, user_prompt
from ordata.instances import TEMPLATE

STYLES = ("code_only", "math_model_with_code", "math_model")


def _result(row: dict) -> str:
    if row.get("status") == "infeasible":
        return "No solution satisfies every constraint: the problem is infeasible."
    return f"The optimal objective value is {row['objective']:.6g}."


def assistant_answer(row: dict, style: str = "code_only") -> str:
    """The SFT answer: the program, the math model with the program, or the math model with the optimum."""
    if style not in STYLES:
        raise ValueError(f"unknown answer style {style!r}")
    if row.get("distilled"):
        return distilled_answer(row["distilled"], row, style)
    code = f"```python\n{row['program']}```"
    if style == "code_only":
        return code
    if style == "math_model_with_code":
        return f"{row['math_model']}\n{code}"
    return f"{row['math_model']}\n{_result(row)}"


def distilled_answer(parts: dict, row: dict, style: str) -> str:
    """A distilled answer in ``style``: ``<think>`` reasoning, then the program, the model and the program, or the
    model and the (verified) optimum."""
    think = f"<think>\n{parts['think'].strip()}\n</think>\n\n"
    code = f"```python\n{parts['program'].rstrip()}\n```"
    if style == "code_only":
        return think + code
    if style == "math_model_with_code":
        return f"{think}{parts['model'].strip()}\n\n{code}"
    return f"{think}{parts['model'].strip()}\n\n{_result(row)}"


def chat_row(row: dict, style: str) -> dict:
    messages = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": user_prompt(row["question"], row["api"], style)},
        {"role": "assistant", "content": assistant_answer(row, style)},
    ]
    keep = ("id", "family", "category", "representation", "api", "question", "files", "objective", "status")
    return {**{k: row[k] for k in keep}, "style": style, "messages": messages,
            "question_source": row.get("question_source", TEMPLATE), "answer_source": row.get("answer_source", TEMPLATE)}


def cpt_document(row: dict, kind: int) -> str:
    """Render a CPT document from a solved problem: model report, modelling rationale or code walk-through.

    Every kind carries the verified program, so pre-training already practises reading data off a
    problem statement into code.
    """
    q, obj, prog = row["question"], row["objective"], row["program"]
    direction = "maximum" if row["sense"] == "max" else "minimum"
    infeasible = row.get("status") == "infeasible"
    if kind == 0:
        result = ("HiGHS proves that no solution satisfies all constraints: the model is infeasible." if infeasible
                  else f"HiGHS proves the {direction} objective value is {obj:g}.")
        return (f"# Model report\n\n{q}\n\n## Mathematical model\n{row['math_model']}\n## Implementation\n"
                f"```python\n{prog}```\n## Result\n{result}\n")
    if kind == 1:
        result = "The constraints contradict each other: the problem is infeasible." if infeasible \
            else f"The optimal value is {obj:g}."
        return (f"Problem. {q}\n\nModelling rationale. We identify the decisions, then write the {direction} "
                f"objective and one constraint per limited quantity.\n{row['math_model']}\nCode:\n```python\n{prog}```\n"
                f"{result}\n")
    output = "Status: Infeasible" if infeasible else f"Optimal objective: {obj:g}"
    return f"Problem: {q}\n\nSolver program:\n```python\n{prog}```\nOutput: {output}\n"


def seed_chat(r: dict) -> dict:
    """A verified seed record (its program attested) as an SFT chat: the seed's own question and answer."""
    source = f"seed:{r['source']}"
    return {"id": r["origin"], "family": source, "category": "seed", "representation": "seed",
            "api": "seed", "question": r["question"], "files": "{}", "objective": r["objective"], "status": r["status"],
            "style": "seed", "messages": [{"role": "system", "content": SYSTEM_PROMPT},
                                          {"role": "user", "content": r["question"]},
                                          {"role": "assistant", "content": r["answer"]}],
            "question_source": source, "answer_source": source}


def seed_document(r: dict) -> dict:
    """A verified seed record as a CPT document (question, the seed's answer and the attested result)."""
    result = ("A solver proves the problem infeasible." if r["status"] == "infeasible"
              else f"The solver attests the optimal objective value {r['objective']:g}.")
    return {"id": r["origin"], "family": f"seed:{r['source']}", "source": r["source"],
            "text": f"Problem: {r['question']}\n\nSolution:\n{r['answer']}\n\n{result}\n"}
