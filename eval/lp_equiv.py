"""Structural equivalence of LP/MIP/QP models (B4O-ORGEval scoring).

Two LP-format models are *equivalent* when their canonical graphs are isomorphic with matching
labels. Names never matter; order of variables, constraints and terms never matters.

Canonical form (``canonicalize``), every choice made so that "the same model written differently"
maps to the same graph:

* Objective: always minimise. ``max f`` becomes ``min -f`` (linear, quadratic and constant parts).
  The objective is NOT rescaled (its value is part of the answer).
* Variables: type ``C``/``I``/``SC``/``SI``; an integer variable has its bounds rounded inwards
  (``ceil(lb)``, ``floor(ub)``) and is labelled ``B`` when they are then [0, 1].
* Rows ``lo <= a'x + x'Qx <= hi``: equality rows stay ``=``; every finite side of a non-equality row
  becomes its own ``<=`` row (``a'x >= lo`` is stored as ``-a'x <= -lo``; a ranged row is two rows,
  the same as writing two constraints). Rows with both sides infinite, and rows with no terms that
  hold trivially (``c: 0 <= 0``), are dropped; an empty row that cannot hold is kept as a marker.
* Row scaling: each row is divided by its largest |coefficient| (a positive factor, so multiplying a
  constraint by a positive constant changes nothing). An equality row may also be negated: the sign
  whose sorted (coefficients, rhs) is lexicographically larger is kept; when both signs give the
  same multiset (e.g. ``x - y = 0``) the row is split into two "half" nodes (positive / negative
  terms) joined by an edge, so either orientation gives the same graph.
* Light presolve (``reduce=True``, the default; ``reduce=False`` is the strict structural form),
  repeated to a fixed point; each step keeps the optimisation problem over the remaining
  variables exactly the same:
  - a singleton row (one linear term) is folded into the variable's bounds (``2 x <= 6`` is the
    bound ``x <= 3``; a bound made redundant by a tighter one disappears);
  - a fixed variable (``lb == ub``) is substituted (Gurobi writes an objective constant as
    ``5 Constant`` with ``Constant = 1`` in Bounds);
  - a continuous variable with no objective term that occurs in one row only (a slack, Gurobi's
    range variable ``RgR``) is projected out, turning its row into the implied range;
  - an unused variable with no objective term and a non-empty domain is dropped.
  Variables in quadratic terms are never removed. ``CanonicalModel.notes`` counts what was done.
* Numbers are compared after rounding to ``digits`` significant digits (default 10).

Graph: one node per variable (label: type and bounds), per canonical row (label: sense and rhs),
one objective node (label: constant), one node per quadratic monomial (``x_j x_k`` or ``x_j^2``)
linked to its factors; edges variable/monomial -- row/objective carry the coefficient.

Decision levels reported in ``EquivalenceResult.method``:
``error`` (a model could not be read), ``counts`` (node/edge counts differ), ``wl`` (networkx
Weisfeiler-Lehman hashes differ: certainly not isomorphic; or hashes equal but no exact check was
possible -- then ``detail`` says "unconfirmed"), ``refinement`` (joint colour refinement separates
them), ``exact-refinement`` (refinement gives every node a unique colour; the induced mapping is
verified edge by edge), ``exact-search`` (symmetric models: individualisation-refinement search,
complete within a budget, every mapping verified edge by edge), ``exact-vf2`` (networkx labelled VF2,
tried under a size cap when the search budget runs out).
"""

from __future__ import annotations

import math
import os
import random
import re
from collections import Counter
from dataclasses import dataclass, field

import networkx as nx
from networkx.algorithms.isomorphism import GraphMatcher

from eval.lp_format import INF, LPParseError, RawModel, Row, load_text, read_lp, write_lp

WL_ITERATIONS = 6
SEARCH_BUDGET = 5_000
VF2_NODE_CAP = 2000
VF2_BUDGET = 100_000


@dataclass
class EquivalenceResult:
    """``equivalent``: the verdict; ``method``: the level that decided it (see module doc); ``detail``: why."""

    equivalent: bool
    method: str
    detail: str


@dataclass
class CanonicalModel:
    """The canonical graph of one model plus bookkeeping (what the reader was, what was folded)."""

    graph: nx.Graph
    n_vars: int
    n_rows: int
    reader: str
    notes: dict[str, int] = field(default_factory=dict)
    _wl: dict[int, str] = field(default_factory=dict, repr=False)

    def wl_hash(self, iterations: int = WL_ITERATIONS) -> str:
        """networkx WL hash over node and edge labels (cached per iteration count)."""
        if iterations not in self._wl:
            self._wl[iterations] = nx.weisfeiler_lehman_graph_hash(
                self.graph, node_attr="label", edge_attr="label", iterations=iterations, digest_size=16)
        return self._wl[iterations]


def _lbl(x: float, digits: int) -> str:
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    v = float(f"{x:.{digits}g}")
    return f"{v + 0.0:.{digits}g}"  # + 0.0 turns -0.0 into 0.0


_TOL = 1e-9


@dataclass
class _Reduced:
    """The model after the light presolve: surviving variables, bounds, rows and objective."""

    keep: list[int]
    lb: list[float]
    ub: list[float]
    rows: list[Row]
    obj: dict[int, float]
    offset: float
    notes: Counter


def _round_int(vtype: str, lo: float, hi: float) -> tuple[float, float]:
    if vtype in ("I", "SI"):
        lo = float(math.ceil(lo - _TOL)) if lo > -INF else lo
        hi = float(math.floor(hi + _TOL)) if hi < INF else hi
    return lo, hi


def _reduce(raw: RawModel, reduce: bool) -> _Reduced:
    """Drop vacuous rows; with ``reduce`` also, to a fixed point: fold singleton rows into bounds,
    substitute fixed variables (Gurobi writes an objective constant as ``5 Constant`` with
    ``Constant = 1``), project out zero-cost continuous variables that occur in one row only
    (slacks, Gurobi's range variables ``RgR``: ``lo <= a'x + c s <= hi`` with ``s`` in [l, u] becomes
    ``lo - max(cl, cu) <= a'x <= hi - min(cl, cu)``), and drop unused zero-cost variables whose
    domain is non-empty. Variables in quadratic terms are never removed."""
    lb, ub = list(raw.lb), list(raw.ub)
    rows = [Row({j: c for j, c in r.lin.items() if c}, r.lo, r.hi, {k: c for k, c in r.quad.items() if c}, r.name)
            for r in raw.rows]
    obj, offset, notes = {j: c for j, c in raw.obj.items() if c}, raw.offset, Counter()
    quad_vars = {j for key in raw.obj_quad for j in key} | {j for r in rows for key in r.quad for j in key}
    alive = set(range(raw.n_vars))
    changed = True
    while changed:
        changed = False
        kept = []
        for r in rows:
            if r.lo == -INF and r.hi == INF:
                notes["dropped_free_rows"] += 1
            elif not r.lin and not r.quad and r.lo <= _TOL and r.hi >= -_TOL:
                notes["dropped_empty_rows"] += 1
            elif reduce and not r.quad and len(r.lin) == 1:
                (j, a), = r.lin.items()
                lo, hi = (r.lo / a, r.hi / a) if a > 0 else (r.hi / a, r.lo / a)
                lb[j], ub[j] = _round_int(raw.vtype[j], max(lb[j], lo), min(ub[j], hi))
                notes["folded_singleton_rows"] += 1
                changed = True
            else:
                kept.append(r)
        rows = kept
        if not reduce:
            break
        occurs: dict[int, list[Row]] = {}
        for r in rows:
            for j in r.lin:
                occurs.setdefault(j, []).append(r)
        for j in sorted(alive - quad_vars):
            lb[j], ub[j] = _round_int(raw.vtype[j], lb[j], ub[j])
            t, lo, hi, here = raw.vtype[j], lb[j], ub[j], occurs.get(j, [])
            if t in ("C", "I") and lo == hi and (t == "C" or lo == int(lo)):
                offset += obj.pop(j, 0.0) * lo
                for r in here:
                    c = r.lin.pop(j)
                    r.lo, r.hi = r.lo - c * lo, r.hi - c * lo
                notes["substituted_fixed_vars"] += 1
            elif t == "C" and j not in obj and len(here) == 1:
                r = here[0]
                c = r.lin.pop(j)
                smin, smax = sorted((c * lo, c * hi))
                r.lo, r.hi = r.lo - smax, r.hi - smin
                notes["projected_column_singletons"] += 1
            elif not here and j not in obj and lo <= hi:
                notes["dropped_unused_vars"] += 1
            else:
                continue
            alive.discard(j)
            occurs.pop(j, None)
            changed = True
    return _Reduced(sorted(alive), lb, ub, rows, obj, offset, notes)


def _canon_rows(row: Row) -> list[tuple[str, dict[int, float], dict[tuple[int, int], float], float]]:
    """The ``<=``/``=`` rows for one input row (unscaled, unsigned-normalised)."""
    if not row.lin and not row.quad:
        return [("infeasible-empty", {}, {}, 0.0)]
    if row.lo == row.hi:
        return [("=", row.lin, row.quad, row.hi)]
    out = []
    if row.hi < INF:
        out.append(("<=", row.lin, row.quad, row.hi))
    if row.lo > -INF:
        out.append(("<=", {j: -c for j, c in row.lin.items()}, {k: -c for k, c in row.quad.items()}, -row.lo))
    return out


def canonicalize(raw: RawModel, digits: int = 10, reduce: bool = True) -> CanonicalModel:
    """The labelled canonical graph of ``raw`` (see the module docstring for every normalisation)."""
    sgn = float(raw.sense)
    red = _reduce(raw, reduce)
    lb, ub, notes = red.lb, red.ub, red.notes
    rows = [c for r in red.rows for c in _canon_rows(r)]
    g = nx.Graph()
    for j in red.keep:
        t = raw.vtype[j]
        lo, hi = _round_int(t, lb[j], ub[j])
        if t == "I" and lo == 0 and hi == 1:
            t = "B"
        g.add_node(("v", j), label=f"V|{t}|{_lbl(lo, digits)}|{_lbl(hi, digits)}")
    g.add_node("obj", label=f"O|{_lbl(sgn * red.offset, digits)}")
    mono: dict[tuple[int, int], tuple] = {}

    def monomial(key: tuple[int, int]) -> tuple:
        if key not in mono:
            node = ("p", key)
            j, k = key
            g.add_node(node, label="P2" if j == k else "P")
            g.add_edge(node, ("v", j), label="f")
            g.add_edge(node, ("v", k), label="f")
            mono[key] = node
        return mono[key]

    for j, c in red.obj.items():
        g.add_edge("obj", ("v", j), label=f"c|{_lbl(sgn * c, digits)}")
    for key, c in raw.obj_quad.items():
        if c != 0.0:
            g.add_edge("obj", monomial(key), label=f"c|{_lbl(sgn * c, digits)}")
    for i, (sense, lin, quad, rhs) in enumerate(rows):
        if sense == "infeasible-empty":
            g.add_node(("r", i), label="R|infeasible-empty")
            continue
        scale = max(abs(c) for c in [*lin.values(), *quad.values()])
        terms = [(("v", j), c / scale) for j, c in lin.items()] + [(monomial(k), c / scale) for k, c in quad.items()]
        rhs /= scale
        halves = False
        if sense == "=":
            pos = (sorted(_lbl(c, digits) for _, c in terms), _lbl(rhs, digits))
            neg = (sorted(_lbl(-c, digits) for _, c in terms), _lbl(-rhs, digits))
            if Counter(pos[0]) == Counter(neg[0]) and pos[1] == neg[1]:
                halves = True
            elif neg > pos:
                terms, rhs = [(n, -c) for n, c in terms], -rhs
        if halves:
            g.add_node(("h", i, 0), label="H|=")
            g.add_node(("h", i, 1), label="H|=")
            g.add_edge(("h", i, 0), ("h", i, 1), label="half")
            for node, c in terms:
                g.add_edge(("h", i, 0 if c > 0 else 1), node, label=f"a|{_lbl(abs(c), digits)}")
            notes["sign_symmetric_equalities"] += 1
        else:
            g.add_node(("r", i), label=f"R|{sense}|{_lbl(rhs, digits)}")
            for node, c in terms:
                g.add_edge(("r", i), node, label=f"a|{_lbl(c, digits)}")
    return CanonicalModel(g, len(red.keep), len(rows), raw.reader, dict(notes))


LPInput = str | os.PathLike | CanonicalModel


def canonical(model: LPInput, digits: int = 10, reduce: bool = True, reader: str = "auto") -> CanonicalModel:
    """``model`` as a CanonicalModel (a path, LP text, or an already canonical model)."""
    if isinstance(model, CanonicalModel):
        return model
    return canonicalize(read_lp(model, reader=reader), digits=digits, reduce=reduce)


def lp_signature(path_or_text: str | os.PathLike, iterations: int = WL_ITERATIONS, digits: int = 10) -> str:
    """Hex WL hash of the canonical graph: equal for equivalent models (different means not equivalent)."""
    return canonical(path_or_text, digits=digits).wl_hash(iterations)


# ----------------------------------------------------------------------------- exact checks

class _Indexed:
    """A labelled graph as integer arrays: ``init[v]`` node-label id, ``adj[v]`` = [(edge-label id, u)]."""

    def __init__(self, g: nx.Graph, labels: dict[str, int]) -> None:
        self.nodes = list(g)
        pos = {v: i for i, v in enumerate(self.nodes)}
        self.init = [labels.setdefault(g.nodes[v]["label"], len(labels)) for v in self.nodes]
        self.adj = [[(labels.setdefault(d["label"], len(labels)), pos[u]) for u, d in g.adj[v].items()]
                    for v in self.nodes]
        self.edges = {(min(pos[u], pos[v]), max(pos[u], pos[v])): labels[d["label"]] for u, v, d in g.edges(data=True)}


def _refine(x: _Indexed, y: _Indexed, c1: list[int], c2: list[int]) -> tuple[list[int], list[int]] | None:
    """Joint colour refinement to a fixed point from colourings c1, c2 (one shared palette);
    None as soon as the two graphs' colour histograms differ (then they cannot be isomorphic)."""
    n_classes = len(set(c1) | set(c2))
    while True:
        palette: dict = {}
        n1 = [palette.setdefault((c1[v], tuple(sorted((e, c1[u]) for e, u in x.adj[v]))), len(palette))
              for v in range(len(c1))]
        n2 = [palette.setdefault((c2[v], tuple(sorted((e, c2[u]) for e, u in y.adj[v]))), len(palette))
              for v in range(len(c2))]
        if Counter(n1) != Counter(n2):
            return None
        c1, c2 = n1, n2
        if len(palette) == n_classes:
            return c1, c2
        n_classes = len(palette)


class _BudgetExceeded(Exception):
    pass


def _search(x: _Indexed, y: _Indexed, c1: list[int], c2: list[int], budget: list[int]) -> list[int] | None:
    """Individualisation-refinement: a verified isomorphism (x index -> y index) or None (none exists).

    Colourings are stable and have equal histograms. Pick the smallest non-singleton class, fix one of
    its x nodes, try each y node of that class (both get a fresh colour), refine, recurse. Complete,
    and every answer is checked edge by edge; ``budget[0]`` counts refinements (raises when spent)."""
    classes: dict[int, list[int]] = {}
    for v, c in enumerate(c1):
        classes.setdefault(c, []).append(v)
    multi = [vs for vs in classes.values() if len(vs) > 1]
    if not multi:
        where = {c: v for v, c in enumerate(c2)}
        m = [where[c] for c in c1]
        ok = all(y.edges.get((min(m[u], m[v]), max(m[u], m[v]))) == e for (u, v), e in x.edges.items())
        return m if ok else None
    target = min(multi, key=len)
    v, fresh = target[0], max(max(c1), max(c2)) + 1
    for w in (u for u in range(len(c2)) if c2[u] == c1[v]):
        budget[0] -= 1
        if budget[0] < 0:
            raise _BudgetExceeded
        d1, d2 = list(c1), list(c2)
        d1[v], d2[w] = fresh, fresh
        refined = _refine(x, y, d1, d2)
        if refined is not None:
            m = _search(x, y, refined[0], refined[1], budget)
            if m is not None:
                return m
    return None


def _exact(g1: nx.Graph, g2: nx.Graph, budget: int) -> tuple[bool | None, str, str]:
    """(verdict or None when the budget ran out, method, detail) for two graphs with equal WL hashes."""
    labels: dict[str, int] = {}
    x, y = _Indexed(g1, labels), _Indexed(g2, labels)
    refined = _refine(x, y, x.init, y.init)
    if refined is None:
        return False, "refinement", "equal WL hashes, but colour refinement separates the graphs"
    n_sym = sum(n for n in Counter(refined[0]).values() if n > 1)
    method = "exact-refinement" if n_sym == 0 else "exact-search"
    left = [budget]
    try:
        m = _search(x, y, refined[0], refined[1], left)
    except _BudgetExceeded:
        return None, "wl", f"unconfirmed: search gave up after {budget} refinements ({n_sym} symmetric nodes)"
    how = "unique colours" if n_sym == 0 else f"{n_sym} symmetric nodes, {budget - left[0]} individualisations"
    if m is None:
        return False, method, f"{how}; no label-preserving isomorphism"
    return True, method, f"{how}; mapping verified on every edge"


class _BudgetMatcher(GraphMatcher):
    """VF2 that gives up after ``budget`` candidate-pair checks."""

    def __init__(self, g1: nx.Graph, g2: nx.Graph, budget: int, **kw) -> None:
        super().__init__(g1, g2, **kw)
        self.budget = budget

    def semantic_feasibility(self, n1, n2) -> bool:  # noqa: D102
        self.budget -= 1
        if self.budget < 0:
            raise _BudgetExceeded
        return super().semantic_feasibility(n1, n2)


def _vf2(g1: nx.Graph, g2: nx.Graph, budget: int) -> bool | None:
    """Labelled VF2 isomorphism (networkx), None when ``budget`` pair checks are spent."""
    same = lambda p, q: p["label"] == q["label"]  # noqa: E731
    try:
        return _BudgetMatcher(g1, g2, budget, node_match=same, edge_match=same).is_isomorphic()
    except _BudgetExceeded:
        return None


def equivalent(a: LPInput, b: LPInput, *, digits: int = 10, reduce: bool = True,
               wl_iterations: int = WL_ITERATIONS, search_budget: int = SEARCH_BUDGET,
               vf2_node_cap: int = VF2_NODE_CAP, vf2_budget: int = VF2_BUDGET) -> EquivalenceResult:
    """Are ``a`` and ``b`` (paths, LP texts or canonical models) the same model up to renaming,
    reordering and the normalisations in the module docstring? See the module doc for ``method``."""
    try:
        ca = canonical(a, digits, reduce)
        cb = canonical(b, digits, reduce)
    except (LPParseError, ValueError, IndexError, KeyError) as exc:
        return EquivalenceResult(False, "error", f"{type(exc).__name__}: {exc}")
    g1, g2 = ca.graph, cb.graph
    shape1 = (g1.number_of_nodes(), g1.number_of_edges(), ca.n_vars, ca.n_rows)
    shape2 = (g2.number_of_nodes(), g2.number_of_edges(), cb.n_vars, cb.n_rows)
    if shape1 != shape2:
        return EquivalenceResult(False, "counts", f"(nodes, edges, vars, rows) {shape1} vs {shape2}")
    h1, h2 = ca.wl_hash(wl_iterations), cb.wl_hash(wl_iterations)
    if h1 != h2:
        return EquivalenceResult(False, "wl", f"WL hashes differ ({h1[:12]} vs {h2[:12]})")
    verdict, method, detail = _exact(g1, g2, search_budget)
    if verdict is None and g1.number_of_nodes() <= vf2_node_cap:
        iso = _vf2(g1, g2, vf2_budget)
        if iso is not None:
            return EquivalenceResult(iso, "exact-vf2", f"labelled VF2 after: {detail}")
        detail += f"; VF2 gave up after {vf2_budget} steps"
    return EquivalenceResult(True if verdict is None else verdict, method, detail)


# ----------------------------------------------------------------------------- test-copy builders

def scramble_lp(path_or_text: str | os.PathLike, seed: int = 0) -> str:
    """An equivalent rewrite of a model: fresh random names, shuffled variables/rows/terms, each row
    multiplied by a random positive factor, ``<=`` rows randomly written as ``>=`` with negation,
    equalities randomly negated, and the objective randomly turned into ``max -f``."""
    rng = random.Random(seed)
    raw = read_lp(path_or_text)
    n = raw.n_vars
    perm = list(range(n))
    rng.shuffle(perm)  # old j -> new perm[j]
    names = [""] * n
    for j in range(n):
        names[perm[j]] = f"v{rng.randrange(10**9)}_{perm[j]}"

    def remap(d: dict, quad: bool = False) -> dict:
        items = list(d.items())
        rng.shuffle(items)
        if quad:
            return {tuple(sorted((perm[j], perm[k]))): c for (j, k), c in items}
        return {perm[j]: c for j, c in items}

    rows = []
    for r in raw.rows:
        f = rng.choice([0.5, 1.0, 2.0, 4.0, 3.0])
        if rng.random() < 0.5 and (r.lo == r.hi or math.isinf(r.lo) or math.isinf(r.hi)):
            f = -f  # negate: a <= row becomes >= (and vice versa); an equality stays an equality
        lo, hi = (r.lo * f, r.hi * f) if f > 0 else (r.hi * f, r.lo * f)
        rows.append(Row(remap({j: c * f for j, c in r.lin.items()}), lo, hi,
                        remap({k: c * f for k, c in r.quad.items()}, quad=True), f"c{rng.randrange(10**9)}"))
    rng.shuffle(rows)
    flip = rng.random() < 0.5
    s = -1.0 if flip else 1.0
    obj = remap({j: s * c for j, c in raw.obj.items()})
    obj_quad = remap({k: s * c for k, c in raw.obj_quad.items()}, quad=True)
    out = RawModel(names, [""] * n, [0.0] * n, [0.0] * n, -raw.sense if flip else raw.sense, s * raw.offset,
                   obj, obj_quad, rows)
    for j in range(n):
        out.vtype[perm[j]], out.lb[perm[j]], out.ub[perm[j]] = raw.vtype[j], raw.lb[j], raw.ub[j]
    return write_lp(out, "scrambled copy")


_SECTION_END = re.compile(r"^\s*(bounds?|binaries|binary|bin|generals|general|gen|integers?|semi-continuous|semis?|"
                          r"sos|end)\s*$", re.IGNORECASE | re.MULTILINE)
_ST = re.compile(r"^\s*(subject\s+to|such\s+that|s\.t\.|st\.?)\s*$", re.IGNORECASE | re.MULTILINE)
_NUM = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")
_OPS = {"+", "-", "<=", ">=", "=<", "=>", "<", ">", "=", "[", "]", "*", "^", "/"}


def perturb_lp(path_or_text: str | os.PathLike, index: int = 0, factor: float = 1.5) -> str:
    """The model with the coefficient of its ``index``-th (modulo their number) linear term of a
    constraint with several terms (rows are told apart by their ``name:``) multiplied by ``factor``
    (an explicit coefficient is rewritten; an implicit 1 gets ``factor`` inserted). A text edit
    only, so it also exercises the reader."""
    text = load_text(path_or_text)
    st = _ST.search(text)
    if not st:
        raise LPParseError("no Subject To section")
    end = _SECTION_END.search(text, st.end())
    stop = end.start() if end else len(text)
    toks = [(m.start(), m.end(), m.group()) for m in re.finditer(r"\S+", text[st.end():stop])]
    depth, row, cands = 0, 0, []
    for i, (_, _, t) in enumerate(toks):
        depth += t == "["
        depth -= t == "]"
        row += t.endswith(":")
        if not (depth or t in _OPS or t.endswith(":") or _NUM.fullmatch(t)):
            cands.append((row, i))
    per_row = Counter(r for r, _ in cands)
    # prefer terms of rows with several terms: a singleton row is folded into a bound, where a tighter bound
    # elsewhere can make the change vanish (then the copy really is the same model)
    cands = [i for r, i in cands if per_row[r] > 1] or [i for _, i in cands]
    if not cands:
        raise LPParseError("the model has no linear constraint term")
    i = cands[index % len(cands)]
    base, (s, _, _) = st.end(), toks[i]
    prev = toks[i - 1] if i else None
    if prev and _NUM.fullmatch(prev[2]) and i >= 2 and (toks[i - 2][2] in ("+", "-") or toks[i - 2][2].endswith(":")):
        return text[:base + prev[0]] + repr(float(prev[2]) * factor) + text[base + prev[1]:]
    return text[:base + s] + f"{factor!r} " + text[base + s:]
