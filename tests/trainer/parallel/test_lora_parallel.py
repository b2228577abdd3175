"""LoRA under data x expert parallelism (gloo, a torchrun job of 2 ranks, each holding half the experts and their
adapters) from a published-layout checkpoint: the losses, the adapter and the merged export equal one process's."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tests.trainer.helpers import HUB_SMALL, random_docs, tiny_train_cfg
from trainer.data import pack
from trainer.entry import ADAPTER_DIR, train_stage
from trainer.lora import LoRAError
from trainer.export import load_export
from trainer.hub.fixture import write_hub_checkpoint
from trainer.models.deepseek_v4.args import ModelArgs
from trex.core.config import LORA_TARGETS, LoRAConfig, ParallelConfig

SMALL = {**HUB_SMALL, "vocab_size": 97}


@pytest.mark.slow
def test_dp2_ep2_lora_equals_one_process(tmp_path):
    from trainer.tokenizer import train_tokenizer

    hub = write_hub_checkpoint(tmp_path / "hub", "flash", config=SMALL, seed=5)
    tok = tmp_path / "tok"
    train_tokenizer(iter(["min x + y subject to 3 7 12"] * 10), tok, 300, 1)
    data = pack(random_docs(n=48, vocab=97, seed=1), 32, 0)
    lora = LoRAConfig(rank=4, alpha=8, lr=1e-2, base="fp32", targets=list(LORA_TARGETS))
    cfg = tiny_train_cfg(steps=3, batch_size=8, log_every=1, ckpt_every=3, warmup_steps=1, adam_eps=1e-6, lora=lora)
    runs = {}
    for name, layout in {"single": {}, "dp2xep2": {"dp_shard": 2, "ep": 2, "nproc_per_node": 2}}.items():
        losses: dict[int, float] = {}
        train_stage("sft", ModelArgs(), cfg, ParallelConfig(**layout), 3, data, tmp_path / name, str(tok), 97,
                    init_dir=str(hub), on_log=lambda s, m, losses=losses: losses.__setitem__(s, m["loss"]),
                    on_line=None, job_dir=tmp_path / f"job-{name}")
        runs[name] = losses
    assert sorted(runs["dp2xep2"]) == sorted(runs["single"]) == [1, 2, 3]
    for s in runs["single"]:
        assert abs(runs["dp2xep2"][s] - runs["single"][s]) <= 1e-5, runs
    a = load_file(str(tmp_path / "single" / ADAPTER_DIR / "adapter_model.safetensors"))
    b = load_file(str(tmp_path / "dp2xep2" / ADAPTER_DIR / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and any(".experts.3.w2." in k for k in a)
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-3, atol=2e-5)  # (AdamW: ~1e-6 grad noise)
    sa, sb = (load_export(tmp_path / n / "export").state_dict() for n in ("single", "dp2xep2"))
    for k in sa:
        torch.testing.assert_close(sb[k], sa[k], rtol=1e-3, atol=2e-5)
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
    from trainer.tokenizer import train_tokenizer

    hub = write_hub_checkpoint(tmp_path / "hub", "flash", config=SMALL, seed=5)
    tok = tmp_path / "tok"
    train_tokenizer(iter(["min x + y subject to 3 7 12"] * 10), tok, 300, 1)
    data = pack(random_docs(n=48, vocab=97, seed=1), 32, 0)
    lora = LoRAConfig(rank=4, alpha=8, lr=1e-2, base="auto", targets=list(LORA_TARGETS))
    cfg = tiny_train_cfg(steps=3, batch_size=8, log_every=1, ckpt_every=3, warmup_steps=1, adam_eps=1e-6, lora=lora)
    runs, results = {}, {}
    for name, layout in {"single": {}, "dp2xep2": {"dp_shard": 2, "ep": 2, "nproc_per_node": 2}}.items():
        losses: dict[int, float] = {}
        results[name] = train_stage("sft", ModelArgs(), cfg, ParallelConfig(**layout), 3, data, tmp_path / name,
                                    str(tok), 97, init_dir=str(hub),
                                    on_log=lambda s, m, losses=losses: losses.__setitem__(s, m["loss"]),
                                    on_line=None, job_dir=tmp_path / f"job-{name}")
        runs[name] = losses
    for s in runs["single"]:
        assert abs(runs["dp2xep2"][s] - runs["single"][s]) <= 1e-5, runs
    whole = frozen_bytes(load_frozen_base(hub))["quantised"]
    half = frozen_bytes(load_frozen_base(hub, experts=range(2)))["quantised"]
    assert half < whole
    extra = results["dp2xep2"].extra
    assert extra["quantised_bytes_rank0"] == extra["quantised_bytes_rank1"] == half  # each rank: its experts only
    assert extra.get("init_bytes_read_max", 0) == 0  # nothing dequantised from the checkpoint into dense slices
    a = load_file(str(tmp_path / "single" / ADAPTER_DIR / "adapter_model.safetensors"))
    b = load_file(str(tmp_path / "dp2xep2" / ADAPTER_DIR / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and any(".experts.3.w2." in k for k in a)
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-3, atol=2e-5)
    sa, sb = (load_export(tmp_path / n / "export").state_dict() for n in ("single", "dp2xep2"))
    for k in sa:
        torch.testing.assert_close(sb[k], sa[k], rtol=1e-3, atol=2e-5)


@pytest.mark.slow
@pytest.mark.parametrize("base", ["fp32", "auto"])
def test_pp2_lora_and_qlora_equal_one_process(tmp_path, base):
    """LoRA (a dense float32 base) and QLoRA (the quantised base) under two pipeline stages: each stage holds its
    layers and their adapters -- under QLoRA only its layers' codes, read from the checkpoint --, and the losses and
    the adapter equal one process's."""
    from trainer.hub.frozen_base import load_frozen_base
    from trainer.qbase import frozen_bytes
    from trainer.tokenizer import train_tokenizer

    hub = write_hub_checkpoint(tmp_path / "hub", "flash", config=SMALL, seed=5)
    tok = tmp_path / "tok"
    train_tokenizer(iter(["min x + y subject to 3 7 12"] * 10), tok, 300, 1)
    data = pack(random_docs(n=48, vocab=97, seed=1), 32, 0)
    lora = LoRAConfig(rank=4, alpha=8, lr=1e-2, base=base, targets=list(LORA_TARGETS))
    cfg = tiny_train_cfg(steps=3, batch_size=8, log_every=1, ckpt_every=3, warmup_steps=1, adam_eps=1e-6, lora=lora)
    runs, results = {}, {}
    for name, layout in {"single": {}, "pp2": {"pp": 2, "nproc_per_node": 2}}.items():
        losses: dict[int, float] = {}
        results[name] = train_stage("sft", ModelArgs(), cfg, ParallelConfig(**layout), 3, data, tmp_path / name,
                                    str(tok), 97, init_dir=str(hub),
                                    on_log=lambda s, m, losses=losses: losses.__setitem__(s, m["loss"]),
                                    on_line=None, job_dir=tmp_path / f"job-{name}")
        runs[name] = losses
    for s in runs["single"]:
        assert abs(runs["pp2"][s] - runs["single"][s]) <= 1e-5, runs
    if base == "auto":  # stage 0: layers 0-1, stage 1: layer 2 (+ the head): their quantised codes partition the base
        extra, whole = results["pp2"].extra, frozen_bytes(load_frozen_base(hub))["quantised"]
        assert 0 < extra["quantised_bytes_rank1"] < extra["quantised_bytes_rank0"] < whole
        assert extra["quantised_bytes_rank0"] + extra["quantised_bytes_rank1"] == whole
    a = load_file(str(tmp_path / "single" / ADAPTER_DIR / "adapter_model.safetensors"))
    b = load_file(str(tmp_path / "pp2" / ADAPTER_DIR / "adapter_model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-3, atol=2e-5)


@pytest.mark.slow
def test_tp2_lora_equals_one_process(tmp_path):
    """LoRA under tensor parallelism: a column-parallel linear's ``b`` split by rows, a row-parallel one's ``a`` by
    columns, the routed experts' ``b_gate`` / ``b_up`` / ``a_down`` along the width (the others' gradients summed over
    tp); the losses, the adapter and the merged export equal one process's."""
    from trainer.tokenizer import train_tokenizer

    hub = write_hub_checkpoint(tmp_path / "hub", "flash", config=SMALL, seed=5)
    tok = tmp_path / "tok"
    train_tokenizer(iter(["min x + y subject to 3 7 12"] * 10), tok, 300, 1)
    data = pack(random_docs(n=48, vocab=97, seed=1), 32, 0)
    lora = LoRAConfig(rank=4, alpha=8, lr=1e-2, base="fp32", targets=list(LORA_TARGETS))
    cfg = tiny_train_cfg(steps=3, batch_size=8, log_every=1, ckpt_every=3, warmup_steps=1, adam_eps=1e-6, lora=lora)
    runs = {}
    for name, layout in {"single": {}, "tp2": {"tp": 2, "nproc_per_node": 2}}.items():
        losses: dict[int, float] = {}
        train_stage("sft", ModelArgs(), cfg, ParallelConfig(**layout), 3, data, tmp_path / name, str(tok), 97,
                    init_dir=str(hub), on_log=lambda s, m, losses=losses: losses.__setitem__(s, m["loss"]),
                    on_line=None, job_dir=tmp_path / f"job-{name}")
        runs[name] = losses
    for s in runs["single"]:
        assert abs(runs["tp2"][s] - runs["single"][s]) <= 1e-5, runs
    a = load_file(str(tmp_path / "single" / ADAPTER_DIR / "adapter_model.safetensors"))
    b = load_file(str(tmp_path / "tp2" / ADAPTER_DIR / "adapter_model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-3, atol=2e-5)
    sa, sb = (load_export(tmp_path / n / "export").state_dict() for n in ("single", "tp2"))
    for k in sa:
        torch.testing.assert_close(sb[k], sa[k], rtol=1e-3, atol=2e-5)
    with pytest.raises(LoRAError, match="sequence_parallel"):
        train_stage("sft", ModelArgs(), cfg, ParallelConfig(tp=2, nproc_per_node=2, sequence_parallel=True), 3, data,
                    tmp_path / "sp", str(tok), 97, init_dir=str(hub), on_line=None)
    qlora = tiny_train_cfg(steps=3, batch_size=8, lora=LoRAConfig(rank=4, base="auto"))
    with pytest.raises(LoRAError, match="QLoRA"):
        train_stage("sft", ModelArgs(), qlora, ParallelConfig(tp=2, nproc_per_node=2), 3, data, tmp_path / "q",
                    str(tok), 97, init_dir=str(hub), on_line=None)
