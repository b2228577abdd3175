import os
import re
from pathlib import Path

import pytest

from eval.lp_equiv import canonical, equivalent, lp_signature, perturb_lp, scramble_lp
from eval.lp_format import parse_lp, read_lp, sanitize_names, write_lp

BASE = """\\ base model
Maximize
 obj: 3 x + 2 y + 4 z
Subject To
 cap: x + y + 2 z <= 10
 mix: 2 x - y >= 1
 bal: x + y - z = 2
Bounds
 y <= 8
Generals
 z
End
"""


def _rename(text: str, **names: str) -> str:
    for old, new in names.items():
        text = re.sub(rf"\b{old}\b", new, text)
    return text


def _eq(a: str, b: str):
    res = equivalent(a, b)
    assert res.method and res.detail, res
    return res


SAME = {
    "renamed": _rename(BASE, x="alpha", y="beta", z="gamma", cap="c1", mix="c2", bal="c3", obj="profit"),
    "reordered": """Maximize
 obj: 4 z + 2 y + 3 x
Subject To
 bal: - z + y + x = 2
 mix: - y + 2 x >= 1
 cap: 2 z + x + y <= 10
Bounds
 y <= 8
Generals
 z
End
""",
    "scaled_row": BASE.replace(" cap: x + y + 2 z <= 10", " cap: 2.5 x + 2.5 y + 5 z <= 25"),
    "ge_as_negated_le": BASE.replace(" mix: 2 x - y >= 1", " mix: - 2 x + y <= -1"),
    "negated_equality": BASE.replace(" bal: x + y - z = 2", " bal: - x - y + z = -2"),
    "min_of_negation": BASE.replace("Maximize\n obj: 3 x + 2 y + 4 z", "Minimize\n obj: - 3 x - 2 y - 4 z"),
    "bound_as_constraint": BASE.replace(" y <= 8\n", "").replace("Subject To\n", "Subject To\n ub_y: y <= 8\n"),
    "gurobi_names": _rename(BASE, x="x[0]", y="x[1]", z="x[2]"),
}

DIFFERENT = {
    "changed_coefficient": BASE.replace(" cap: x + y + 2 z <= 10", " cap: x + y + 3 z <= 10"),
    "changed_rhs": BASE.replace(" cap: x + y + 2 z <= 10", " cap: x + y + 2 z <= 11"),
    "dropped_constraint": BASE.replace(" mix: 2 x - y >= 1\n", ""),
    "integer_made_continuous": BASE.replace("Generals\n z\n", ""),
    "changed_bound": BASE.replace(" y <= 8", " y <= 9"),
    "flipped_sense": BASE.replace(" mix: 2 x - y >= 1", " mix: 2 x - y <= 1"),
    "changed_objective": BASE.replace("3 x + 2 y", "3 x + 5 y"),
    "min_instead_of_max": BASE.replace("Maximize", "Minimize"),
}


@pytest.mark.parametrize("name", sorted(SAME))
def test_rewritten_models_are_equivalent(name):
    res = _eq(BASE, SAME[name])
    assert res.equivalent, (name, res)
    assert res.method.startswith("exact"), res
    assert lp_signature(BASE) == lp_signature(SAME[name])


@pytest.mark.parametrize("name", sorted(DIFFERENT))
def test_changed_models_are_not_equivalent(name):
    res = _eq(BASE, DIFFERENT[name])
    assert not res.equivalent, (name, res)
    assert res.method in ("counts", "wl", "refinement"), res
    assert lp_signature(BASE) != lp_signature(DIFFERENT[name])


GUROBI_WRITTEN = """\\ LP format - for model browsing. Use MPS format to capture full model detail.
Maximize
  x[0] + x[1] + 3 b[0] - n + 5 Constant + [ 2 x[0] ^2 ] / 2
Subject To
 c[0]: x[0] + 2 x[1] - b[0] <= 4
 rng: x[0] + x[2] + Rgrng = 3
 eq: x[0] - x[1] - n = 0
 qc: [ x[0] * x[1] + x[2] ^2 ] <= 9
Bounds
 -5 <= n <= 7
 Rgrng <= 2
 Constant = 1
Binaries
 b[0]
Generals
 n
End
"""
HAND_WRITTEN = """Maximize
 obj: x0 + x1 + 3 b + [ 2 x0 ^ 2 ] / 2 - n + 5
Subject To
 c0: x0 + 2 x1 - b <= 4
 r1: x0 + x2 >= 1
 r2: x0 + x2 <= 3
 eq: x0 - x1 - n = 0
 qc: [ x0 * x1 + x2 ^ 2 ] <= 9
Bounds
 -5 <= n <= 7
 0 <= unused <= 4
Binaries
 b
Generals
 n
End
"""


def test_presolve_normalises_gurobi_constants_ranges_slacks_and_unused_vars():
    # Gurobi writes the objective constant as a fixed variable and addRange as an equality plus a range variable
    res = equivalent(GUROBI_WRITTEN, HAND_WRITTEN)
    assert res.equivalent, res
    notes = canonical(GUROBI_WRITTEN).notes
    assert notes["substituted_fixed_vars"] == 1 and notes["projected_column_singletons"] == 1
    assert canonical(HAND_WRITTEN).notes["dropped_unused_vars"] == 1
    assert not equivalent(GUROBI_WRITTEN, HAND_WRITTEN.replace("x0 + x2 >= 1", "x0 + x2 >= 0.5")).equivalent
    slack = BASE.replace(" cap: x + y + 2 z <= 10", " cap: x + y + 2 z + s = 10")  # s >= 0 by default
    assert equivalent(BASE, slack).equivalent
    # the strict form keeps every written row and variable
    assert not equivalent(BASE, slack, reduce=False).equivalent
    assert not equivalent(BASE, SAME["bound_as_constraint"], reduce=False).equivalent


def test_sign_symmetric_equality_either_orientation():
    a = "Minimize\n obj: x + y\nSubject To\n d: x - y = 0\n s: x + y >= 3\nEnd\n"
    b = "Minimize\n obj: x + y\nSubject To\n d: y - x = 0\n s: x + y >= 3\nEnd\n"
    c = "Minimize\n obj: x + y\nSubject To\n d: x + y = 0\n s: x + y >= 3\nEnd\n"
    assert equivalent(a, b).equivalent
    assert not equivalent(a, c).equivalent
    assert canonical(a).notes["sign_symmetric_equalities"] == 1


def _cycle_model(edges: list[tuple[int, int]]) -> str:
    rows = "\n".join(f" e{i}: v{a} + v{b} <= 1" for i, (a, b) in enumerate(edges))
    return f"Maximize\n obj: {' + '.join(f'v{i}' for i in range(6))}\nSubject To\n{rows}\nEnd\n"


def test_wl_blind_pair_is_decided_by_the_exact_search():
    hexagon = _cycle_model([(0, 1), (1, 2), (2, 3), (3, 4), (4, 5), (5, 0)])
    triangles = _cycle_model([(0, 1), (1, 2), (2, 0), (3, 4), (4, 5), (5, 3)])
    assert lp_signature(hexagon) == lp_signature(triangles)  # 1-WL cannot tell them apart
    res = equivalent(hexagon, triangles)
    assert not res.equivalent and res.method == "exact-search", res
    relabelled = _cycle_model([(3, 5), (5, 1), (1, 0), (0, 2), (2, 4), (4, 3)])
    res = equivalent(hexagon, relabelled)
    assert res.equivalent and res.method == "exact-search", res


def test_scrambled_and_perturbed_copies():
    for seed in range(5):
        assert equivalent(BASE, scramble_lp(BASE, seed)).equivalent
    for i in range(3):
        assert not equivalent(BASE, perturb_lp(BASE, index=i)).equivalent


QCP = """\\ quadratic objective and a quadratic constraint (HiGHS cannot read the latter)
Minimize
 obj: x[0] + 2 x[1] + [ 2 x[0] ^ 2 + 2 x[0] * x[1] ] / 2
Subject To
 lin: x[0] + x[1] >= 1
 qc: 3 x[0] + [ x[0] * x[1] + x[1] ^ 2 ] <= 4
Bounds
 x[1] <= 5
End
"""


def test_quadratic_models_use_the_builtin_reader_and_compare():
    raw = read_lp(QCP)
    assert raw.reader == "builtin"
    assert raw.obj_quad == {(0, 0): 1.0, (0, 1): 1.0}
    assert raw.rows[1].quad == {(0, 1): 1.0, (1, 1): 1.0}
    assert equivalent(QCP, scramble_lp(QCP, 3)).equivalent
    assert not equivalent(QCP, QCP.replace("x[0] * x[1] + x[1] ^ 2", "2 x[0] * x[1] + x[1] ^ 2")).equivalent


def test_readers_agree_and_writer_round_trips():
    qp = QCP.replace(" qc: 3 x[0] + [ x[0] * x[1] + x[1] ^ 2 ] <= 4\n", "")
    a, b = read_lp(qp), parse_lp(qp)
    assert a.reader == "highs" and b.reader == "builtin"
    assert (a.obj, a.obj_quad, a.lb, a.ub) == (b.obj, b.obj_quad, b.lb, b.ub)
    assert equivalent(canonical(write_lp(a)), qp).equivalent
    assert sanitize_names("c: x[1,2] + [ x[3] ^ 2 ]") == "c: x{1,2} + [ x{3} ^ 2 ]"


def test_unreadable_model_reports_error():
    res = equivalent(BASE, "Minimize\n obj: x +\nSubject To\n c: x >= \nEnd\n")
    assert not res.equivalent and res.method == "error"


BENCH = os.environ.get("TREX_BENCHMARKS_DIR")


@pytest.mark.skipif(not BENCH, reason="TREX_BENCHMARKS_DIR is not set (.ci/run sets it to ../shared/benchmarks)")
def test_orgeval_reference_models_self_check():
    from eval.references import orgeval_self_check

    root = Path(BENCH) / "SLAI-T-Rex" / "bench4opt"
    report = orgeval_self_check(root)
    n = report["n"]
    print({k: v for k, v in report.items() if k != "failures"})
    assert n == 394 and not report["failures"], report["failures"][:5]
    assert report["self_equivalent"] == report["scrambled_equivalent"] == report["perturbed_distinguished"] == n
