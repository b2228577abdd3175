"""Verified instances between the curation stages: what ``build`` produced and the LLM stages transform.

With LLM stages configured (``data.llm``), curation runs as several stages (Prefect tasks), each writing a
directory (a stage reference of kind ``instances``)::

    instances/<split>.jsonl        one verified instance per line (eval, sft, cpt, eval_ood), in attempt order
    rejections.jsonl               every rejection so far, with its stage and reason
    manifest.json                  accounting so far (per stage: in, kept, quarantined), LLM usage and stage reports

``assemble`` (``ordata/curate.py``) turns the last one into the datasets. Rows survive the JSON round trip
exactly (floats are written by ``repr``), so assembling from a directory gives the bytes that assembling
in memory gives. A row's ``question_source`` / ``answer_source`` (absent: ``template``) say where its text came from.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from trex.core.refs import read_manifest

SPLITS = ("eval", "sft", "cpt", "eval_ood")
KIND = "instances"
TEMPLATE = "template"


@dataclass
class Instances:
    """Rows per split, the rejections so far and each stage's accounting (``{"in", "kept", "quarantined"}`` plus
    stage-specific counts; ``rejected`` is counted from ``rejections`` when the data is assembled)."""

    rows: dict[str, list[dict]]
    rejections: list[dict] = field(default_factory=list)
    accounting: dict[str, dict] = field(default_factory=dict)
    llm: dict[str, dict] = field(default_factory=dict)  # stage -> {"usage", "report"}
    generated: dict[str, int] = field(default_factory=dict)  # rows per split as built (before any LLM stage)

    def splits(self) -> list[str]:
        return [s for s in SPLITS if s in self.rows]


def account(n_in: int, kept: int, rejections: list[dict], stage: str, **extra) -> dict:
    """A stage's accounting: ``in = kept + rejected(reason) + quarantined`` (nothing is quarantined after build)."""
    rejected = dict(Counter(r["reason"] for r in rejections if r["stage"] == stage))
    return {"in": n_in, "kept": kept, "quarantined": 0, **extra, "rejected": rejected,
            "balanced": n_in == kept + sum(rejected.values())}


def write_instances(inst: Instances, out: Path) -> dict:
    """Write ``inst`` under ``out``; returns the manifest info (without file hashes)."""
    (out / "instances").mkdir(parents=True, exist_ok=True)
    for split in inst.splits():
        with open(out / "instances" / f"{split}.jsonl", "w") as f:
            for r in inst.rows[split]:
                f.write(json.dumps(r, sort_keys=True) + "\n")
    with open(out / "rejections.jsonl", "w") as f:
        for r in inst.rejections:
            f.write(json.dumps(r, sort_keys=True) + "\n")
    return {"splits": {s: len(inst.rows[s]) for s in inst.splits()}, "accounting": inst.accounting, "llm": inst.llm,
            "generated": inst.generated}


def _jsonl(path: Path) -> list[dict]:
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            try:
                rows.append(json.loads(line))
            except ValueError as e:
                raise ValueError(f"{path}:{n}: not a JSON line ({e})") from None
    return rows


def read_instances(path: str | Path) -> Instances:
    """The instances of a stage directory (its manifest must say ``instances``)."""
    root = Path(path)
    manifest = read_manifest(root, KIND)
    rows = {s: _jsonl(root / "instances" / f"{s}.jsonl") for s in manifest["splits"]}
    return Instances(rows, _jsonl(root / "rejections.jsonl"), manifest["accounting"], manifest.get("llm", {}),
                     manifest.get("generated", {}))
