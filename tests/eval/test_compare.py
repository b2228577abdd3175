"""eval.compare and `trex eval compare`: several models over benchmarks, intervals and paired differences."""

from __future__ import annotations

import json

import pytest

from eval.compare import compare, load_results, markdown
from eval.stats import wilson


def _write(d, bench: str, pattern: str, samples: int = 1):
    """``samples.jsonl`` of one benchmark: problem i's verdict is pattern[i] (every sample alike)."""
    d.mkdir(parents=True, exist_ok=True)
    with open(d / "samples.jsonl", "w") as f:
        for j in range(samples):
            for i, c in enumerate(pattern):
                ok = c == "1"
                f.write(json.dumps({"benchmark": bench, "id": f"q{i}", "sample": j, "outcome": "ok",
                                    "verdicts": {"rel": ok, "abs": ok, "orlm": ok}}) + "\n")


@pytest.fixture
def results(tmp_path):
    base, tuned = tmp_path / "base", tmp_path / "tuned"
    _write(base / "nl4opt", "nl4opt", "1100000000" * 4)          # 8 / 40
    _write(base / "optibench", "optibench", "10" * 20)          # 20 / 40
    _write(base / "mamo-easylp", "mamo-easylp", "1" * 10)
    _write(tuned / "nl4opt", "nl4opt", "1111110000" * 4)        # 24 / 40: 16 fixed, none broken
    _write(tuned / "optibench", "optibench", "01" * 20, samples=2)  # 20 / 40 again, other problems
    return base, tuned


def test_compare_gives_intervals_and_paired_differences_in_the_reference_order(results):
    base, tuned = results
    table = compare({"base": load_results(base), "tuned": load_results(tuned)})
    assert table["benchmarks"] == ["nl4opt", "optibench", "mamo-easylp"]  # the reference's columns first
    b = table["models"]["base"]["pass@1"]["nl4opt"]
    assert b["value"] == 0.2 and (b["low"], b["high"]) == pytest.approx(wilson(8, 40)) and b["method"] == "wilson"
    t = table["models"]["tuned"]
    assert t["pass@1"]["optibench"]["samples_per_problem"] == 2 and "bootstrap" in t["pass@1"]["optibench"]["method"]
    assert "mamo-easylp" not in t["pass@1"] and "mamo-easylp" not in t["vs_baseline"]
    nl = t["vs_baseline"]["nl4opt"]
    assert nl["difference"] == pytest.approx(0.4) and nl["low"] > 0  # 16 fixed, none broken: a real gain
    opt = t["vs_baseline"]["optibench"]
    assert opt["difference"] == 0.0 and opt["low"] < 0 < opt["high"]  # as many fixed as broken
    assert t["mean_vs_baseline"]["difference"] == pytest.approx(0.2)
    md = markdown(table)
    assert "| base | 20.0 [" in md and "| tuned | 60.0 [" in md and "+40.0 [" in md and "*" in md
    assert md.splitlines()[2] == "| model | nl4opt | optibench | mamo-easylp | mean |"


def test_load_results_names_a_directory_without_results(tmp_path):
    with pytest.raises(FileNotFoundError, match="no samples.jsonl"):
        load_results(tmp_path)


def test_trex_eval_compare_prints_the_table_and_writes_its_files(results, tmp_path):
    from typer.testing import CliRunner

    from trex.cli import app

    base, tuned = results
    out = tmp_path / "cmp"
    res = CliRunner().invoke(app, ["eval", "compare", "-r", f"base={base}", "-r", f"tuned={tuned}", "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert "Paired difference to base" in res.output and "| tuned |" in res.output
    assert json.loads((out / "compare.json").read_text())["baseline"] == "base"
    assert (out / "compare.png").stat().st_size > 1000 and (out / "compare.md").read_text().startswith("Pass@1")
    bad = CliRunner().invoke(app, ["eval", "compare", "-r", str(base)])
    assert bad.exit_code != 0 and "expected NAME=DIR" in bad.output


def test_out_of_distribution_split_is_its_own_column_outside_the_mean(tmp_path):
    """A lifecycle writes the held-out and the out-of-distribution evaluations of one model into two directories:
    `trex eval compare` takes both under one name; the OOD column comes last and is not in the mean."""
    from typer.testing import CliRunner

    from trex.cli import app

    _write(tmp_path / "base", "synthetic", "1" * 10 + "0" * 10)
    _write(tmp_path / "base-ood", "synthetic_ood", "1" * 8 + "0" * 12)
    _write(tmp_path / "sft", "synthetic", "1" * 18 + "0" * 2)
    _write(tmp_path / "sft-ood", "synthetic_ood", "0" * 20)
    args = ["eval", "compare"] + [a for n in ("base", "sft") for d in (n, f"{n}-ood")
                                  for a in ("-r", f"{n}={tmp_path / d}")] + ["--out", str(tmp_path / "cmp")]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    table = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    assert table["benchmarks"] == ["synthetic", "synthetic_ood"]
    sft = table["models"]["sft"]
    assert sft["mean"] == pytest.approx(0.9) and sft["pass@1"]["synthetic_ood"]["value"] == 0.0
    assert sft["vs_baseline"]["synthetic_ood"]["difference"] == pytest.approx(-0.4)
    assert sft["mean_vs_baseline"]["difference"] == pytest.approx(0.4)  # in distribution only
    assert "not in the mean" in res.output and "| model | synthetic | synthetic_ood | mean |" in res.output
    again = CliRunner().invoke(app, ["eval", "compare", "-r", f"a={tmp_path / 'base'}", "-r", f"a={tmp_path / 'base'}"])
    assert again.exit_code != 0 and "benchmark 'synthetic' is already in this model's other results" in again.output
