"""MLflow outages: training goes on, records are buffered locally with a warning, and delivered later."""

from __future__ import annotations

import time
import warnings

import pytest

from trex.tracking import runs as tracking
from tests.trex.tracking.mlflow_server import MlflowServer


@pytest.fixture(autouse=True)
def fast_failures(monkeypatch):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    tracking._down_until.clear()
    yield
    tracking._down_until.clear()


def _settings(uri, buffer_dir):
    return {"enabled": True, "uri": uri, "experiment": "outage", "buffer_dir": str(buffer_dir),
            "retry_after_s": 0.5, "request_timeout_s": 2}


def _patient(monkeypatch) -> None:
    """Requests to a live server may wait for it: the 2 s request timeout that keeps the outage short
    (``_http_limits`` puts it in the environment, where MLflow reads it per request) timed a request out on a
    fresh server's first writes while the other test process compiled on the same 2 cores."""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "60")


@pytest.mark.slow
def test_server_dies_mid_run_then_returns_nothing_lost(tmp_path, monkeypatch):
    # patient from the start: a 2 s timeout on the fresh server's first writes, under load, was an outage before
    # the outage (then the warning asserted below had already been given). A stopped server refuses connections
    # at once, so the outage below is still seen without waiting.
    _patient(monkeypatch)
    with MlflowServer(tmp_path / "mlflow") as server:
        server.start()
        settings = _settings(server.url, tmp_path / "buffer")
        parent = tracking.start_run(settings, "flow")
        run = tracking.start_run(settings, "cpt", parent.run_id, resume_key="cpt:abc")
        run.params({"lr": 0.003})
        for step in range(1, 4):
            run.metrics({"loss": 5.0 - step}, step)
        server.stop()  # outage (the port stays reserved for this server: connections are refused)
        t0 = time.monotonic()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(4, 9):
                run.metrics({"loss": 5.0 - step}, step)
            sft = tracking.start_run(settings, "sft", parent.run_id)  # created offline
            sft.metrics({"loss": 0.5}, 1)
            run.finish()
        assert time.monotonic() - t0 < 15  # no minutes of retries: training is not stalled
        assert sum("unreachable" in str(w.message) for w in caught) >= 1
        assert sft.offline and any((tmp_path / "buffer").glob("*.jsonl"))
        server.start()  # (flush_buffers delivers at once: only live runs wait out retry_after_s)
        assert tracking.flush_buffers(tmp_path / "buffer") == {"delivered": 2, "pending": 0}
        assert not list((tmp_path / "buffer").glob("*.jsonl"))
        c = tracking.client(server.url)
        history = c.get_metric_history(run.run_id, "loss")
        assert [m.step for m in sorted(history, key=lambda m: m.step)] == list(range(1, 9))
        assert c.get_run(run.run_id).info.status == "FINISHED"
        real_sft = tracking.resolve_run_id(tmp_path / "buffer", sft.run_id)
        got = c.get_run(real_sft)
        assert got.data.metrics["loss"] == 0.5 and got.data.tags["mlflow.parentRunId"] == parent.run_id


@pytest.mark.slow
def test_train_task_trains_through_an_unreachable_server(tmp_path, monkeypatch):
    """The Prefect train task with MLflow down from the start: it trains, exports, buffers everything."""
    import datasets

    from tasks.common import StageContext
    from tasks.train import train_task
    from tests.trainer.helpers import TINY
    from trainer.models.deepseek_v4.args import ModelArgs
    from trainer.tokenizer import train_tokenizer
    from trex.core.config import StageTrainConfig
    from trex.core.refs import write_manifest

    texts = ["min x + y subject to x <= 3"] * 30
    datasets.Dataset.from_list([{"text": t} for t in texts]).save_to_disk(str(tmp_path / "data" / "cpt"))
    train_tokenizer(iter(texts), tmp_path / "tok", 120, 1)
    data_ref, tok_ref = write_manifest(tmp_path / "data", "data", {}), write_manifest(tmp_path / "tok", "tokenizer", {})
    with MlflowServer(tmp_path / "m") as server:  # its port is reserved; nothing listens there yet
        settings = _settings(server.url, tmp_path / "buffer") | {"system_metrics": False}
        ctx = StageContext(output_dir=str(tmp_path / "out"), tracking=settings)
        train = StageTrainConfig(steps=3, batch_size=2, seq_len=32, warmup_steps=1, log_every=1)
        with pytest.warns(RuntimeWarning, match="unreachable"):
            res = train_task.fn("cpt", ModelArgs(**TINY), train, 0, data_ref, tok_ref, None, ctx)
        assert res["summary"]["steps"] == 3 and res["mlflow_run_id"].startswith(tracking.OFFLINE)
        server.start()
        _patient(monkeypatch)
        assert tracking.flush_buffers(tmp_path / "buffer")["pending"] == 0
        real = tracking.resolve_run_id(tmp_path / "buffer", res["mlflow_run_id"])
        c = tracking.client(server.url)
        assert sorted(m.step for m in c.get_metric_history(real, "loss")) == [1, 2, 3]
        assert "plots" in {a.path for a in c.list_artifacts(real)}
