"""Curate flow: build the OR datasets alone (``trex curate``); announces new data to the retrain trigger."""

from __future__ import annotations

import json
from pathlib import Path

from prefect import flow

from flows.common import FlowRecorder
from tasks.curate import curate_task
from trex.core.config import load_config


@flow(name="curate", log_prints=True)
def curate_flow(config: str | None = "configs/tiny.yaml", overrides: list[str] | None = None) -> dict:
    cfg = load_config(config, overrides or [])
    rec = FlowRecorder(cfg, "curate")
    try:
        res = rec.stage("curate", curate_task, data=cfg.data.model_dump(mode="json"))
    except BaseException:
        rec.finish(failed=True)
        raise
    rec.finish({k: float(v) for k, v in res["summary"].items()})
    announce_dataset(cfg, res["ref"], config, overrides or [])
    return res["ref"]


def announce_dataset(cfg, ref: dict, config: str | None, overrides: list[str]) -> bool:
    """Emit ``trex.dataset.updated`` when this config's curated data hash differs from the last one announced
    (``<state>/events/dataset-<run.name>.json``): the ``retrain`` deployment's trigger listens for it."""
    from prefect.events import emit_event

    f = Path(cfg.run.state_dir).resolve() / "events" / f"dataset-{cfg.run.name}.json"
    last = json.loads(f.read_text()) if f.is_file() else {}
    if last.get("hash") == ref["hash"]:
        return False
    emit_event(event="trex.dataset.updated",
               resource={"prefect.resource.id": f"trex.dataset.{cfg.run.name}", "trex.config": str(config)},
               payload={"data_dir": ref["path"], "hash": ref["hash"], "previous_hash": last.get("hash"),
                        "config": config, "overrides": overrides})
    f.parent.mkdir(parents=True, exist_ok=True)
    f.write_text(json.dumps({"hash": ref["hash"], "data_dir": ref["path"]}))
    print(f"emitted trex.dataset.updated for {ref['path']} ({ref['hash']})")
    return True
