"""Flow plumbing without a flow run: where the configuration comes from, and the recorder as a context manager."""

from __future__ import annotations

import pytest

from flows.common import FlowRecorder, resolve_config
from flows.retrain import with_data_seed
from trex.core.config import load_config


def test_resolve_config_takes_the_parsed_config_else_parses_the_deployment_parameters():
    cfg = load_config("configs/micro.yaml", ["data.seed=3"])
    assert resolve_config(cfg, "configs/tiny.yaml", ["data.seed=9"]) is cfg
    parsed = resolve_config(None, "configs/micro.yaml", ["data.seed=3"])
    assert parsed.model_dump(mode="json") == cfg.model_dump(mode="json") and parsed.source == "configs/micro.yaml"
    assert resolve_config(None, None, None).source is None


def test_with_data_seed_is_the_override_and_leaves_the_callers_config_alone():
    cfg = load_config("configs/micro.yaml", ["data.seed=3"])
    seeded = with_data_seed(cfg, 202611)
    assert cfg.data.seed == 3 and seeded.source == "configs/micro.yaml"
    assert seeded.model_dump(mode="json") == load_config("configs/micro.yaml", ["data.seed=202611"]).model_dump(mode="json")


def _parent_status(state) -> list[tuple[str, float | None]]:
    from mlflow.tracking import MlflowClient

    c = MlflowClient(tracking_uri=f"sqlite:///{state / 'mlflow.db'}")
    runs = c.search_runs([c.get_experiment_by_name("trex").experiment_id], order_by=["attributes.start_time ASC"])
    return [(r.info.status, r.data.metrics.get("answer")) for r in runs]


def test_flow_recorder_finishes_the_parent_run_failed_on_an_exception_else_finished(tmp_path, monkeypatch):
    import flows.common

    published = []
    monkeypatch.setattr(flows.common, "create_markdown_artifact", lambda md, key, description: published.append(key))
    state = tmp_path / "state"
    cfg = load_config("configs/micro.yaml", [f"run.state_dir={state}"])
    with FlowRecorder(cfg, "unit") as rec:
        rec.metrics["answer"] = 42.0
    with pytest.raises(KeyError):
        with FlowRecorder(cfg.model_copy(update={"data": cfg.data.model_copy(update={"seed": 5})}), "unit") as rec:
            rec.metrics["answer"] = 1.0
            raise KeyError("a stage failed")
    assert _parent_status(state) == [("FINISHED", 42.0), ("FAILED", None)]  # a failed run logs no metrics
    assert published == ["trex-unit-summary"]  # and publishes no summary
