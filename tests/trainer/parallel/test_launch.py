"""The native parallel engine through the Prefect train task: a torchrun job, rank 0's metrics in the
stage's MLflow run, the HF export written from the gathered weights -- equal to the single-process stage."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.trainer.helpers import TINY
from trainer.models.deepseek_v4.args import ModelArgs
from trex.core.config import ParallelConfig, StageTrainConfig


def _data(tmp_path: Path):
    import datasets

    from trainer.tokenizer import train_tokenizer
    from trex.core.refs import write_manifest

    g = torch.Generator().manual_seed(0)
    words = ["min", "max", "x", "y", "subject", "to", "cost", "<=", ">=", "+", "3", "7", "12"]
    texts = [" ".join(words[int(i)] for i in torch.randint(0, len(words), (30,), generator=g)) for _ in range(40)]
    data_dir, tok_dir = tmp_path / "data", tmp_path / "tok"
    datasets.Dataset.from_list([{"text": t} for t in texts]).save_to_disk(str(data_dir / "cpt"))
    train_tokenizer(iter(texts), tok_dir, 300, 1)
    return write_manifest(data_dir, "data", {}), write_manifest(tok_dir, "tokenizer", {})


@pytest.mark.slow
def test_train_task_runs_the_parallel_engine_and_matches_one_process(tmp_path):
    from mlflow.tracking import MlflowClient
    from transformers import DeepseekV4ForCausalLM

    from tasks.common import StageContext
    from tasks.train import train_task
    from trainer.export import load_export

    data_ref, tok_ref = _data(tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    # at most 5 steps; every loss is under the threshold, so the decay starts after step 2 and ends the run at 3
    train = StageTrainConfig(steps=5, batch_size=4, seq_len=32, warmup_steps=1, log_every=1, ckpt_every=2,
                             adam_eps=1e-6, schedule="wsd", decay_steps=1, decay_trigger_loss=1e3,
                             decay_trigger_window=2)
    results = {}
    for name, layout in (("single", ParallelConfig()), ("ep2", ParallelConfig(ep=2, nproc_per_node=2))):
        ctx = StageContext(output_dir=str(tmp_path / name), tracking={"enabled": True, "uri": uri, "experiment": "t"})
        results[name] = train_task.fn("cpt", ModelArgs(**TINY), train, 0, data_ref, tok_ref, None, ctx,
                                      parallel=layout)
    res = results["ep2"]
    client = MlflowClient(tracking_uri=uri)
    assert sorted(m.step for m in client.get_metric_history(res["mlflow_run_id"], "loss")) == [1, 2, 3]
    run = client.get_run(res["mlflow_run_id"])
    assert run.data.metrics["world"] == 2 and run.data.metrics["mfu"] > 0
    assert abs(res["summary"]["final_loss"] - results["single"]["summary"]["final_loss"]) < 1e-5
    for r in results.values():
        assert (r["summary"]["steps"], r["summary"]["decay_triggered_at"]) == (3, 2)
    export_dir = Path(res["ref"]["path"]) / "export"
    config = json.loads((export_dir / "config.json").read_text())
    assert config["trex_engine"] == "native-parallel" and config["trex_steps"] == 3
    got = load_export(export_dir).state_dict()
    want = load_export(Path(results["single"]["ref"]["path"]) / "export").state_dict()
    assert max((got[k] - want[k]).abs().max().item() for k in want) < 1e-5
    DeepseekV4ForCausalLM.from_pretrained(export_dir)
