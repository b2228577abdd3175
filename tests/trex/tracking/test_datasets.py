"""Dataset inputs on MLflow runs (``Tracker.dataset``): delivered at once, or buffered through an outage."""

from __future__ import annotations

import json

from trex.tracking.runs import flush_buffers, start_run


def _inputs(uri: str, run_id: str):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri).get_run(run_id).inputs.dataset_inputs


def test_a_dataset_input_carries_name_digest_source_context_and_profile(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run = start_run({"uri": uri, "experiment": "t", "buffer_dir": str(tmp_path / "buf")}, "sft")
    (tmp_path / "sft").mkdir()
    run.dataset("sft@abc", tmp_path / "sft", "0123456789abcdef", "training", rows=12, features={"messages": "list"})
    run.dataset("nl4opt", "ignored", "feedbeef", "evaluation", source="hf://datasets/org/nl4opt")
    run.finish()
    got = {d.dataset.name: d for d in _inputs(uri, run.run_id)}
    sft = got["sft@abc"]
    assert sft.dataset.digest == "0123456789abcdef" and sft.dataset.source_type == "local"
    assert json.loads(sft.dataset.source) == {"uri": str((tmp_path / "sft").resolve())}
    assert json.loads(sft.dataset.profile) == {"num_rows": 12, "features": {"messages": "list"}}
    assert [(t.key, t.value) for t in sft.tags] == [("mlflow.data.context", "training")]
    assert got["nl4opt"].dataset.source_type == "hf" and got["nl4opt"].tags[0].value == "evaluation"


def test_a_dataset_input_logged_during_an_outage_arrives_afterwards(tmp_path):
    down = "http://127.0.0.1:9"  # nothing listens: the run is created offline and buffered
    buf = tmp_path / "buf"
    run = start_run({"uri": down, "experiment": "t", "buffer_dir": str(buf)}, "cpt")
    assert run.offline
    run.dataset("cpt@abc", tmp_path, "d1g3st", "training", rows=3)
    run.finish()
    # the store is back (here: another URI for the same buffered records, as `trex tracking flush` would use)
    records = [json.loads(x) for f in buf.glob("*.jsonl") for x in f.read_text().splitlines()]
    assert any(r["kind"] == "dataset" and r["payload"]["digest"] == "d1g3st" for r in records)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    for f in buf.glob("*.jsonl"):
        f.write_text(f.read_text().replace(down, uri))
    assert flush_buffers(buf) == {"delivered": 1, "pending": 0}
    rid = json.loads((buf / "run_ids.json").read_text())
    (real,) = rid.values()
    assert [d.dataset.name for d in _inputs(uri, real)] == ["cpt@abc"]
