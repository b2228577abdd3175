"""MLflow bookkeeping for flows and tasks: a parent run per flow run, a child run per stage.

Uses ``MlflowClient`` with explicit run ids (no fluent active-run state), so it is safe from task
threads. Only rank 0 logs (``RANK`` env), because the SQLite store locks under concurrent writers.

Outages: every call to the tracking store goes through :meth:`Tracker._call`. If the store fails (server
down, network, a locked database), the record -- params, metrics, tags, artifact paths, run creation, the
final status -- is appended to a local JSONL buffer (``<state>/tracking_buffer/<run>.jsonl``) with one
warning, and training goes on. Delivery is retried every ``retry_after_s``; the buffer is replayed in order
(runs created offline get their real id then) and deleted once delivered. ``trex tracking flush`` replays
whatever a finished process left behind. Nothing is dropped.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
import uuid
import warnings
from pathlib import Path
from typing import Any, Callable

from trex.core.config import TrackingConfig
from trex.tracking.store import seed_sqlite
from trex.tracking.ui import detect

log = logging.getLogger(__name__)
_clients: dict[str, Any] = {}
_down_until: dict[str, float] = {}  # per tracking URI: skip the store until then (an outage was seen)
_lock = threading.RLock()
OFFLINE = "offline-"


def is_rank0() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


class Tracker:
    """Logs into one MLflow run; a no-op when tracking is disabled or not rank 0."""

    def __init__(self, tracking_uri: str, run_id: str | None, buffer_dir: str | Path | None = None,
                 retry_after_s: float = 30.0):
        self.uri, self.run_id = tracking_uri, run_id
        self.buffer_dir = Path(buffer_dir) if buffer_dir else None
        self.retry_after_s = retry_after_s

    @property
    def client(self):
        return client(self.uri)

    @property
    def active(self) -> bool:
        return self.run_id is not None

    @property
    def offline(self) -> bool:
        return bool(self.run_id and self.run_id.startswith(OFFLINE))

    # ------------------------------------------------------------------------------ resilient delivery
    def _call(self, kind: str, payload: dict, fn: Callable[[str], Any]) -> Any:
        """Run ``fn(real_run_id)`` against the store, or buffer ``(kind, payload)`` during an outage."""
        if not self.active:
            return None
        with _lock:
            if time.monotonic() >= _down_until.get(self.uri, 0.0) and self.flush():
                try:
                    return fn(resolve_run_id(self.buffer_dir, self.run_id))
                except Exception as e:  # noqa: BLE001 -- any store failure is an outage for the trainer
                    self._outage(e)
            self._buffer(kind, payload)
        return None

    def _outage(self, e: Exception) -> None:
        first = self.uri not in _down_until or time.monotonic() >= _down_until[self.uri] + self.retry_after_s
        _down_until[self.uri] = time.monotonic() + self.retry_after_s
        if first:
            msg = (f"MLflow at {self.uri} is unreachable ({type(e).__name__}: {str(e)[:200]}); buffering to "
                   f"{self._buffer_file()} and retrying every {self.retry_after_s:g} s")
            log.warning(msg)
            warnings.warn(msg, RuntimeWarning, stacklevel=3)

    def _buffer_file(self) -> Path:
        if self.buffer_dir is None:
            raise RuntimeError(f"MLflow at {self.uri} failed and no tracking buffer directory is configured")
        return self.buffer_dir / f"{self.run_id}.jsonl"

    def _buffer(self, kind: str, payload: dict) -> None:
        f = self._buffer_file()
        f.parent.mkdir(parents=True, exist_ok=True)
        with open(f, "a") as fh:
            fh.write(json.dumps({"uri": self.uri, "run_id": self.run_id, "kind": kind, "payload": payload}) + "\n")
            fh.flush()
            os.fsync(fh.fileno())

    def flush(self) -> bool:
        """Deliver this run's buffered records; True when nothing is left."""
        if self.buffer_dir is None:
            return True
        f = self.buffer_dir / f"{self.run_id}.jsonl"
        if not f.is_file():
            return True
        return flush_file(f)

    # ---------------------------------------------------------------------------------------- API
    def params(self, params: dict[str, Any]) -> None:
        flat = {k: str(v)[:6000] for k, v in _flatten(params).items()}
        self._call("params", flat, lambda rid: _deliver(self.uri, rid, "params", flat))

    def metrics(self, metrics: dict[str, float], step: int = 0) -> None:
        now = int(time.time() * 1000)
        items = [[k.replace("@", "_at_"), float(v), now, step] for k, v in metrics.items()
                 if isinstance(v, (int, float)) and not isinstance(v, bool)]
        if items:
            self._call("metrics", {"items": items}, lambda rid: _deliver(self.uri, rid, "metrics", {"items": items}))

    def tags(self, tags: dict[str, Any]) -> None:
        tags = {k: str(v) for k, v in tags.items()}
        self._call("tags", tags, lambda rid: _deliver(self.uri, rid, "tags", tags))

    def artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        payload = {"path": str(Path(path).resolve()), "artifact_path": artifact_path}
        self._call("artifact", payload, lambda rid: _deliver(self.uri, rid, "artifact", payload))

    def dataset(self, name: str, path: str | Path, digest: str, context: str, rows: int | None = None,
                source: str | None = None, features: dict | None = None) -> None:
        """An MLflow dataset input of this run (the runs table's Dataset column, the run's Inputs): ``name``
        and ``digest`` (the content hash of what was read), the source (``source`` URI, default the local
        ``path``), ``context`` (``training``, ``validation``, ``evaluation``), and a profile with the row count
        and the columns' types (``features``)."""
        payload = {"name": name, "digest": str(digest)[:36], "source": source or str(Path(path).resolve()),
                   "context": context, "profile": {k: v for k, v in (("num_rows", rows), ("features", features))
                                                    if v is not None}}
        self._call("dataset", payload, lambda rid: _deliver(self.uri, rid, "dataset", payload))

    def table(self, rows: list[dict], artifact_file: str) -> None:
        """A table artifact (shown in the MLflow UI's evaluation view)."""
        if rows:
            payload = {"rows": rows, "artifact_file": artifact_file}
            self._call("table", payload, lambda rid: _deliver(self.uri, rid, "table", payload))

    def finish(self, status: str = "FINISHED") -> None:
        self._call("terminate", {"status": status},
                   lambda rid: _deliver(self.uri, rid, "terminate", {"status": status}))
        if self.active and not self.flush():
            log.warning("MLflow run %s: records still buffered in %s (deliver with `trex tracking flush`)",
                        self.run_id, self._buffer_file())

    def metric_history(self, key: str) -> list[tuple[int, float]] | None:
        """(step, value) of ``key`` in this run as the store has it (None when offline or unreachable)."""
        if not self.active or self.offline or time.monotonic() < _down_until.get(self.uri, 0.0):
            return None
        try:
            return [(m.step, m.value) for m in self.client.get_metric_history(self.run_id, key)]
        except Exception:  # noqa: BLE001
            return None

    @contextlib.contextmanager
    def system_metrics(self, enabled: bool = True, interval_s: float = 10.0):
        """MLflow system metrics (CPU, memory, disk, network; GPU with pynvml) on this run while inside."""
        monitor = None
        if enabled and self.active and not self.offline and time.monotonic() >= _down_until.get(self.uri, 0.0):
            try:
                from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

                monitor = SystemMetricsMonitor(self.run_id, sampling_interval=interval_s, tracking_uri=self.uri)
                monitor.start()
            except Exception as e:  # noqa: BLE001 -- monitoring must never stop training
                log.warning("system metrics unavailable: %s", e)
                monitor = None
        try:
            yield
        finally:
            if monitor is not None:
                try:
                    monitor.finish()
                except Exception as e:  # noqa: BLE001
                    log.warning("system metrics monitor: %s", e)


def _deliver(uri: str, run_id: str, kind: str, payload: dict) -> Any:
    from mlflow.entities import Metric, Param

    c = client(uri)
    if kind == "params":
        items = [Param(k, v) for k, v in payload.items()]
        for i in range(0, len(items), 100):
            c.log_batch(run_id, params=items[i:i + 100])
    elif kind == "metrics":
        items = [Metric(k, v, ts, step) for k, v, ts, step in payload["items"]]
        for i in range(0, len(items), 1000):
            c.log_batch(run_id, metrics=items[i:i + 1000])
    elif kind == "tags":
        for k, v in payload.items():
            c.set_tag(run_id, k, v)
    elif kind == "artifact":
        p = Path(payload["path"])
        if p.is_dir():
            c.log_artifacts(run_id, str(p), payload["artifact_path"])
        else:
            c.log_artifact(run_id, str(p), payload["artifact_path"])
    elif kind == "table":
        rows = payload["rows"]
        c.log_table(run_id, data={k: [r.get(k) for r in rows] for k in rows[0]}, artifact_file=payload["artifact_file"])
    elif kind == "dataset":
        from mlflow.entities import Dataset, DatasetInput, InputTag
        from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT

        entity = Dataset(name=payload["name"], digest=payload["digest"], source_type=_source_type(payload["source"]),
                         source=json.dumps({"uri": payload["source"]}), profile=json.dumps(payload["profile"]))
        c.log_inputs(run_id, datasets=[DatasetInput(entity, [InputTag(MLFLOW_DATASET_CONTEXT, payload["context"])])])
    elif kind == "terminate":
        c.set_terminated(run_id, status=payload["status"])
    elif kind == "create":
        exp = experiment_id(uri, payload["experiment"], payload.get("artifact_root"))
        tags = dict(payload["tags"])
        if "mlflow.parentRunId" in tags:
            tags["mlflow.parentRunId"] = resolve_run_id(Path(payload["buffer_dir"]), tags["mlflow.parentRunId"])
        return c.create_run(exp, run_name=payload["name"], tags=tags).info.run_id
    else:
        raise ValueError(f"unknown tracking record kind {kind!r}")
    return None


def _source_type(uri: str) -> str:
    """MLflow's source type of a dataset URI: ``local`` for a path, else its scheme (``http``, ``s3``, ``hf``...)."""
    scheme = uri.split("://", 1)[0] if "://" in uri else ""
    return {"": "local", "file": "local", "https": "http"}.get(scheme, scheme)


def _idmap_file(buffer_dir: Path) -> Path:
    return buffer_dir / "run_ids.json"


def resolve_run_id(buffer_dir: Path | None, run_id: str) -> str:
    """The real MLflow id of a run created offline (raises while it is still undelivered)."""
    if not run_id.startswith(OFFLINE):
        return run_id
    f = _idmap_file(buffer_dir) if buffer_dir else None
    mapping = json.loads(f.read_text()) if f and f.is_file() else {}
    if run_id not in mapping:
        raise ConnectionError(f"run {run_id} has not been created in MLflow yet")
    return mapping[run_id]


def flush_file(f: Path) -> bool:
    """Replay one buffer file in order; keep what could not be delivered. True when it is all delivered."""
    with _lock:
        lines = [json.loads(x) for x in f.read_text().splitlines() if x.strip()]
        done = 0
        try:
            for rec in lines:
                run_id = rec["run_id"]
                if rec["kind"] == "create":
                    real = _deliver(rec["uri"], run_id, "create", rec["payload"])
                    idmap = _idmap_file(f.parent)
                    mapping = json.loads(idmap.read_text()) if idmap.is_file() else {}
                    mapping[run_id] = real
                    idmap.write_text(json.dumps(mapping))
                else:
                    _deliver(rec["uri"], resolve_run_id(f.parent, run_id), rec["kind"], rec["payload"])
                done += 1
        except Exception as e:  # noqa: BLE001
            if lines:
                _down_until[lines[0]["uri"]] = time.monotonic() + 5.0
            log.info("tracking buffer %s: %d of %d records delivered (%s)", f, done, len(lines), e)
            rest = lines[done:]
            tmp = f.with_suffix(".tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in rest))
            os.replace(tmp, f)
            return False
        f.unlink()
        if lines:
            _down_until.pop(lines[0]["uri"], None)
        return True


def flush_buffers(buffer_dir: str | Path) -> dict[str, int]:
    """Deliver every buffered run in ``buffer_dir`` (runs created offline first); counts per outcome."""
    root = Path(buffer_dir)
    out = {"delivered": 0, "pending": 0}
    files = sorted(root.glob("*.jsonl"), key=lambda p: (not p.name.startswith(OFFLINE), p.stat().st_mtime))
    for f in files:
        out["delivered" if flush_file(f) else "pending"] += 1
    return out


def client(tracking_uri: str):
    if tracking_uri not in _clients:
        from mlflow.tracking import MlflowClient

        if tracking_uri.startswith("sqlite:///"):
            db = Path(tracking_uri[len("sqlite:///"):])
            db.parent.mkdir(parents=True, exist_ok=True)
            seed_sqlite(db)  # a new store: a copy of a migrated empty one (trex.tracking.store)
        _clients[tracking_uri] = MlflowClient(tracking_uri=tracking_uri)
    return _clients[tracking_uri]


EXPERIMENT_KIND = {"mlflow.experimentKind": "custom_model_development"}  # the UI's training view, not GenAI's


def experiment_id(tracking_uri: str, name: str, artifact_root: str | None = None) -> str:
    c = client(tracking_uri)
    exp = c.get_experiment_by_name(name)
    if exp is not None:
        if "mlflow.experimentKind" not in exp.tags:
            c.set_experiment_tag(exp.experiment_id, *next(iter(EXPERIMENT_KIND.items())))
        return exp.experiment_id
    return c.create_experiment(name, artifact_location=artifact_root, tags=EXPERIMENT_KIND)


def _http_limits(tracking: dict) -> None:
    """A down server must not stall training for minutes in MLflow's own retries."""
    if str(tracking.get("uri", "")).startswith(("http://", "https://")):
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(int(tracking.get("request_timeout_s", 5))))
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1")


def _owner_tags() -> dict[str, str]:
    import socket

    return {"trex.host": socket.gethostname(), "trex.pid": str(os.getpid())}


def _orphaned(run) -> bool:
    """A RUNNING run whose process is gone: it was started on this host by a pid that no longer exists."""
    import socket

    tags = run.data.tags
    if run.info.status != "RUNNING" or tags.get("trex.host") != socket.gethostname():
        return False
    try:
        os.kill(int(tags.get("trex.pid", "0")), 0)
    except (ProcessLookupError, ValueError):
        return True
    except PermissionError:
        return False
    return int(tags.get("trex.pid", "0")) <= 0


def _resume_or_link(uri: str, exp: str, resume_key: str, parent_run_id: str | None, payload: dict) -> str:
    """Crash recovery without silent duplicates: reuse the newest run of ``resume_key`` if its process died
    mid-way (tags ``trex.resumed``); otherwise create a run, and if earlier runs of that key exist, link them
    (``trex.previous_run_id`` here, ``trex.superseded_by`` there) and mark still-orphaned ones FAILED."""
    c = client(uri)
    prev = c.search_runs([exp], filter_string=f"tags.`trex.resume_key` = '{resume_key}'",
                         order_by=["attributes.start_time DESC"], max_results=20)
    if prev and _orphaned(prev[0]):
        run = prev[0]
        rid = run.info.run_id
        n = int(run.data.tags.get("trex.resumed", "0")) + 1
        for k, v in {**_owner_tags(), "trex.resumed": str(n),
                     **({"mlflow.parentRunId": parent_run_id} if parent_run_id else {})}.items():
            c.set_tag(rid, k, v)
        return rid
    rid = _deliver(uri, "", "create", payload)
    if prev:
        c.set_tag(rid, "trex.previous_run_id", prev[0].info.run_id)
        for run in prev:
            if _orphaned(run):
                c.set_tag(run.info.run_id, "trex.superseded_by", rid)
                c.set_terminated(run.info.run_id, status="FAILED")
    return rid


def start_run(tracking: dict, name: str, parent_run_id: str | None = None, tags: dict | None = None,
              resume_key: str | None = None) -> Tracker:
    """Open a run (a child of ``parent_run_id`` when given); disabled tracking gives a no-op tracker.
    With ``resume_key`` (a stage's cache key), a run left RUNNING by a killed process is resumed instead.
    If the store is down, the run is created offline (buffered) and delivered later."""
    uri = tracking["uri"]
    buffer_dir, retry = tracking.get("buffer_dir"), float(tracking.get("retry_after_s", 30.0))
    if not tracking.get("enabled", True) or not is_rank0():
        return Tracker(uri, None)
    _http_limits(tracking)
    all_tags = {"mlflow.runName": name, **(tags or {}), **_owner_tags()}
    if resume_key:
        all_tags["trex.resume_key"] = resume_key
    if parent_run_id:
        all_tags["mlflow.parentRunId"] = parent_run_id
    all_tags = {k: str(v) for k, v in all_tags.items()}
    payload = {"experiment": tracking["experiment"], "artifact_root": tracking.get("artifact_root"), "name": name,
               "tags": all_tags, "buffer_dir": str(buffer_dir) if buffer_dir else None}
    if time.monotonic() >= _down_until.get(uri, 0.0):
        try:
            if parent_run_id and parent_run_id.startswith(OFFLINE):
                raise ConnectionError("the parent run is still offline")
            if resume_key:
                exp = experiment_id(uri, tracking["experiment"], tracking.get("artifact_root"))
                return Tracker(uri, _resume_or_link(uri, exp, resume_key, parent_run_id, payload), buffer_dir, retry)
            return Tracker(uri, _deliver(uri, "", "create", payload), buffer_dir, retry)
        except Exception as e:  # noqa: BLE001
            tr = Tracker(uri, OFFLINE + uuid.uuid4().hex[:12], buffer_dir, retry)
            tr._outage(e)
            tr._buffer("create", payload)
            return tr
    tr = Tracker(uri, OFFLINE + uuid.uuid4().hex[:12], buffer_dir, retry)
    tr._buffer("create", payload)
    return tr


def _flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def tracking_uri(tracking_uri_setting: str | None, state_dir: str | Path) -> str:
    """``tracking.tracking_uri``, else the local MLflow server of ``make ui`` while it is up
    (:func:`trex.tracking.ui.detect`), else the SQLite store in the state directory (the same database that
    server serves)."""
    if tracking_uri_setting:
        return tracking_uri_setting
    ui = detect(state_dir)
    if ui is not None:
        return ui["mlflow"]
    return f"sqlite:///{Path(state_dir).resolve() / 'mlflow.db'}"


def tracking_settings(tracking: TrackingConfig, state_dir: str | Path) -> dict:
    """The plain-data tracking settings that travel with every task (``StageContext.tracking``) and into
    training processes: JSON, so that they cross process boundaries and stay out of Prefect's cache keys."""
    state = Path(state_dir).resolve()
    uri = tracking_uri(tracking.tracking_uri, state)
    return {"enabled": tracking.enabled, "uri": uri, "experiment": tracking.experiment,
            # a server stores artifacts itself (mlflow-artifacts:/); the SQLite store beside the state dir
            "artifact_root": None if uri.startswith("http") else (state / "mlartifacts").as_uri(),
            "buffer_dir": str(state / "tracking_buffer"), "retry_after_s": tracking.retry_after_s,
            "request_timeout_s": tracking.request_timeout_s, "system_metrics": tracking.system_metrics}
