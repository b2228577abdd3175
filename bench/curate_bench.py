"""Curation throughput: build N SFT samples over every family, category and representation.

Prints samples/s, the 4 x 3 category x representation grid with each cell's share against its target,
and the accounting. Usage: ``python bench/curate_bench.py --samples 10000 [--workers 2]``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ordata.curate import curate  # noqa: E402
from ordata.families import FAMILIES  # noqa: E402
from trex.core.config import DataConfig  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=10000)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--apis", default="highspy,pyomo,gurobipy")
    args = ap.parse_args()
    cfg = DataConfig(families=sorted(FAMILIES), sft={"samples": args.samples, "val_fraction": 0},
                     eval={"problems": 60}, cpt={"documents": 60},
                     representations=["DP", "DT", "DPS"], apis=args.apis.split(","), workers=args.workers,
                     answer_styles=["code_only", "math_model_with_code", "math_model"], min_size=2, max_size=4)
    with tempfile.TemporaryDirectory() as out:
        t0 = time.perf_counter()
        info = curate(cfg, out)
        secs = time.perf_counter() - t0
        failed = [r for r in map(json.loads, Path(out, "rejections.jsonl").read_text().splitlines())
                  if r["stage"] == "verify"]
    cells = Counter(info["per_category_representation"]["sft"])
    total = sum(cells.values())
    print(f"samples: {total} verified SFT samples in {secs:.1f} s = {total / secs:.1f} samples/s")
    print(f"{'cell':<10}{'count':>8}{'share':>9}{'target':>9}{'dev':>8}")
    target = 1 / len(cells)
    for cell in sorted(cells):
        share = cells[cell] / total
        print(f"{cell:<10}{cells[cell]:>8}{share:>9.3%}{target:>9.3%}{(share - target) / target:>+8.1%}")
    print("accounting:", {k: {kk: vv for kk, vv in v.items() if kk != 'balanced'} for k, v in info["accounting"].items()})
    print("per family:", dict(sorted(info["per_family"]["sft"].items())))
    for r in failed[:5]:
        print("verify rejected:", r["id"], r["family"], r["reason"], r.get("detail", "")[:200])


if __name__ == "__main__":
    main()
