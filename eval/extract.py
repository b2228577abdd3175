"""Extract the program from a model completion and the objective a program printed."""

from __future__ import annotations

import re

_FENCE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)(?:```|$)", re.DOTALL)
_NUMBER = r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?"
_OBJ_LINE = re.compile(r"objective[^\n]*?(" + _NUMBER + r"|inf|-inf|nan)\s*$", re.IGNORECASE | re.MULTILINE)


def extract_program(completion: str) -> str | None:
    """The last fenced Python block (an unterminated final block counts), else None."""
    blocks = [b for b in _FENCE.findall(completion) if b.strip()]
    return blocks[-1] if blocks else None


_LP_FENCE = re.compile(r"```(?:lp|cplex)[ \t]*\n(.*?)(?:```|$)", re.DOTALL | re.IGNORECASE)
_LP_SECTION = re.compile(r"^\s*(?:max(?:imi[sz]e)?|min(?:imi[sz]e)?)\s*$", re.IGNORECASE | re.MULTILINE)


def extract_lp(completion: str) -> str | None:
    """LP-format model text for LP-output prompts: the last ```lp block, else the last plain fenced block
    that reads as an LP file (an objective-sense line and an ``end``), else None."""
    blocks = [b for b in _LP_FENCE.findall(completion) if b.strip()]
    if blocks:
        return blocks[-1]
    plain = re.findall(r"```[ \t]*\n(.*?)```", completion, re.DOTALL)
    lp = [b for b in plain if _LP_SECTION.search(b) and re.search(r"^\s*end\s*$", b, re.IGNORECASE | re.MULTILINE)]
    return lp[-1] if lp else None


def parse_printed_objective(stdout: str) -> float | None:
    """The number on the last line of ``stdout`` that mentions 'objective', as a float."""
    matches = _OBJ_LINE.findall(stdout)
    if not matches:
        return None
    try:
        return float(matches[-1])
    except ValueError:
        return None


_STATUS = re.compile(r"\b(infeasible|unbounded)\b", re.IGNORECASE)


def parse_printed_status(stdout: str) -> str | None:
    """What a program reported: 'optimal' (it printed an objective), 'infeasible', 'unbounded',
    'infeasible_or_unbounded' (a line naming both), or None (it reported nothing usable)."""
    if parse_printed_objective(stdout) is not None:
        return "optimal"
    for line in reversed(stdout.splitlines()):
        words = {w.lower() for w in _STATUS.findall(line)}
        if words:
            return "infeasible_or_unbounded" if len(words) == 2 else words.pop()
    return None
