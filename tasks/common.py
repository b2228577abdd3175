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
