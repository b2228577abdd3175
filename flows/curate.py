"""Curate flow: build the OR datasets alone (``trex curate``); announces new data to the retrain trigger.

The stages (:func:`curate_stages`, also the lifecycle's and the retrain's): ``curate``, or with LLM stages
(``data.llm``) ``curate-instances`` -> [``rewrite``] -> [``distill``] -> ``curate``.

The configuration: ``cfg`` (parsed by the CLI) or ``config`` + ``overrides`` (a deployment run), see
``flows/common.py: resolve_config``. The config file and ``overrides`` also travel in the
``trex.dataset.updated`` event (the CLI passes the ones it parsed ``cfg`` from), so the retrain that the event
triggers parses the same configuration.
"""

from __future__ import annotations

import json
from pathlib import Path

from prefect import flow
from prefect.events import emit_event

from flows.common import FlowRecorder, resolve_config
from tasks.curate import assemble_task, curate_task, instances_task
from tasks.llm import distill_task, rewrite_task
from trex.core.config import TrexConfig


def curate_stages(rec: FlowRecorder, cfg: TrexConfig) -> dict:
    """The curation stages (shared by the curate, lifecycle and retrain flows); returns the ``curate`` result.

    Without LLM stages: ``curate`` alone. With ``data.llm.rewrite`` / ``data.llm.distill``: ``curate-instances`` ->
    [``rewrite``] -> [``distill``] -> ``curate`` (the datasets), each cached on the part of ``data`` it uses."""
    data = cfg.data
    if not data.llm.active:
        return rec.stage("curate", curate_task, data=data)
    ref = rec.stage("curate-instances", instances_task, data=data.stage_view("build"))["ref"]
    if data.llm.rewrite.enabled:
        ref = rec.stage("rewrite", rewrite_task, data=data.stage_view("rewrite"), instances_ref=ref)["ref"]
    if data.llm.distill.enabled:
        ref = rec.stage("distill", distill_task, data=data.stage_view("distill"), instances_ref=ref)["ref"]
    return rec.stage("curate", assemble_task, data=data, instances_ref=ref)


@flow(name="curate", log_prints=True)
def curate_flow(config: str | None = "configs/tiny.yaml", overrides: list[str] | None = None,
                cfg: TrexConfig | None = None) -> dict:
    cfg = resolve_config(cfg, config, overrides)
    with FlowRecorder(cfg, "curate", sandbox=("data",)) as rec:
        res = curate_stages(rec, cfg)
        rec.metrics.update({k: float(v) for k, v in res["summary"].items()})
    announce_dataset(cfg, res["ref"], overrides or [])
    return res["ref"]


def announce_dataset(cfg: TrexConfig, ref: dict, overrides: list[str]) -> bool:
    """Emit ``trex.dataset.updated`` when this config's curated data hash differs from the last one announced
    (``<state>/events/dataset-<run.name>.json``): the ``retrain`` deployment's trigger listens for it. The event
    names the config file (``cfg.source``) and ``overrides``, from which the retrain parses its configuration."""
    f = Path(cfg.run.state_dir).resolve() / "events" / f"dataset-{cfg.run.name}.json"
    last = json.loads(f.read_text()) if f.is_file() else {}
    if last.get("hash") == ref["hash"]:
        return False
    emit_event(event="trex.dataset.updated",
               resource={"prefect.resource.id": f"trex.dataset.{cfg.run.name}", "trex.config": str(cfg.source)},
               payload={"data_dir": ref["path"], "hash": ref["hash"], "previous_hash": last.get("hash"),
                        "config": cfg.source, "overrides": overrides})
    f.parent.mkdir(parents=True, exist_ok=True)
    f.write_text(json.dumps({"hash": ref["hash"], "data_dir": ref["path"]}))
    print(f"emitted trex.dataset.updated for {ref['path']} ({ref['hash']})")
    return True
