"""Problem data as named parameters, rendered in the three problem representations.

* **DP** — all data stated in the problem text (one sentence per parameter, or per element when the
  parameter has a ``phrase`` template);
* **DT** — data in Markdown tables (vectors over the same index share a table);
* **DPS** — data in an attached ``data.json`` file that the program must read by path.

Reference programs declare one Python variable per parameter, in the order the parameters are
stated, either as literals (DP, DT) or read from the file (DPS); the model code that follows is the
same for all three.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

Representation = Literal["DP", "DT", "DPS"]
REPRESENTATIONS: tuple[str, ...] = ("DP", "DT", "DPS")
DATA_FILE = "data.json"


@dataclass
class Param:
    key: str  # Python identifier in programs and the data file
    desc: str  # "profit per unit"
    values: Any  # number, list over ``index``, or list of rows over ``index`` x ``columns``
    index: list[str] | None = None
    columns: list[str] | None = None
    unit: str = ""  # "$" is written before the number, anything else after it
    phrase: str | None = None  # per-element DP sentence, e.g. "Each unit of {label} earns ${value}."

    @property
    def kind(self) -> str:
        if self.index is None:
            return "scalar"
        return "matrix" if self.columns is not None else "vector"


def fmt(value: Any, unit: str = "") -> str:
    """A number as the program writes it (``5.0`` stays ``5.0``), with its unit."""
    if unit == "$":
        return f"${value}"
    return f"{value} {unit}".rstrip()


def _join(words: list[str]) -> str:
    return ", ".join(words[:-1]) + " and " + words[-1] if len(words) > 1 else words[0]


def _cap(sentence: str) -> str:
    return sentence[:1].upper() + sentence[1:]


def _dp_sentence(p: Param) -> str:
    if p.kind == "scalar":
        return _cap(p.phrase.format(value=fmt(p.values, p.unit))) if p.phrase else f"The {p.desc} is {fmt(p.values, p.unit)}."
    if p.kind == "vector":
        if p.phrase:
            return " ".join(_cap(p.phrase.format(label=lab, value=fmt(v, p.unit))) for lab, v in zip(p.index, p.values))
        parts = [f"{fmt(v, p.unit)} for {lab}" for lab, v in zip(p.index, p.values)]
        return f"The {p.desc} is {_join(parts)}."
    rows = []
    for lab, row in zip(p.index, p.values):
        cells = ", ".join(f"{col} {fmt(v, p.unit)}" for col, v in zip(p.columns, row))
        rows.append(_cap(p.phrase.format(label=lab, values=cells)) if p.phrase else f"For {lab}, the {p.desc} is: {cells}.")
    return " ".join(rows)


def _md_table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def _dt_tables(params: list[Param], index_names: dict[str, str]) -> str:
    blocks: list[str] = []
    scalars = [p for p in params if p.kind == "scalar"]
    if scalars:
        blocks.append("\n".join(f"- {p.desc}: {fmt(p.values, p.unit)}" for p in scalars))
    done: set[str] = set()
    for p in params:
        if p.kind == "vector" and p.key not in done:
            group = [q for q in params if q.kind == "vector" and q.index == p.index and q.key not in done]
            done.update(q.key for q in group)
            header = [index_names.get(p.key, "item")] + [f"{q.desc}" + (f" ({q.unit})" if q.unit else "") for q in group]
            rows = [[lab] + [fmt(q.values[i]) for q in group] for i, lab in enumerate(p.index)]
            blocks.append(_md_table(header, rows))
        elif p.kind == "matrix":
            title = f"{p.desc}" + (f" ({p.unit})" if p.unit else "")
            header = [f"{title}"] + list(p.columns)
            blocks.append(_md_table(header, [[lab] + [fmt(v) for v in row] for lab, row in zip(p.index, p.values)]))
    return "\n\n".join(blocks)


def _dps_text(params: list[Param]) -> str:
    lines = [f"The data are in the attached JSON file `{DATA_FILE}`, with these keys:"]
    for p in params:
        unit = f" ({p.unit})" if p.unit else ""
        if p.kind == "scalar":
            lines.append(f"- `{p.key}`: {p.desc}{unit}")
        elif p.kind == "vector":
            lines.append(f"- `{p.key}`: {p.desc}{unit}, a list in the order {', '.join(p.index)}")
        else:
            lines.append(f"- `{p.key}`: {p.desc}{unit}, one row per {', '.join(p.index)} (in that order), "
                         f"columns {', '.join(p.columns)}")
    return "\n".join(lines)


def render_data(params: list[Param], rep: str, index_names: dict[str, str] | None = None) -> str:
    """The data part of a question in representation ``rep``."""
    if rep == "DP":
        return " ".join(_dp_sentence(p) for p in params)
    if rep == "DT":
        return _dt_tables(params, index_names or {})
    if rep == "DPS":
        return _dps_text(params)
    raise ValueError(f"unknown representation {rep!r}; expected one of {REPRESENTATIONS}")


def data_file(params: list[Param]) -> bytes:
    """The DPS attachment: ``{key: values}`` as JSON."""
    return json.dumps({p.key: p.values for p in params}, indent=1).encode()


def data_code(params: list[Param], rep: str) -> str:
    """Program lines that define one variable per parameter: literals, or read from the data file."""
    if rep == "DPS":
        lines = ["import json", "", f'with open("{DATA_FILE}") as f:', "    data = json.load(f)"]
        lines += [f'{p.key} = data["{p.key}"]' for p in params]
    else:
        lines = [f"{p.key} = {json.dumps(p.values)}" for p in params]
    return "\n".join(lines) + "\n"


@dataclass
class Rendered:
    question: str
    program: str
    files: dict[str, bytes] = field(default_factory=dict)
