"""End to end from a checkpoint in the published DeepSeek-V4 layout (``model.init_from``), through the real CLI:
import -> CPT -> SFT -> evaluate -> export (hub-fp8) -> register, with the checkpoint's tokenizer and chat format;
and a YAML model key that contradicts the checkpoint stops the run before any training."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.prefect_server import flow_env

ROOT = Path(__file__).resolve().parents[2]


def trex(args, state: Path, timeout=900):
    env = flow_env()
    cmd = [sys.executable, "-m", "trex", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def _manifest(d: Path) -> dict:
    return json.loads((d / "manifest.json").read_text())


@pytest.fixture(scope="module")
def hub_run(tmp_path_factory):
    state = tmp_path_factory.mktemp("state")
    fixture = state / "hub-fixture"
    made = trex(["hub-fixture", str(fixture)], state)
    assert made.returncode == 0, made.stderr[-3000:]
    run = trex(["lifecycle", "--config", "configs/hub_micro.yaml", "--set", f"run.state_dir={state}",
                "--set", f"model.init_from={fixture}"], state)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    return state, fixture, run


@pytest.mark.slow
def test_lifecycle_from_a_published_layout_checkpoint(hub_run):
    from mlflow.tracking import MlflowClient

    from trainer.hub import CheckpointReader, load_model
    from trainer.hub.placement import fp8_placement_problems
    from trainer.tokenizer import ChatTokenizer

    state, fixture, run = hub_run
    out = state / "outputs"
    for stage in ("import", "cpt", "sft", "export-hub-fp8"):
        assert (out / stage).is_dir(), stage
    (imp,) = (out / "import").iterdir()
    assert (imp / "export").resolve() == fixture.resolve()
    assert _manifest(imp)["summary"]["format"] == "hub" and _manifest(imp)["summary"]["scheme"] == "flash"

    # the checkpoint's tokenizer and chat format were adopted, and SFT trained in that format
    (tok_dir,) = (out / "tokenizer").iterdir()
    assert _manifest(tok_dir)["chat_format"] == "deepseek_v4" and _manifest(tok_dir)["source"] == str(fixture)
    assert (tok_dir / "tokenizer.json").read_bytes() == (fixture / "tokenizer.json").read_bytes()
    tok = ChatTokenizer(tok_dir)
    ids, mask = tok.encode_chat([{"role": "user", "content": "min x"}, {"role": "assistant", "content": "x=0"}])
    assert tok.tok.decode(ids, skip_special_tokens=False).startswith("<｜begin▁of▁sentence｜><｜User｜>")

    # CPT started from the checkpoint (its architecture, its weights), and training changed them
    (cpt,) = (out / "cpt").iterdir()
    assert _manifest(cpt)["inputs"]["init"]["path"] == str(imp)
    src = CheckpointReader(fixture)
    trained = load_model(cpt / "export")
    assert trained.cfg.hidden_size == src.args.hidden_size and trained.cfg.mtp_layers == 1
    base = load_model(fixture)
    sd, bd = trained.state_dict(), base.state_dict()
    assert max((sd[k].float() - bd[k].float()).abs().max().item() for k in bd) > 0

    # the registered model is the hub-fp8 export: the published config (plus provenance), shards and placement
    (exp,) = (out / "export-hub-fp8").iterdir()
    hub = exp / "export"
    cfg, src_cfg = json.loads((hub / "config.json").read_text()), json.loads((fixture / "config.json").read_text())
    assert {k: v for k, v in cfg.items() if k != "trex_provenance"} == src_cfg
    assert cfg["trex_provenance"]["target"] == "hub-fp8"
    assert json.loads((hub / "model.safetensors.index.json").read_text())["weight_map"] == \
        json.loads((fixture / "model.safetensors.index.json").read_text())["weight_map"]
    assert fp8_placement_problems(hub) == []
    (sft,) = (out / "sft").iterdir()
    fp32 = load_model(sft / "export")
    back = load_model(hub)
    ids_t = torch.tensor([ids])
    with torch.no_grad():
        a, b = fp32(ids_t), back(ids_t)
    assert (a - b).abs().max().item() < 0.5 * a.abs().max().item()  # the same model, within FP8/MXFP4 rounding
    client = MlflowClient(tracking_uri=f"sqlite:///{state / 'mlflow.db'}")
    (version,) = client.search_model_versions("name='trex-or'")
    artifact = Path(version.source.removeprefix("file://"))
    registered = json.loads((artifact / "config.json").read_text())
    assert registered["trex_provenance"]["target"] == "hub-fp8" and "quantization_config" in registered
    assert (artifact / "model-00001-of-00007.safetensors").read_bytes() == \
        (hub / "model-00001-of-00007.safetensors").read_bytes()


@pytest.mark.slow
def test_a_model_key_contradicting_the_checkpoint_stops_before_training(hub_run, tmp_path):
    state, fixture, _ = hub_run
    bad = trex(["lifecycle", "--config", "configs/hub_micro.yaml", "--set", f"run.state_dir={tmp_path}",
                "--set", f"model.init_from={fixture}", "--set", "model.hidden_size=64"], tmp_path)
    assert bad.returncode != 0
    assert "model.hidden_size=64 contradicts" in bad.stdout + bad.stderr
    assert "which has 256" in bad.stdout + bad.stderr
    assert not (tmp_path / "outputs" / "cpt").exists()
