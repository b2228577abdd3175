"""Curate flow: build the OR datasets alone (``trex curate``)."""

from __future__ import annotations

from prefect import flow

from flows.common import FlowRecorder
from tasks.curate import curate_task
from trex.config import load_config


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
    return res["ref"]


if __name__ == "__main__":
    from trex.cli import main

    main(["curate"])
