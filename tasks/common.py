"""What every stage task shares: the cache policy, output directories and the run context.

A task's cache key is its inputs (config sections and upstream references with their content
hashes) plus its source code; ``ctx`` (where to log, the parent MLflow run) is left out, so a new
flow run reuses a finished stage.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefect.cache_policies import INPUTS, TASK_SOURCE
from pydantic import BaseModel

CACHE_POLICY = (INPUTS + TASK_SOURCE) - "ctx"
TASK_OPTIONS: dict[str, Any] = {"cache_policy": CACHE_POLICY, "persist_result": True, "retries": 0}


@dataclass
class StageContext:
    """Everything a task needs that must not change its cache key."""

    output_dir: str
    tracking: dict  # {"enabled", "uri", "experiment", "artifact_root"}
    parent_run_id: str | None = None
    flow_run_id: str | None = None


def sandbox_preflight(cfg, data: bool = False, evaluate: bool = False) -> dict[str, str]:
    """Before any stage: :func:`eval.sandbox.require_sandbox` (raises ``SandboxUnavailable`` with the cause and the
    fix; returns the MLflow tags naming the bubblewrap that runs the flow's untrusted programs)."""
    from eval.sandbox import require_sandbox  # lazy: flows that run no untrusted program do not probe

    return require_sandbox(cfg, data=data, evaluate=evaluate)


def plain(value: Any) -> Any:
    """A typed config section as the JSON data it was parsed from; anything else unchanged. The one place where
    typed sections become data: output-directory keys and MLflow params (Prefect's own cache key hashes the
    same sections through its JSON serializer)."""
    return value.model_dump(mode="json") if isinstance(value, BaseModel) else value


def stage_key(**inputs: Any) -> str:
    """The output directory's key: a hash of the stage's inputs (typed sections as their JSON data)."""
    data = {k: plain(v) for k, v in inputs.items()}
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:12]


def stage_dir(ctx: StageContext, stage: str, key: str) -> Path:
    return Path(ctx.output_dir) / stage / key


def stage_result(ref: dict, summary: dict, t0: float, run_id: str | None) -> dict:
    """What a task returns: the reference, headline numbers, wall time and its MLflow run."""
    return {"ref": ref, "summary": summary, "seconds": time.perf_counter() - t0, "mlflow_run_id": run_id}


def log_data_split(run, data_ref: dict, split: str, context: str) -> None:
    """Log split ``split`` of a curated data reference as an MLflow dataset input of ``run``: named
    ``<split>@<data hash>``, its digest the content hash of the split's files (from the data manifest), with
    the row count and column types of the HF ``datasets`` directory."""
    import datasets

    root = Path(data_ref["path"])
    files = json.loads((root / "manifest.json").read_text()).get("files", {})
    mine = {k: v for k, v in sorted(files.items()) if k.startswith(f"{split}/")}
    digest = hashlib.sha256(json.dumps(mine, sort_keys=True).encode()).hexdigest()[:16]
    ds = datasets.load_from_disk(str(root / split))  # memory-mapped: reads the schema and the row count
    features = {name: str(f) if not hasattr(f, "dtype") else f.dtype for name, f in ds.features.items()}
    run.dataset(f"{split}@{data_ref['hash'][:12]}", root / split, digest, context, rows=ds.num_rows,
                features=features)
