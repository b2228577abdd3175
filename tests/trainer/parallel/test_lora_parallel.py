"""LoRA and QLoRA under parallel layouts (gloo, torchrun jobs of 2 ranks) from a published-layout checkpoint: data x
expert parallelism (each rank holding half the experts and their adapters), pipeline stages and tensor parallelism;
the losses, the adapter and the merged export equal one process's."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tests.trainer.helpers import HUB_SMALL, random_docs, tiny_train_cfg
from trainer.data import pack
from trainer.entry import ADAPTER_DIR, train_stage
from trainer.export import load_export
from trainer.hub.fixture import write_hub_checkpoint
from trainer.lora import LoRAError
from trainer.models.deepseek_v4.args import ModelArgs
from trex.core.config import LORA_TARGETS, LoRAConfig, ParallelConfig

SMALL = {**HUB_SMALL, "vocab_size": 97}


def _inputs(tmp_path):
    """(the published-layout checkpoint, a tokenizer, packed rows)."""
    from trainer.tokenizer import train_tokenizer

    hub = write_hub_checkpoint(tmp_path / "hub", "flash", config=SMALL, seed=5)
    tok = tmp_path / "tok"
    train_tokenizer(iter(["min x + y subject to 3 7 12"] * 10), tok, 300, 1)
    return hub, tok, pack(random_docs(n=48, vocab=97, seed=1), 32, 0)


def _cfg(base: str):
    lora = LoRAConfig(rank=4, alpha=8, lr=1e-2, base=base, targets=list(LORA_TARGETS))
    return tiny_train_cfg(steps=3, batch_size=8, log_every=1, ckpt_every=3, warmup_steps=1, adam_eps=1e-6, lora=lora)


def _train_both(tmp_path, base: str, name: str, layout: dict):
    """One process and ``layout`` from the same checkpoint: (hub, tok, data, cfg, {run: losses}, {run: result})."""
    hub, tok, data = _inputs(tmp_path)
    cfg = _cfg(base)
    runs, results = {}, {}
    for run, lay in {"single": {}, name: layout}.items():
        losses: dict[int, float] = {}
        results[run] = train_stage("sft", ModelArgs(), cfg, ParallelConfig(**lay), 3, data, tmp_path / run, str(tok),
                                   97, init_dir=str(hub),
                                   on_log=lambda s, m, losses=losses: losses.__setitem__(s, m["loss"]),
                                   on_line=None, job_dir=tmp_path / f"job-{run}")
        runs[run] = losses
    for s in runs["single"]:
        assert abs(runs[name][s] - runs["single"][s]) <= 1e-5, runs
    return hub, tok, data, cfg, runs, results


def _adapters(tmp_path, name: str) -> dict[str, torch.Tensor]:
    """The adapter of one process and of the job ``name``, equal (AdamW: ~1e-6 grad noise); the single one."""
    a = load_file(str(tmp_path / "single" / ADAPTER_DIR / "adapter_model.safetensors"))
    b = load_file(str(tmp_path / name / ADAPTER_DIR / "adapter_model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-3, atol=2e-5)
    return a


def _exports(tmp_path, name: str):
    """The merged exports of one process and of the job ``name``, equal; both state dicts."""
    sa, sb = (load_export(tmp_path / n / "export").state_dict() for n in ("single", name))
    for k in sa:
        torch.testing.assert_close(sb[k], sa[k], rtol=1e-3, atol=2e-5)
    return sa, sb


@pytest.mark.slow
def test_dp2_ep2_lora_equals_one_process(tmp_path):
    hub, _, _, _, runs, _ = _train_both(tmp_path, "fp32", "dp2xep2", {"dp_shard": 2, "ep": 2, "nproc_per_node": 2})
    assert sorted(runs["dp2xep2"]) == sorted(runs["single"]) == [1, 2, 3]
    assert any(".experts.3.w2." in k for k in _adapters(tmp_path, "dp2xep2"))
    sa, sb = _exports(tmp_path, "dp2xep2")
    from trainer.hub.convert import convert  # the job's DCP checkpoint converted offline: its adapters merged

    convert(tmp_path / "dp2xep2" / "checkpoints", tmp_path / "from-dcp", "hf", fsync=False)
    sc = load_export(tmp_path / "from-dcp").state_dict()
    for k in sb:
        assert torch.equal(sc[k], sb[k]), k
    base = load_export(hub).state_dict()
    assert not torch.equal(sa["layers.1.ffn.w_down"], base["layers.1.ffn.w_down"])


@pytest.mark.slow
def test_dp2_ep2_qlora_keeps_each_ranks_experts_quantised_and_equals_one_process(tmp_path):
    """QLoRA (``lora.base: auto`` on the published FP8 / MXFP4 layout) under DP2 x EP2: every rank holds the quantised
    base with half the routed experts' codes; losses, adapter and merged export equal one process's QLoRA."""
    from trainer.hub.frozen_base import load_frozen_base
    from trainer.qbase import frozen_bytes

    hub, *_, results = _train_both(tmp_path, "auto", "dp2xep2", {"dp_shard": 2, "ep": 2, "nproc_per_node": 2})
    whole = frozen_bytes(load_frozen_base(hub))["quantised"]
    half = frozen_bytes(load_frozen_base(hub, experts=range(2)))["quantised"]
    assert half < whole
    extra = results["dp2xep2"].extra
    assert extra["quantised_bytes_rank0"] == extra["quantised_bytes_rank1"] == half  # each rank: its experts only
    assert extra.get("init_bytes_read_max", 0) == 0  # nothing dequantised from the checkpoint into dense slices
    assert any(".experts.3.w2." in k for k in _adapters(tmp_path, "dp2xep2"))
    _exports(tmp_path, "dp2xep2")


@pytest.mark.slow
@pytest.mark.parametrize("base", ["fp32", "auto"])
def test_pp2_lora_and_qlora_equal_one_process(tmp_path, base):
    """LoRA (a dense float32 base) and QLoRA (the quantised base) under two pipeline stages: each stage holds its
    layers and their adapters -- under QLoRA only its layers' codes, read from the checkpoint --, and the losses and
    the adapter equal one process's."""
    from trainer.hub.frozen_base import load_frozen_base
    from trainer.qbase import frozen_bytes

    hub, *_, results = _train_both(tmp_path, base, "pp2", {"pp": 2, "nproc_per_node": 2})
    if base == "auto":  # stage 0: layers 0-1, stage 1: layer 2 (+ the head): their quantised codes partition the base
        extra, whole = results["pp2"].extra, frozen_bytes(load_frozen_base(hub))["quantised"]
        assert 0 < extra["quantised_bytes_rank1"] < extra["quantised_bytes_rank0"] < whole
        assert extra["quantised_bytes_rank0"] + extra["quantised_bytes_rank1"] == whole
    _adapters(tmp_path, "pp2")


@pytest.mark.slow
def test_tp2_lora_equals_one_process(tmp_path):
    """LoRA under tensor parallelism: a column-parallel linear's ``b`` split by rows, a row-parallel one's ``a`` by
    columns, the routed experts' ``b_gate`` / ``b_up`` / ``a_down`` along the width (the others' gradients summed over
    tp); the losses, the adapter and the merged export equal one process's."""
    hub, tok, data, cfg, _, _ = _train_both(tmp_path, "fp32", "tp2", {"tp": 2, "nproc_per_node": 2})
    _adapters(tmp_path, "tp2")
    _exports(tmp_path, "tp2")
    with pytest.raises(LoRAError, match="sequence_parallel"):
        train_stage("sft", ModelArgs(), cfg, ParallelConfig(tp=2, nproc_per_node=2, sequence_parallel=True), 3, data,
                    tmp_path / "sp", str(tok), 97, init_dir=str(hub), on_line=None)
    qlora = tiny_train_cfg(steps=3, batch_size=8, lora=LoRAConfig(rank=4, base="auto"))
    with pytest.raises(LoRAError, match="QLoRA"):
        train_stage("sft", ModelArgs(), qlora, ParallelConfig(tp=2, nproc_per_node=2), 3, data, tmp_path / "q",
                    str(tok), 97, init_dir=str(hub), on_line=None)
