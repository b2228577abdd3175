"""MLflow bookkeeping for flows and tasks: a parent run per flow run, a child run per stage.

Uses ``MlflowClient`` with explicit run ids (no fluent active-run state), so it is safe from task
threads. Only rank 0 logs (``RANK`` env), because the SQLite store locks under concurrent writers.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

_clients: dict[str, Any] = {}


def is_rank0() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


class Tracker:
    """Logs into one MLflow run; a no-op when tracking is disabled or not rank 0."""

    def __init__(self, tracking_uri: str, run_id: str | None):
        self.uri, self.run_id = tracking_uri, run_id

    @property
    def client(self):
        return client(self.uri)

    @property
    def active(self) -> bool:
        return self.run_id is not None

    def params(self, params: dict[str, Any]) -> None:
        if self.active:
            from mlflow.entities import Param

            flat = _flatten(params)
            items = [Param(k, str(v)[:6000]) for k, v in flat.items()]
            for i in range(0, len(items), 100):
                self.client.log_batch(self.run_id, params=items[i:i + 100])

    def metrics(self, metrics: dict[str, float], step: int = 0) -> None:
        if self.active:
            from mlflow.entities import Metric

            now = int(time.time() * 1000)
            items = [Metric(k.replace("@", "_at_"), float(v), now, step) for k, v in metrics.items()
                     if isinstance(v, (int, float)) and not isinstance(v, bool)]
            if items:
                self.client.log_batch(self.run_id, metrics=items)

    def tags(self, tags: dict[str, Any]) -> None:
        if self.active:
            for k, v in tags.items():
                self.client.set_tag(self.run_id, k, str(v))

    def artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        if self.active:
            p = Path(path)
            if p.is_dir():
                self.client.log_artifacts(self.run_id, str(p), artifact_path)
            else:
                self.client.log_artifact(self.run_id, str(p), artifact_path)

    def table(self, rows: list[dict], artifact_file: str) -> None:
        """A table artifact (shown in the MLflow UI's evaluation view)."""
        if self.active and rows:
            cols = {k: [r.get(k) for r in rows] for k in rows[0]}
            self.client.log_table(self.run_id, data=cols, artifact_file=artifact_file)

    def finish(self, status: str = "FINISHED") -> None:
        if self.active:
            self.client.set_terminated(self.run_id, status=status)


def client(tracking_uri: str):
    if tracking_uri not in _clients:
        from mlflow.tracking import MlflowClient

        if tracking_uri.startswith("sqlite:///"):
            Path(tracking_uri[len("sqlite:///"):]).parent.mkdir(parents=True, exist_ok=True)
        _clients[tracking_uri] = MlflowClient(tracking_uri=tracking_uri)
    return _clients[tracking_uri]


def experiment_id(tracking_uri: str, name: str, artifact_root: str | None = None) -> str:
    c = client(tracking_uri)
    exp = c.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    return c.create_experiment(name, artifact_location=artifact_root)


def start_run(tracking: dict, name: str, parent_run_id: str | None = None, tags: dict | None = None) -> Tracker:
    """Open a run (a child of ``parent_run_id`` when given); disabled tracking gives a no-op tracker."""
    if not tracking.get("enabled", True) or not is_rank0():
        return Tracker(tracking["uri"], None)
    uri = tracking["uri"]
    exp = experiment_id(uri, tracking["experiment"], tracking.get("artifact_root"))
    all_tags = {"mlflow.runName": name, **(tags or {})}
    if parent_run_id:
        all_tags["mlflow.parentRunId"] = parent_run_id
    run = client(uri).create_run(exp, run_name=name, tags={k: str(v) for k, v in all_tags.items()})
    return Tracker(uri, run.info.run_id)


def _flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out
