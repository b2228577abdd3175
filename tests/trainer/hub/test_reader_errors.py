"""``CheckpointReader`` on broken checkpoints: every mismatch between the tensors and ``config.json`` (or the
index) is a :class:`CheckpointError` naming the tensor and the file; ``check_args`` rejects a run config
that contradicts the checkpoint's architecture and lets training-only fields through."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from trainer.hub.fixture import write_hub_checkpoint
from trainer.hub.reader import CheckpointError, CheckpointReader, check_args, load_model
from trainer.models.deepseek_v4.args import ModelArgs

INDEX = "model.safetensors.index.json"


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    root = tmp_path_factory.mktemp("base")
    return {v: write_hub_checkpoint(root / v, v) for v in ("flash", "flash-base")}


@pytest.fixture
def ckpt(bases, tmp_path):
    """A fresh copy of the V4-Flash fixture to break."""
    return Path(shutil.copytree(bases["flash"], tmp_path / "ckpt"))


def shard_of(path: Path, name: str) -> str:
    return json.loads((path / INDEX).read_text())["weight_map"][name]


def edit(path: Path, name: str, fn, index: bool = True) -> str:
    """Rewrite the shard holding ``name`` through ``fn(tensors)`` (in place); with ``index`` the index follows
    (removed and added names). The shard's file name."""
    f = shard_of(path, name)
    before = load_file(str(path / f))
    after = dict(before)
    fn(after)
    save_file(after, str(path / f), metadata={"format": "pt"})
    if index:
        idx = json.loads((path / INDEX).read_text())
        for k in set(before) - set(after):
            del idx["weight_map"][k]
        idx["weight_map"].update({k: f for k in set(after) - set(before)})
        (path / INDEX).write_text(json.dumps(idx))
    return f


def edit_config(path: Path, **changes) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def error(path: Path) -> str:
    with pytest.raises(CheckpointError) as e:
        CheckpointReader(path)
    return str(e.value)


def test_the_fixture_itself_opens(bases):
    for path in bases.values():
        with CheckpointReader(path) as r:
            assert r.format == "hub"


# ---------------------------------------------------------------------------------------- tensors
def test_missing_tensor(ckpt):
    name = "layers.2.attn.wq_b.weight"
    edit(ckpt, name, lambda t: t.pop(name))
    msg = error(ckpt)
    assert repr(name) in msg and INDEX in msg and "missing" in msg, msg


def test_missing_tensor_the_index_still_lists(ckpt):
    name = "layers.3.ffn.experts.5.w2.weight"
    f = edit(ckpt, name, lambda t: t.pop(name), index=False)
    msg = error(ckpt)
    assert repr(name) in msg and (f in msg or INDEX in msg), msg


def test_missing_tensor_single_file(bases, tmp_path):
    """One ``model.safetensors``, no index: the file is named."""
    src = bases["flash"]
    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    tensors.pop("mtp.0.h_proj.scale")
    d = tmp_path / "single"
    d.mkdir()
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(src / "config.json", d / "config.json")
    msg = error(d)
    assert "'mtp.0.h_proj.scale'" in msg and "model.safetensors" in msg, msg


def test_unexpected_tensor(ckpt):
    name = "layers.1.attn.wq_a.weight"
    f = edit(ckpt, name, lambda t: t.update({"layers.1.attn.extra_proj.weight": torch.zeros(4, 4, dtype=torch.bfloat16)}))
    msg = error(ckpt)
    assert "'layers.1.attn.extra_proj.weight'" in msg and f in msg and "unexpected" in msg, msg


def test_tensor_the_index_does_not_list(ckpt):
    name = "layers.1.attn.wq_a.weight"
    f = edit(ckpt, name, lambda t: t.update({"layers.1.attn.extra_proj.weight": torch.zeros(4, 4, dtype=torch.bfloat16)}),
             index=False)
    msg = error(ckpt)
    assert "'layers.1.attn.extra_proj.weight'" in msg and f in msg, msg


@pytest.mark.parametrize("name, shape, dtype", [
    ("layers.2.attn_norm.weight", (255,), torch.bfloat16),  # BF16
    ("layers.1.attn.wq_b.weight", (128, 95), torch.float8_e4m3fn),  # FP8 (its scale grid still fits)
    ("layers.1.attn.wq_a.scale", (1, 3), torch.float8_e8m0fnu),  # an FP8 block scale's grid
    ("layers.2.ffn.experts.4.w1.weight", (96, 127), torch.int8),  # MXFP4 bytes
    ("layers.0.ffn.gate.tid2eid", (300, 3), torch.int64),
])
def test_wrong_shape(ckpt, name, shape, dtype):
    f = edit(ckpt, name, lambda t: t.update({name: torch.zeros(shape).to(dtype)}))
    msg = error(ckpt)
    assert repr(name) in msg and f in msg and str(list(shape)) in msg, msg


def test_bf16_where_fp8_belongs(ckpt):
    """A dequantised BF16 weight without its scale (what a naive re-save writes) is refused, not read."""
    name, scale = "layers.1.attn.wo_b.weight", "layers.1.attn.wo_b.scale"

    def to_bf16(t):
        q, s = t[name], t.pop(scale)
        t[name] = (q.float() * s.float().repeat_interleave(128, 0)[: q.shape[0]].repeat_interleave(128, 1)[:, : q.shape[1]]).bfloat16()

    f = edit(ckpt, name, to_bf16)
    msg = error(ckpt)
    assert "layers.1.attn.wo_b." in msg and (f in msg or INDEX in msg), msg


def test_bf16_where_fp8_belongs_scale_kept(ckpt):
    name = "layers.2.attn.wkv.weight"
    f = edit(ckpt, name, lambda t: t.update({name: t[name].float().bfloat16()}))
    msg = error(ckpt)
    assert repr(name) in msg and f in msg and "BF16" in msg, msg


@pytest.mark.parametrize("variant, name, dtype", [
    ("flash", "layers.1.ffn.experts.3.w1.scale", torch.float32),  # MXFP4 scales are E8M0
    ("flash-base", "layers.2.ffn.experts.6.w2.scale", torch.float8_e8m0fnu),  # Flash-Base: F32 like the rest
])
def test_expert_scale_of_wrong_dtype(bases, tmp_path, variant, name, dtype):
    path = Path(shutil.copytree(bases[variant], tmp_path / variant))
    f = edit(path, name, lambda t: t.update({name: t[name].float().to(dtype)}))
    msg = error(path)
    assert repr(name) in msg and f in msg, msg


def test_expert_weight_of_wrong_dtype(ckpt):
    """An MXFP4 expert stored as FP8 (Flash-Base's experts in a Flash checkpoint)."""
    name = "layers.3.ffn.experts.0.w3.weight"
    f = edit(ckpt, name, lambda t: t.update({name: t[name].view(torch.float8_e4m3fn)}))
    msg = error(ckpt)
    assert repr(name) in msg and f in msg, msg


# ----------------------------------------------------------------------------------------- config
def test_config_with_more_layers_than_the_weights(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    edit_config(ckpt, num_hidden_layers=5, compress_ratios=cfg["compress_ratios"][:4] + [128, 0])
    msg = error(ckpt)
    assert "'layers.4." in msg and INDEX in msg, msg


def test_config_with_fewer_layers_than_the_weights(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    edit_config(ckpt, num_hidden_layers=3, compress_ratios=cfg["compress_ratios"][:3] + [0])
    msg = error(ckpt)
    assert "'layers.3." in msg and shard_of(ckpt, "layers.3.attn_norm.weight") in msg and "unexpected" in msg, msg


def test_config_with_other_dims_than_the_weights(ckpt):
    edit_config(ckpt, moe_intermediate_size=64)
    msg = error(ckpt)
    assert "ffn.experts." in msg or "shared_experts" in msg, msg
    assert ".safetensors" in msg, msg


@pytest.mark.parametrize("change, shown", [
    ({"weight_block_size": [64, 64]}, "[64, 64]"),
    ({"quant_method": "awq"}, "awq"),
    ({"fmt": "e5m2"}, "e5m2"),
])
def test_unsupported_quantization_config(ckpt, change, shown):
    cfg = json.loads((ckpt / "config.json").read_text())
    edit_config(ckpt, quantization_config={**cfg["quantization_config"], **change})
    msg = error(ckpt)
    assert str(ckpt / "config.json") in msg and shown in msg and "quantization_config" in msg, msg


def test_unsupported_expert_dtype(ckpt):
    edit_config(ckpt, expert_dtype="int4")
    msg = error(ckpt)
    assert str(ckpt / "config.json") in msg and "int4" in msg, msg


def test_shard_named_by_the_index_but_missing(ckpt):
    name = "layers.2.attn.wq_a.weight"
    f = shard_of(ckpt, name)
    (ckpt / f).unlink()
    msg = error(ckpt)
    assert f in msg and "missing" in msg, msg
    held = [k for k, v in json.loads((ckpt / INDEX).read_text())["weight_map"].items() if v == f]
    assert any(repr(k) in msg or k in msg for k in held), msg  # names a tensor it should hold


def test_not_deepseek_v4(ckpt):
    edit_config(ckpt, model_type="llama")
    msg = error(ckpt)
    assert "llama" in msg and "config.json" in msg, msg


# ------------------------------------------------------------------------------------- check_args
@pytest.fixture(scope="module")
def reader(bases):
    with CheckpointReader(bases["flash"]) as r:
        yield r


def test_check_args_contradiction_names_both_values(reader):
    with pytest.raises(CheckpointError) as e:
        check_args(reader, ModelArgs(hidden_size=128))
    msg = str(e.value)
    assert "hidden_size" in msg and "128" in msg and "256" in msg and "config.json" in msg, msg

    with pytest.raises(CheckpointError, match="n_routed_experts"):
        check_args(reader, ModelArgs(n_routed_experts=16, num_experts_per_tok=2))
    with pytest.raises(CheckpointError, match="layer_types"):
        check_args(reader, ModelArgs(num_layers=4, layer_types=["sliding_attention"] * 4))


def test_check_args_contradiction_from_yaml(reader, bases):
    import yaml

    args = ModelArgs(**yaml.safe_load("hidden_size: 128\nmtp_loss_weight: 0.5\n"))
    with pytest.raises(CheckpointError, match="hidden_size=128"):
        check_args(reader, args)
    with pytest.raises(CheckpointError, match="hidden_size"):
        load_model(bases["flash"], args)


def test_check_args_unset_and_training_only_fields_pass(reader, bases):
    assert check_args(reader, ModelArgs()) == reader.args  # nothing set: the checkpoint's architecture
    # the same values as the checkpoint, set explicitly, pass
    same = ModelArgs(hidden_size=reader.args.hidden_size, num_layers=reader.args.num_layers,
                     layer_types=reader.args.attention_types)
    assert check_args(reader, same) == reader.args
    # training-only fields come from the run's config, the architecture from the checkpoint
    given = ModelArgs(mtp_loss_weight=0.7, max_seq_len=512, bias_update_rate=0.01)
    got = check_args(reader, given)
    assert (got.mtp_loss_weight, got.max_seq_len, got.bias_update_rate) == (0.7, 512, 0.01)
    assert got.model_dump(exclude={"mtp_loss_weight", "max_seq_len", "bias_update_rate"}) == \
        reader.args.model_dump(exclude={"mtp_loss_weight", "max_seq_len", "bias_update_rate"})
    assert got.hidden_size == 256 != ModelArgs().hidden_size
    model = load_model(bases["flash"], given)
    assert model.cfg.mtp_loss_weight == 0.7 and model.cfg.hidden_size == 256
