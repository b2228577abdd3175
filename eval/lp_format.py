"""Read and write CPLEX-LP-format models (as written by Gurobi or HiGHS) into one plain structure.

``read_lp`` tries HiGHS's own reader first (``highspy.Highs().readModel``) and falls back to a small
built-in parser for what HiGHS rejects (quadratic constraints, which HiGHS cannot represent). Both
return a :class:`RawModel`; ``RawModel.reader`` says which one was used.

Gurobi writes indexed names such as ``x[0,3]``. HiGHS 1.16's LP reader takes ``[`` as the start of a
quadratic block, so brackets that are *inside* a name (a ``[`` glued to a preceding non-space
character) are rewritten to a bracket pair that does not occur in the text (``{}``, ``()``, ...)
before reading. Names never matter downstream (equivalence ignores them).

``write_lp`` writes a RawModel back as LP text (used to build renamed/shuffled copies in tests and
self-checks); it round-trips through ``read_lp``.
"""

from __future__ import annotations

import math
import os
import re
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

INF = math.inf

# (j, k) with j <= k -> coefficient of the monomial x_j * x_k (x_j^2 when j == k) in the real function.
Quad = dict[tuple[int, int], float]


@dataclass
class Row:
    """One constraint ``lo <= sum(lin[j] x_j) + sum(quad[j,k] x_j x_k) <= hi`` (lo/hi may be -inf/inf)."""

    lin: dict[int, float]
    lo: float
    hi: float
    quad: Quad = field(default_factory=dict)
    name: str = ""


@dataclass
class RawModel:
    """A model as read, indices 0..n-1 over variables.

    vtype[j] is 'C' (continuous), 'I' (integer; binaries are 'I' with bounds [0, 1]), 'SC'
    (semi-continuous) or 'SI' (semi-integer). The objective is
    ``sense * min``-ish: ``sense`` is +1 for minimise, -1 for maximise, and the objective function is
    ``offset + sum(obj[j] x_j) + sum(obj_quad[j,k] x_j x_k)``.
    """

    names: list[str]
    vtype: list[str]
    lb: list[float]
    ub: list[float]
    sense: int
    offset: float
    obj: dict[int, float]
    obj_quad: Quad
    rows: list[Row]
    reader: str = ""

    @property
    def n_vars(self) -> int:
        return len(self.names)


class LPParseError(ValueError):
    """The text is not a model either reader understands."""


_SECTION_RE = re.compile(
    r"^\s*(minimize|minimise|minimum|min|maximize|maximise|maximum|max|subject\s+to|such\s+that|s\.t\.|st\.?|"
    r"bounds?|binaries|binary|bin|generals|general|gen|integers?|semi-continuous|semis?|sos|"
    r"general\s+constraints|lazy\s+constraints|user\s+cuts|end)\s*$",
    re.IGNORECASE,
)
_PAIRS = [("{", "}"), ("(", ")"), ("_L_", "_R_")]


def load_text(path_or_text: str | os.PathLike) -> str:
    """The LP text: a path (``Path``, or a one-line string naming an existing file) is read; any other
    string is the text itself."""
    if isinstance(path_or_text, os.PathLike):
        return Path(path_or_text).read_text()
    if "\n" not in path_or_text and len(path_or_text) < 4096 and Path(path_or_text).is_file():
        return Path(path_or_text).read_text()
    return path_or_text


def sanitize_names(text: str) -> str:
    """Rewrite brackets inside names (``x[0,1]``) to a bracket pair absent from the text (``x{0,1}``)."""
    lo, hi = next(((a, b) for a, b in _PAIRS if a not in text and b not in text), ("_L_", "_R_"))
    return re.sub(r"(?<=[^\s\[\]+\-*/^:<>=])\[([^\s\[\]]*)\]", lambda m: f"{lo}{m.group(1)}{hi}", text)


_BANNER_LOCK = threading.Lock()
_banner_done = False


def _new_highs():
    """A quiet ``highspy.Highs()``. HiGHS prints its banner to the C stdout on the first construction in a
    process (before any option can be set); that one construction runs with fd 1 pointed at /dev/null
    so the banner cannot corrupt a report printed on stdout."""
    global _banner_done
    import highspy

    with _BANNER_LOCK:
        if not _banner_done:
            sys.stdout.flush()
            saved, devnull = os.dup(1), os.open(os.devnull, os.O_WRONLY)
            try:
                os.dup2(devnull, 1)
                h = highspy.Highs()
            finally:
                os.dup2(saved, 1)
                os.close(saved)
                os.close(devnull)
            _banner_done = True
        else:
            h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    return h


def read_highs(text: str) -> RawModel:
    """Read LP text with HiGHS (after :func:`sanitize_names`); raises LPParseError when HiGHS refuses it."""
    import highspy

    with tempfile.TemporaryDirectory(prefix="trex-lp-") as wd:
        path = Path(wd, "model.lp")
        path.write_text(sanitize_names(text))
        h = _new_highs()
        status = h.readModel(str(path))
    if status not in (highspy.HighsStatus.kOk, highspy.HighsStatus.kWarning):
        raise LPParseError(f"HiGHS could not read the model ({status})")
    model = h.getModel()
    lp, hess = model.lp_, model.hessian_
    n, m = lp.num_col_, lp.num_row_
    kinds = {0: "C", 1: "I", 2: "SC", 3: "SI"}
    vtype = [kinds.get(int(t), "C") for t in lp.integrality_] if len(lp.integrality_) else ["C"] * n
    rows = [Row({}, float(lp.row_lower_[i]), float(lp.row_upper_[i]), {}, lp.row_names_[i] if lp.row_names_ else "")
            for i in range(m)]
    a = lp.a_matrix_
    starts, index, value = list(a.start_), list(a.index_), list(a.value_)
    if a.format_ != highspy.MatrixFormat.kColwise:
        raise LPParseError(f"unexpected HiGHS matrix format {a.format_}")
    for j in range(n):
        for p in range(starts[j], starts[j + 1]):
            if value[p] != 0.0:
                rows[index[p]].lin[j] = rows[index[p]].lin.get(j, 0.0) + float(value[p])
    obj_quad: Quad = {}
    if hess.dim_:
        hs, hi_, hv = list(hess.start_), list(hess.index_), list(hess.value_)
        for j in range(hess.dim_):
            for p in range(hs[j], hs[j + 1]):
                i, v = hi_[p], float(hv[p])
                if v != 0.0:  # HiGHS: 1/2 x'Qx with the lower triangle stored
                    key = (min(i, j), max(i, j))
                    obj_quad[key] = obj_quad.get(key, 0.0) + (v / 2 if i == j else v)
    sense = -1 if "Maximize" in str(lp.sense_) else 1
    return RawModel(
        names=list(lp.col_names_) if lp.col_names_ else [f"x{j}" for j in range(n)],
        vtype=vtype,
        lb=[float(v) for v in lp.col_lower_],
        ub=[float(v) for v in lp.col_upper_],
        sense=sense,
        offset=float(lp.offset_),
        obj={j: float(c) for j, c in enumerate(lp.col_cost_) if c != 0.0},
        obj_quad=obj_quad,
        rows=rows,
        reader="highs",
    )


# ----------------------------------------------------------------------------- built-in parser

_TOKEN = re.compile(
    r"\s*(?:(?P<num>(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?(?![A-Za-z_\d]))|(?P<op><=|>=|=<|=>|->|[<>=+\-*/^:\[\]])"
    r"|(?P<name>[^\s+\-*/^:<>=\[\]]+))"
)


def _tokens(s: str) -> list[str]:
    out, pos = [], 0
    s = s.rstrip()
    while pos < len(s):
        m = _TOKEN.match(s, pos)
        if not m or m.end() == pos:
            raise LPParseError(f"cannot tokenise near {s[pos:pos + 30]!r}")
        out.append(m.group(m.lastgroup))
        pos = m.end()
    return out


def _is_num(t: str) -> bool:
    return bool(re.fullmatch(r"(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?|inf|infinity", t, re.IGNORECASE))


def _num(t: str) -> float:
    return INF if t.lower() in ("inf", "infinity") else float(t)


class _Builder:
    def __init__(self) -> None:
        self.index: dict[str, int] = {}
        self.names: list[str] = []

    def var(self, name: str) -> int:
        if name not in self.index:
            self.index[name] = len(self.names)
            self.names.append(name)
        return self.index[name]


def _parse_expr(toks: list[str], pos: int, b: _Builder, stop: set[str]) -> tuple[dict[int, float], Quad, float, int]:
    """Parse ``[+-] [coef] name | [+-] number | [+-] [ quad ] [/ 2]`` terms until a token in ``stop``."""
    lin: dict[int, float] = {}
    quad: Quad = {}
    const = 0.0
    while pos < len(toks) and toks[pos].lower() not in stop:
        sign = 1.0
        while toks[pos] in "+-":
            sign = -sign if toks[pos] == "-" else sign
            pos += 1
        if toks[pos] == "[":
            end = toks.index("]", pos)
            q_lin, q_quad, _, _ = _parse_quad(toks[pos + 1:end], b)
            pos = end + 1
            scale = sign
            if pos + 1 < len(toks) and toks[pos] == "/" and _is_num(toks[pos + 1]):
                scale /= _num(toks[pos + 1])
                pos += 2
            for key, v in q_quad.items():
                quad[key] = quad.get(key, 0.0) + scale * v
            continue
        coef = 1.0
        if _is_num(toks[pos]):
            coef = _num(toks[pos])
            pos += 1
            if pos >= len(toks) or toks[pos].lower() in stop or toks[pos] in "+-":
                const += sign * coef
                continue
        j = b.var(toks[pos])
        lin[j] = lin.get(j, 0.0) + sign * coef
        pos += 1
    return lin, quad, const, pos


def _parse_quad(toks: list[str], b: _Builder) -> tuple[None, Quad, None, None]:
    quad: Quad = {}
    pos = 0
    while pos < len(toks):
        sign = 1.0
        while toks[pos] in "+-":
            sign = -sign if toks[pos] == "-" else sign
            pos += 1
        coef = 1.0
        if _is_num(toks[pos]):
            coef = _num(toks[pos])
            pos += 1
        j = b.var(toks[pos])
        pos += 1
        if pos < len(toks) and toks[pos] == "^":
            k = j
            pos += 2
        elif pos < len(toks) and toks[pos] == "*":
            k = b.var(toks[pos + 1])
            pos += 2
        else:
            raise LPParseError(f"linear term {toks[pos - 1]!r} inside a quadratic block")
        key = (min(j, k), max(j, k))
        quad[key] = quad.get(key, 0.0) + sign * coef
    return None, quad, None, None


_SENSES = {"<=": "<=", "=<": "<=", "<": "<=", ">=": ">=", "=>": ">=", ">": ">=", "=": "="}


def parse_lp(text: str) -> RawModel:
    """The built-in reader for the Gurobi/CPLEX LP subset: linear and quadratic objective and rows,
    Bounds, Binaries, Generals, Semi-continuous. Indicator/general constraints and SOS raise LPParseError."""
    text = sanitize_names(text)
    sections: list[tuple[str, list[str]]] = []
    for raw in text.splitlines():
        line = raw.split("\\", 1)[0]
        m = _SECTION_RE.match(line)
        if m:
            sections.append((re.sub(r"\s+", " ", m.group(1).lower()), []))
        elif line.strip():
            if not sections:
                raise LPParseError(f"text before the first section: {line.strip()[:40]!r}")
            sections[-1][1].append(line)
    b = _Builder()
    sense, offset, obj, obj_quad = 1, 0.0, {}, {}
    rows: list[Row] = []
    bounds: dict[int, list[float]] = {}
    vtype: dict[int, str] = {}
    for name, lines in sections:
        toks = _tokens(" ".join(lines))
        if name.startswith(("min", "max")):
            sense = -1 if name.startswith("max") else 1
            if len(toks) > 1 and toks[1] == ":":
                toks = toks[2:]
            obj, obj_quad, offset, _ = _parse_expr(toks, 0, b, set())
        elif name in ("subject to", "such that", "s.t.", "st", "st."):
            pos = 0
            while pos < len(toks):
                rname = ""
                if pos + 1 < len(toks) and toks[pos + 1] == ":":
                    rname, pos = toks[pos], pos + 2
                lin, quad, const, pos = _parse_expr(toks, pos, b, set(_SENSES) | {"->"})
                if pos >= len(toks) or toks[pos] == "->":
                    raise LPParseError(f"row {rname!r}: no sense (or an unsupported indicator)")
                op = _SENSES[toks[pos]]
                sign = 1.0
                pos += 1
                while toks[pos] in "+-":
                    sign = -sign if toks[pos] == "-" else sign
                    pos += 1
                rhs = sign * _num(toks[pos]) - const
                pos += 1
                lo = rhs if op in (">=", "=") else -INF
                hi = rhs if op in ("<=", "=") else INF
                rows.append(Row(lin, lo, hi, quad, rname))
        elif name.startswith("bound"):
            for line in lines:
                _parse_bound(_tokens(line), b, bounds)
        elif name in ("binaries", "binary", "bin"):
            for t in toks:
                j = b.var(t)
                vtype[j] = "I"
                bounds[j] = [0.0, 1.0]
        elif name in ("generals", "general", "gen", "integer", "integers"):
            for t in toks:
                vtype[b.var(t)] = "I"
        elif name in ("semi-continuous", "semis", "semi"):
            for t in toks:
                j = b.var(t)
                vtype[j] = "SI" if vtype.get(j) == "I" else "SC"
        elif name != "end":
            raise LPParseError(f"unsupported section {name!r}")
    n = len(b.names)
    lb = [bounds.get(j, [0.0, INF])[0] for j in range(n)]
    ub = [bounds.get(j, [0.0, INF])[1] for j in range(n)]
    return RawModel(b.names, [vtype.get(j, "C") for j in range(n)], lb, ub, sense, offset, obj, obj_quad, rows,
                    reader="builtin")


def _parse_bound(toks: list[str], b: _Builder, bounds: dict[int, list[float]]) -> None:
    """``x free`` | ``x op v`` | ``v op x`` | ``v <= x <= w`` (signed numbers, inf/infinity allowed)."""
    vals: list[float | str] = []
    pos = 0
    while pos < len(toks):
        t = toks[pos]
        if t in "+-" and pos + 1 < len(toks) and _is_num(toks[pos + 1]):
            vals.append((-1.0 if t == "-" else 1.0) * _num(toks[pos + 1]))
            pos += 2
            continue
        vals.append(_num(t) if _is_num(t) else t)
        pos += 1
    if len(vals) == 2 and isinstance(vals[0], str) and str(vals[1]).lower() == "free":
        bounds[b.var(vals[0])] = [-INF, INF]
        return
    if len(vals) == 5:  # v <= x <= w
        j = b.var(str(vals[2]))
        bounds[j] = [float(vals[0]), float(vals[4])]
        return
    if len(vals) != 3:
        raise LPParseError(f"cannot read bound {' '.join(toks)!r}")
    if isinstance(vals[0], str) and vals[0] not in _SENSES:
        var, op, v = vals[0], _SENSES[str(vals[1])], float(vals[2])
    else:
        var, v = str(vals[2]), float(vals[0])
        op = {"<=": ">=", ">=": "<=", "=": "="}[_SENSES[str(vals[1])]]
    j = b.var(var)
    cur = bounds.setdefault(j, [0.0, INF])
    if op in (">=", "="):
        cur[0] = v
    if op in ("<=", "="):
        cur[1] = v


def read_lp(path_or_text: str | os.PathLike, reader: str = "auto") -> RawModel:
    """Read a model: ``reader`` 'highs', 'builtin', or 'auto' (HiGHS, then the built-in parser)."""
    text = load_text(path_or_text)
    if reader == "builtin":
        return parse_lp(text)
    try:
        return read_highs(text)
    except LPParseError:
        if reader == "highs":
            raise
    return parse_lp(text)


# ----------------------------------------------------------------------------- writer

def _fmt(v: float) -> str:
    return "inf" if v == INF else "-inf" if v == -INF else repr(float(v))


def _terms(lin: dict[int, float], names: list[str]) -> list[str]:
    return [f"{'-' if c < 0 else '+'} {_fmt(abs(c))} {names[j]}" for j, c in lin.items()]


def _qterms(quad: Quad, names: list[str], scale: float) -> list[str]:
    out = []
    for (j, k), c in quad.items():
        prod = f"{names[j]} ^ 2" if j == k else f"{names[j]} * {names[k]}"
        out.append(f"{'-' if c < 0 else '+'} {_fmt(abs(c) * scale)} {prod}")
    return out


def write_lp(model: RawModel, title: str = "model") -> str:
    """LP text for ``model`` (Gurobi-style layout, one term per token group, full float precision)."""
    names = model.names
    obj = _terms(model.obj, names)
    if model.obj_quad:
        obj += ["+ [", *_qterms(model.obj_quad, names, 2.0), "] / 2"]
    if model.offset:
        obj.append(f"{'-' if model.offset < 0 else '+'} {_fmt(abs(model.offset))}")
    if not obj and names:
        obj = [f"0 {names[0]}"]
    out = [f"\\ {title}", "Maximize" if model.sense < 0 else "Minimize", " obj: " + " ".join(obj), "Subject To"]
    for i, r in enumerate(model.rows):
        expr = _terms(r.lin, names)
        if r.quad:
            expr += ["+ [", *_qterms(r.quad, names, 1.0), "]"]
        body = " ".join(expr)
        rname = r.name or f"R{i}"
        if r.lo == r.hi:
            out.append(f" {rname}: {body} = {_fmt(r.hi)}")
        else:
            if r.hi < INF:
                out.append(f" {rname}: {body} <= {_fmt(r.hi)}")
            if r.lo > -INF:
                out.append(f" {rname}{'_lo' if r.hi < INF else ''}: {body} >= {_fmt(r.lo)}")
    out.append("Bounds")
    for j, name in enumerate(names):
        lo, hi = model.lb[j], model.ub[j]
        if lo == -INF and hi == INF:
            out.append(f" {name} free")
        elif (lo, hi) != (0.0, INF):
            out.append(f" {_fmt(lo)} <= {name} <= {_fmt(hi)}")
    ints = [names[j] for j, t in enumerate(model.vtype) if t in ("I", "SI")]
    if ints:
        out += ["Generals", " " + " ".join(ints)]
    semis = [names[j] for j, t in enumerate(model.vtype) if t in ("SC", "SI")]
    if semis:
        out += ["Semi-continuous", " " + " ".join(semis)]
    out.append("End")
    return "\n".join(out) + "\n"
