"""Smoke run of ``trex bench convert`` (``bench/convert_bench.py``) on the fixture's tiny multi-shard
checkpoint: one round of hub-fp8 -> hub-bf16 in a child process; the JSON it writes has the throughput, the
peak / baseline RSS and the shard ratios, and a second call reuses the cached checkpoint."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from trex.cli import app
from trex.cli.bench import load_bench


def test_convert_bench_smoke(tmp_path):
    cache, out = tmp_path / "cache", tmp_path / "convert.json"
    res = CliRunner().invoke(app, ["bench", "convert", "--quick", "--to", "hub-bf16", "--cache-dir", str(cache),
                                   "--json", str(out)])
    assert res.exit_code == 0, res.output
    r = json.loads(out.read_text())
    assert r["bench"] == "convert" and r["rounds"] == 1 and r["source"]["generated"]
    assert r["input_shards"] > 1 and r["baseline_rss"] > 0
    (row,) = r["rows"]
    assert row["conversion"] == "hub-fp8 -> hub-bf16" and row["summary"]["target"] == "hub-bf16"
    assert row["output_bytes"] > row["input_bytes"] > 0 and row["convert_s"] > 0
    assert row["input_gb_per_s"] > 0 and row["output_gb_per_s"] > row["input_gb_per_s"]
    assert row["peak_rss"] >= row["baseline_rss"] > 0 and row["peak_minus_baseline"] == row["peak_rss"] - row["baseline_rss"]
    assert row["reference_shard"] == max(row["largest_input_shard"], row["largest_output_shard"])
    assert row["ratio"] == row["peak_rss"] / row["reference_shard"] and row["pass"] == (row["ratio"] <= 3.0)
    assert not list(cache.glob("run-*"))  # the outputs are removed

    bench = load_bench("convert_bench")
    path, meta = bench.source_checkpoint(cache, {}, None, 0, False, tmp_path)
    assert str(path) == r["source"]["path"] and not meta["generated"]
