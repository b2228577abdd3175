"""A published-layout checkpoint as the initial weights of the native parallel engine (gloo, torchrun jobs):
each rank builds its parts on the meta device and reads only the slices it owns; 3 steps under PP2 x EP2 and
DP2 x EP2 x TP2 give the single process's losses; the job's DCP checkpoint converts offline to ``hub-bf16``
exactly as the same weights export in one process."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tests.trainer.helpers import HUB_SMALL, random_docs, tiny_train_cfg
from trainer.data import pack
from trainer.entry import train_stage
from trainer.hub.fixture import write_hub_checkpoint
from trainer.models.deepseek_v4.args import ModelArgs
from trex.core.config import ParallelConfig

SMALL = {**HUB_SMALL, "vocab_size": 97}
LAYOUTS = {"PP2xEP2": {"pp": 2, "ep": 2, "nproc_per_node": 4},
           "DP2xEP2xTP2": {"dp_shard": 2, "ep": 2, "tp": 2, "nproc_per_node": 4}}


def _files(d) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int16) if t.element_size() == 2 else t


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from trainer.tokenizer import train_tokenizer

    root = tmp_path_factory.mktemp("hubpar")
    hub = write_hub_checkpoint(root / "hub", "flash", config=SMALL, seed=5, max_shard_bytes=40_000)
    tok = root / "tok"
    train_tokenizer(iter(["min x + y subject to 3 7 12"] * 10), tok, 300, 1)
    data = pack(random_docs(n=48, vocab=97, seed=1), 32, 0)
    cfg = tiny_train_cfg(steps=3, batch_size=8, log_every=1, ckpt_every=3, warmup_steps=1, adam_eps=1e-6)
    out = {}
    for name, layout in {"single": {}, **LAYOUTS}.items():
        losses: dict[int, float] = {}
        res = train_stage("cpt", ModelArgs(), cfg, ParallelConfig(**layout), 3, data, root / name, str(tok), 97,
                          init_dir=str(hub), on_log=lambda s, m, losses=losses: losses.__setitem__(s, m["loss"]),
                          on_line=None, job_dir=root / f"job-{name}")
        out[name] = (losses, res, root / name)
    return hub, root, out


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_parallel_start_from_the_hub_checkpoint_equals_one_process(runs, name):
    hub, _, out = runs
    want, _, _ = out["single"]
    got, res, _ = out[name]
    assert sorted(got) == sorted(want) == [1, 2, 3]
    for step in want:
        assert abs(got[step] - want[step]) <= 1e-5, (name, step, got[step], want[step])
    total = sum(f.stat().st_size for f in hub.glob("*.safetensors"))
    # every rank read only what it owns: the most any rank read is well below the checkpoint; together the
    # ranks read every slice at least once (replicated tensors more than once)
    assert 0 < res.extra["init_bytes_read_max"] < 0.75 * total, res.extra
    assert res.extra["init_bytes_read_sum"] >= 0.9 * (total - 20_000), res.extra
    per_rank = [res.extra[f"init_bytes_read_rank{r}"] for r in range(4)]
    assert max(per_rank) == res.extra["init_bytes_read_max"] and sum(per_rank) == res.extra["init_bytes_read_sum"]
    print(name, "checkpoint bytes", total, "read per rank", per_rank)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_offline_hub_bf16_of_the_parallel_checkpoint_equals_the_single_process_export(runs, name, tmp_path):
    from trainer import checkpoint
    from trainer.export import export
    from trainer.hub.convert import convert
    from trainer.hub.reader import CheckpointReader

    hub, root, out = runs
    _, res, stage = out[name]
    convert(stage / "checkpoints", tmp_path / "offline", "hub-bf16")
    with CheckpointReader(hub) as reader:
        model = __import__("trainer.models.deepseek_v4.model", fromlist=["Transformer"]).Transformer(
            reader.args, reader.vocab_size)
    checkpoint.load_parts(checkpoint.find_latest(stage / "checkpoints"), [model], None)  # DCP reshards to one process
    export(model, root / "tok", tmp_path / "in_process", to="hub-bf16", scheme=None)
    a, b = _files(tmp_path / "offline"), _files(tmp_path / "in_process")
    assert a.keys() == b.keys() and len(a) > 100
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(_raw(a[k]), _raw(b[k])), k
    # and the job's own (hf) export, written offline from the same checkpoint, holds exactly these weights
    from trainer.hub import load_model

    sd, ref = load_model(stage / "export").state_dict(), model.state_dict()
    assert all(torch.equal(sd[k], ref[k]) for k in ref)
