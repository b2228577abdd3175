"""``trainer.hub.convert`` / ``trainer.export`` end to end on the tiny published-layout fixtures.

Exactness (re-export without training gives back the published bytes, through ``convert`` and through the
native model), transformers parity of the ``hf`` target, a trained-like model's FP8 / MXFP4 export bounded by
the quantisation error, sliced reads, DCP sources, sharding and the atomic publish."""

from __future__ import annotations

import copy
import importlib.util
import json
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from trainer.export import export, export_checkpoint
from trainer.hub.convert import convert
from trainer.hub.fixture import write_hub_checkpoint
from trainer.hub.names import hub_kind, hub_source
from trainer.hub.placement import fp8_placement_problems
from trainer.hub.reader import BF16, FLASH, SCHEMES, CheckpointReader, load_model

VARIANTS = ("flash", "flash-base")
V = 300


# ----------------------------------------------------------------------------------------- helpers
def read_all(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of every shard of ``path``; a name in two shards fails."""
    out: dict[str, torch.Tensor] = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        for name, t in load_file(str(f)).items():
            assert name not in out, f"{name} twice"
            out[name] = t
    return out


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality: dtype, shape and raw bytes."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def assert_same_tensors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want), (sorted(set(got) ^ set(want)))[:10]
    differ = [k for k in want if not same(got[k], want[k])]
    assert differ == [], f"{len(differ)} tensors differ, e.g. {differ[:5]}"


def config(path: Path, drop=("trex_provenance",)) -> dict:
    cfg = json.loads((Path(path) / "config.json").read_text())
    for k in drop:
        cfg.pop(k, None)
    return cfg


def ids(b: int = 2, t: int = 150) -> torch.Tensor:  # t > 128: the HCA layer compresses a whole block
    return torch.randint(0, V, (b, t), generator=torch.Generator().manual_seed(3))


def logits(model, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(x).float()


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny tensors: one intra-op thread (spinning OpenMP workers cost far more than they bring when other
    processes share the cores)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def accelerate_or_stub():
    """transformers' FP8 quantizer refuses to load without accelerate even when it only dequantises on the
    CPU (which uses none of it): stub the availability check where the package is not installed."""
    import transformers.quantizers.quantizer_finegrained_fp8 as qf

    with pytest.MonkeyPatch.context() as mp:
        if importlib.util.find_spec("accelerate") is None:
            mp.setattr(qf, "is_accelerate_available", lambda: True)
        yield


@pytest.fixture(scope="module")
def hub_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hub")
    return {v: write_hub_checkpoint(root / v, v) for v in VARIANTS}


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("no_tokenizer")  # export() copies what is there: nothing


# -------------------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("variant", VARIANTS)
def test_hub_fp8_reexport_is_bitwise(hub_dirs, tok_dir, tmp_path, variant):
    src = hub_dirs[variant]
    want = read_all(src)

    summary = convert(src, tmp_path / "conv", "hub-fp8")
    assert (summary["source_format"], summary["target"], summary["scheme"]) == ("hub", "hub-fp8", variant)
    assert summary["tensors"] == len(want)
    assert_same_tensors(read_all(tmp_path / "conv"), want)  # scales included
    assert config(tmp_path / "conv") == config(src)  # the published config kept as is
    assert json.loads((tmp_path / "conv" / "config.json").read_text())["trex_provenance"]["source_format"] == "hub"

    # hub -> native (fp32) -> hub-fp8: the canonical re-quantisation gives back the same bytes
    model = load_model(src)
    export(model, tok_dir, tmp_path / "exp", to="hub-fp8", scheme=SCHEMES[variant], source_config=config(src))
    assert_same_tensors(read_all(tmp_path / "exp"), want)
    assert config(tmp_path / "exp") == config(src)
    # ... in the published shards: the same index (weight map and total size)
    index = lambda p: json.loads((p / "model.safetensors.index.json").read_text())
    assert index(tmp_path / "conv") == index(src) == index(tmp_path / "exp")


@pytest.mark.parametrize("variant", VARIANTS)
def test_hub_bf16_reexport_is_bitwise(hub_dirs, tok_dir, tmp_path, variant):
    src = hub_dirs[variant]
    b1 = tmp_path / "b1"
    convert(src, b1, "hub-bf16")
    t1 = read_all(b1)
    assert not any(k.endswith(".scale") for k in t1)
    assert {t.dtype for t in t1.values()} == {torch.bfloat16, torch.float32, torch.int64}
    cfg1 = config(b1)
    assert "quantization_config" not in cfg1 and "expert_dtype" not in cfg1
    assert cfg1 == {k: v for k, v in config(src).items() if k not in ("quantization_config", "expert_dtype")}
    # FP8 / MXFP4 codes times power-of-two scales fit BF16 exactly: the BF16 form holds the same numbers
    with CheckpointReader(src) as a, CheckpointReader(b1) as b:
        assert b.scheme == BF16
        sa, sb = a.state_dict(), b.state_dict()
    assert [k for k in sa if not torch.equal(sa[k], sb[k])] == []

    convert(b1, tmp_path / "b2", "hub-bf16")
    assert_same_tensors(read_all(tmp_path / "b2"), t1)
    assert config(tmp_path / "b2") == cfg1

    export(load_model(b1), tok_dir, tmp_path / "b3", to="hub-bf16", scheme=BF16, source_config=config(b1))
    assert_same_tensors(read_all(tmp_path / "b3"), t1)
    assert config(tmp_path / "b3") == cfg1

    # and back: hub-fp8 of the BF16 form is the published checkpoint again, byte for byte
    convert(b1, tmp_path / "q", "hub-fp8", scheme=variant, source_config=config(src))
    assert_same_tensors(read_all(tmp_path / "q"), read_all(src))
    assert config(tmp_path / "q") == config(src)


def test_export_hub_bf16_needs_no_scheme(hub_dirs, tok_dir, tmp_path):
    """hub-bf16 stores no quantisation, so ``export(..., to="hub-bf16")`` needs no scheme (``convert`` does
    not ask for one either) and writes what it writes with any scheme."""
    model = load_model(hub_dirs["flash"])
    export(model, tok_dir, tmp_path / "with", to="hub-bf16", scheme=BF16)
    export(model, tok_dir, tmp_path / "without", to="hub-bf16")
    assert_same_tensors(read_all(tmp_path / "without"), read_all(tmp_path / "with"))


# ------------------------------------------------------------------------------ hf: transformers
def test_hf_export_matches_native_logits(hub_dirs, tok_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    native = load_model(hub_dirs["flash"])
    out = export(native, tok_dir, tmp_path / "hf", to="hf")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DeepseekV4ForCausalLM"] and "trex_model_config" in cfg
    # every native tensor (MTP included) comes back as it was
    with CheckpointReader(out) as r:
        assert r.format == "trex"
        back = r.state_dict()
    mine = native.state_dict()
    assert back.keys() == mine.keys() and [k for k in mine if not torch.equal(back[k], mine[k])] == []

    hf, info = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    x = ids()
    with torch.no_grad():
        theirs = hf.eval()(input_ids=x).logits.float()
    ours = logits(native, x)
    assert ours.std() > 0.3  # not degenerate
    assert (theirs - ours).abs().max().item() <= 1e-5


# ---------------------------------------------------------------- a trained-like model's FP8 export
def _perturbed(model, seed: int, scale_of) -> None:
    """Add Gaussian noise of std ``scale_of(name, t)`` to every float tensor of ``model``'s state (not to a
    hash layer's expert bias, which the published layout does not store: always zero)."""
    g = torch.Generator().manual_seed(seed)
    hash_layers = {i for i, k in enumerate(model.cfg.moe_types) if k == "hash_moe"}
    with torch.no_grad():
        for name, t in model.state_dict().items():
            m = re.match(r"layers\.(\d+)\.ffn\.expert_bias$", name)
            if not t.is_floating_point() or (m and int(m.group(1)) in hash_layers):
                continue
            s = scale_of(name, t)
            t.add_(torch.randn(t.shape, generator=g) * s)


@pytest.fixture(scope="module")
def trained_export(hub_dirs, tok_dir, tmp_path_factory):
    """A trained-like native model (the fixture plus noise of 10% of each tensor's RMS, off every FP8 /
    MXFP4 grid) and its hub-fp8 (V4-Flash) export."""
    model = load_model(hub_dirs["flash"])
    _perturbed(model, 11, lambda n, t: 0.1 * t.pow(2).mean().sqrt().item() + 1e-3)
    out = export(model, tok_dir, tmp_path_factory.mktemp("trained") / "fp8", to="hub-fp8", scheme=FLASH,
                 source_config=config(hub_dirs["flash"]))
    return model, out


def test_trained_export_error_is_the_quantisation_error(trained_export, tok_dir, accelerate_or_stub):
    from transformers import AutoModelForCausalLM

    model, out = trained_export
    with CheckpointReader(out) as r:
        assert r.scheme == FLASH
        headers = r.headers
    back = load_model(out)
    want, got = model.state_dict(), back.state_dict()
    assert want.keys() == got.keys()

    # 1. each weight within its format's rounding bound (per element): BF16 u = 2^-8; FP8 e4m3 u = 2^-4 plus
    # half a subnormal step 2^-10 s of its power-of-two block scale s <= 2 amax / 448; MXFP4 (E2M1 grid
    # spacing 0.5 / 1 / 2 on [0, 2] / [2, 4] / [4, 6]) |err| <= max(|w| / 4, s / 4), s <= 2 amax / 6
    kinds = {}
    for key, w in want.items():
        src = hub_source(key, model.cfg)
        if src.kind == "zero":
            assert torch.equal(got[key], torch.zeros_like(w)), key
            continue
        kind = hub_kind(src.names[0])
        dtype = headers[src.names[0]]["dtype"]
        err = (got[key] - w).abs() if w.is_floating_point() else None
        amax = w.abs().max().item() if w.is_floating_point() else 0.0
        if dtype in ("F32", "I64"):
            assert torch.equal(got[key], w), key
            continue
        if dtype == "BF16":
            bound = 2 ** -8 * w.abs()
        elif dtype == "F8_E4M3":
            assert kind == "fp8", key
            bound = 2 ** -4 * w.abs() + 2 ** -10 * 2 * amax / 448
        else:
            assert (kind, dtype) == ("expert", "I8"), key
            bound = 0.25 * w.abs() + 0.25 * 2 * amax / 6
        assert (err <= bound * (1 + 1e-6)).all(), (key, dtype, (err - bound).max().item())
        kinds.setdefault(dtype, []).append(err.max().item())
    assert set(kinds) == {"BF16", "F8_E4M3", "I8"}
    assert all(max(v) > 0 for v in kinds.values())  # the noise is off the grids: the export did round

    # 2. transformers reads the export as T-Rex does (both dequantise the same bytes)
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    x = ids()
    with torch.no_grad():
        theirs = hf(input_ids=x).logits.float()
    exported = logits(back, x)
    assert (theirs - exported).abs().max().item() <= 1e-4

    # 3. against the fp32 model: the logits move by what the rounding explains. Reference: the same model
    # with Gaussian noise of each tensor's own rounding-error RMS in a random direction (rounding to nearest
    # acts as such noise, to first order); the export must move the logits by no more than that does (the
    # two agree within ~20% here: max 2.1 vs 2.5, mean 0.156 vs 0.159; MXFP4's ~10% error dominates)
    fp32 = logits(model, x)
    rms = {k: (got[k] - want[k]).pow(2).mean().sqrt().item() for k in want if want[k].is_floating_point()}
    ref_model = copy.deepcopy(model)
    _perturbed(ref_model, 12, lambda n, t: rms[n])
    noisy = logits(ref_model, x)
    d_quant, d_noise = (exported - fp32).abs(), (noisy - fp32).abs()
    assert 0 < d_quant.max().item() <= 2 * d_noise.max().item(), (d_quant.max().item(), d_noise.max().item())
    assert d_quant.mean().item() <= 1.5 * d_noise.mean().item(), (d_quant.mean().item(), d_noise.mean().item())
    lp = lambda z: z.log_softmax(-1)[:, :-1].gather(-1, x[:, 1:, None])  # log p of the observed next tokens
    lp_quant, lp_noise = (lp(exported) - lp(fp32)).abs().mean().item(), (lp(noisy) - lp(fp32)).abs().mean().item()
    assert lp_quant <= 1.5 * lp_noise, (lp_quant, lp_noise)
    # and an export without the FP8 / MXFP4 rounding (hub-bf16, u = 2^-8) moves them far less (0.10 x here)
    bf16 = logits(load_model(export(model, tok_dir, out.parent / "bf16", to="hub-bf16", scheme=BF16)), x)
    assert (bf16 - fp32).abs().mean().item() < 0.25 * d_quant.mean().item()


def test_trained_export_places_every_quantised_tensor(trained_export):
    """transformers' FP8 loading path (a GPU's) places every tensor of the export as published."""
    _, out = trained_export
    assert fp8_placement_problems(out) == []


# ---------------------------------------------------------------------------------------- slicing
def _slices(shape, g: torch.Generator) -> list[tuple[slice, ...]]:
    def rand(n):
        a = int(torch.randint(0, n, (1,), generator=g))
        b = int(torch.randint(a + 1, n + 1, (1,), generator=g))
        return slice(a, b)

    def crossing(n, block):  # a range crossing block boundaries, starting and ending mid-block
        if n > block + 8:
            return slice(block - 5 - (block // 4), min(n, 2 * block - 3) if n >= 2 * block else n - 3)
        return rand(n)

    out = [tuple(rand(n) for n in shape) for _ in range(3)]
    out.append(tuple(crossing(n, 128) for n in shape))  # FP8 128 x 128 blocks
    out.append(tuple(crossing(n, 32) for n in shape))  # MXFP4 32-groups (and the eh_proj / wo_a seams)
    out.append(tuple(slice(1, n - 1) if n > 2 else slice(0, n) for n in shape))
    out.append(tuple(slice(max(0, n // 2 - 7), min(n, n // 2 + 9)) for n in shape))  # eh_proj's e | h seam
    return out


def _check_slices(reader: CheckpointReader, seed: int) -> set[str]:
    g = torch.Generator().manual_seed(seed)
    seen = set()
    for key in reader.native_keys():
        before = reader.bytes_read
        full = reader.read(key)
        full_bytes = reader.bytes_read - before
        shape = tuple(full.shape)
        seen.add(reader.sources[key].kind)
        for idx in _slices(shape, g):
            part = reader.read(key, idx)
            assert part.dtype == full.dtype and torch.equal(part, full[idx]), (key, idx)
        if full_bytes == 0:  # a hash layer's expert bias: no file tensor
            continue
        # half of the tensor along its longest dimension reads fewer bytes than all of it
        d = max(range(len(shape)), key=lambda i: shape[i])
        if shape[d] < 2:
            continue
        half = tuple(slice(0, shape[d] // 2) if i == d else slice(None) for i in range(len(shape)))
        before = reader.bytes_read
        part = reader.read(key, half)
        assert torch.equal(part, full[half]), key
        assert reader.bytes_read - before < full_bytes, (key, reader.bytes_read - before, full_bytes)
        if full_bytes > 4096:
            assert reader.bytes_read - before <= 0.6 * full_bytes, key
    return seen


@pytest.mark.parametrize("variant", VARIANTS)
def test_slice_reads_equal_full_reads(hub_dirs, variant):
    with CheckpointReader(hub_dirs[variant]) as r:
        assert r.args.hidden_size >= 256
        kinds = _check_slices(r, seed=1)
        assert kinds == {"rename", "experts", "wo_a", "eh_proj", "zero"}
        with pytest.raises(ValueError, match="contiguous"):
            r.read("layers.1.attn.wq_a.weight", (slice(0, 96, 2),))
        # a slice of an FP8 weight reads only the blocks of its scale it needs, not the full tensor
        before = r.bytes_read
        t = r.read("mtp.0.eh_proj.weight", (slice(130, 140), slice(250, 260)))  # e_proj | h_proj seam
        scale_bytes = 1 if variant == "flash" else 4  # E8M0 / F32
        assert r.bytes_read - before == 10 * 10 + 2 * scale_bytes  # the codes + one scale from each half
        assert t.shape == (10, 10)


def test_slice_reads_equal_full_reads_hf(hub_dirs, tmp_path):
    """transformers' layout: fused gate_up / down experts, o_a_proj."""
    convert(hub_dirs["flash"], tmp_path / "hf", "hf")
    with CheckpointReader(tmp_path / "hf") as r:
        kinds = _check_slices(r, seed=2)
    assert kinds == {"rename", "fused_gate", "fused_up", "fused_down", "wo_a", "zero"}


# -------------------------------------------------------------------------------------------- DCP
def test_dcp_checkpoint_converts_like_the_model_exports(hub_dirs, tok_dir, tmp_path):
    from trainer.checkpoint import save
    from trainer.hub.dcp_source import write_model_card
    from trainer.models.deepseek_v4.model import Transformer

    with CheckpointReader(hub_dirs["flash"]) as r:
        args, vocab = r.args, r.vocab_size
    model = Transformer(args, vocab)
    model.init_weights(5)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.forward_train(ids(1, 40))[0].float().pow(2).mean().backward()
    opt.step()
    with torch.no_grad():  # routing biases as training leaves them (a hash layer's stays zero)
        g = torch.Generator().manual_seed(9)
        for i, kind in enumerate(args.moe_types):
            if kind != "hash_moe":
                model.layers[i].ffn.expert_bias.copy_(torch.randn(args.n_routed_experts, generator=g) * 0.1)
    model.eval()
    ckpts = tmp_path / "checkpoints"
    step = save(ckpts, 3, model, opt, {"tokens": 1})
    write_model_card(ckpts, model.cfg, vocab)

    s = convert(ckpts, tmp_path / "dcp_bf16", "hub-bf16")
    assert s["source_format"] == "dcp"
    export(model, tok_dir, tmp_path / "exp_bf16", to="hub-bf16", scheme=BF16)
    assert_same_tensors(read_all(tmp_path / "dcp_bf16"), read_all(tmp_path / "exp_bf16"))
    export_checkpoint(ckpts, tok_dir, tmp_path / "offline_bf16", to="hub-bf16", scheme=BF16)
    assert_same_tensors(read_all(tmp_path / "offline_bf16"), read_all(tmp_path / "exp_bf16"))

    convert(step, tmp_path / "dcp_fp8", "hub-fp8", scheme="flash")  # a step directory, the card in its parent
    export(model, tok_dir, tmp_path / "exp_fp8", to="hub-fp8", scheme=FLASH)
    assert_same_tensors(read_all(tmp_path / "dcp_fp8"), read_all(tmp_path / "exp_fp8"))

    convert(ckpts, tmp_path / "dcp_hf", "hf")
    with CheckpointReader(tmp_path / "dcp_hf") as r:
        assert r.format == "trex" and r.args == model.cfg
        back = r.state_dict()
    want = model.state_dict()
    assert back.keys() == want.keys()
    assert [k for k in want if not (back[k].dtype == want[k].dtype and torch.equal(back[k], want[k]))] == []


# --------------------------------------------------------------------------------------- sharding
def _shard_tensors(path: Path) -> dict[str, dict[str, int]]:
    """{shard file: {tensor: bytes}}."""
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            out[f.name] = {k: h.get_tensor(k).numel() * h.get_tensor(k).element_size() for k in h.keys()}  # noqa: SIM118
    return out


@pytest.mark.parametrize("to", ["hub-fp8", "hf"])
def test_small_shards_and_index(hub_dirs, tmp_path, to):
    limit = 100_000  # the embedding and the head (300 x 256 BF16 / F32) are bigger: shards of their own
    out = tmp_path / "sharded"
    s = convert(hub_dirs["flash"], out, to, max_shard_bytes=limit)
    shards = _shard_tensors(out)
    n = len(shards)
    assert n > 5 and s["shards"] == n
    assert sorted(shards) == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert not (out / "model.safetensors").exists()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    where = [(k, f) for f, ts in shards.items() for k in ts]
    assert len(where) == len({k for k, _ in where})  # every tensor in exactly one shard
    assert index["weight_map"] == dict(where)  # ... and the index says which
    assert index["metadata"]["total_size"] == sum(b for ts in shards.values() for b in ts.values())
    big = 0
    for f, ts in shards.items():
        size = sum(ts.values())
        assert size <= limit or len(ts) == 1, (f, size, list(ts))
        big += size > limit
    assert big >= 2  # the one-tensor exception was exercised (embed, head)
    # the same checkpoint as one shard
    convert(hub_dirs["flash"], tmp_path / "single", to)
    assert_same_tensors(read_all(out), read_all(tmp_path / "single"))
    assert config(out) == config(tmp_path / "single")
    if to == "hub-fp8":
        assert fp8_placement_problems(out) == []
    else:
        from transformers import AutoModelForCausalLM

        _, info = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info


# ------------------------------------------------------------------------------------- atomicity
def _snapshot(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def test_convert_replaces_dst_and_cleans_leftovers(hub_dirs, tmp_path, monkeypatch):
    import trainer.hub.convert as conv

    src, dst = hub_dirs["flash"], tmp_path / "out"
    convert(src, dst, "hub-fp8", max_shard_bytes=100_000)  # an older conversion: many shards + index
    (dst / "notes.txt").write_text("stale")
    leftover = tmp_path / ".out.partial"  # a killed conversion's staging directory
    leftover.mkdir()
    (leftover / "model-00001-of-00002.safetensors").write_bytes(b"torn")

    convert(src, dst, "hf")
    assert sorted(p.name for p in dst.iterdir()) == ["config.json", "model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no .partial / .previous left
    with CheckpointReader(dst) as r:
        assert r.format == "trex"
    before = _snapshot(dst)

    # a conversion that fails after writing its weights leaves the published directory untouched
    def boom(*a, **k):
        raise RuntimeError("killed")

    monkeypatch.setattr(conv, "copy_tokenizer", boom)
    with pytest.raises(RuntimeError, match="killed"):
        convert(src, dst, "hub-bf16", tokenizer_dir=src)
    assert _snapshot(dst) == before
    monkeypatch.undo()
    convert(src, dst, "hub-bf16")  # the next one clears the leftover
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    with CheckpointReader(dst) as r:
        assert r.format == "hub" and r.scheme == BF16


def test_unchanged_tensors_keep_a_non_canonical_published_encoding(tmp_path):
    """Two encodings can hold the same values (scale s with largest code 448, or 2s with 224). Whatever the
    published quantiser chose, re-exporting unchanged weights reproduces the published bytes: the reference
    checkpoint's own codes and scales are kept where the values did not change."""
    from safetensors.torch import save_file

    from trainer.hub.convert import convert
    from trainer.hub.quant import E8M0, FP8, quant_fp8

    hub = write_hub_checkpoint(tmp_path / "hub", "flash", seed=11)
    index = json.loads((hub / "model.safetensors.index.json").read_text())["weight_map"]
    name = "layers.1.attn.wq_a.weight"
    shard = hub / index[name]
    tensors = load_file(str(shard))
    q = tensors[name].float()
    q[:] = 0.0
    q[0, 0], q[1, 1], q[2, 3] = 448.0, -64.0, 2.0  # every code halves exactly: also exact at twice the scale
    tensors[name] = q.to(FP8)
    scale = tensors[name[:-6] + "scale"].float()
    scale[:] = 2.0 ** -12
    tensors[name[:-6] + "scale"] = scale.to(E8M0)
    save_file(tensors, str(shard), metadata={"format": "pt"})
    canon_q, canon_s = quant_fp8(q * 2.0 ** -12)
    assert canon_s.float()[0, 0].item() == 2.0 ** -11  # the canonical form would differ from these bytes
    for out in ("conv", "export"):
        if out == "conv":
            convert(hub, tmp_path / out, "hub-fp8")
        else:
            with CheckpointReader(hub) as ref:
                export(load_model(hub), hub, tmp_path / out, to="hub-fp8", scheme=ref.scheme,
                       source_config=ref.config, reference=ref)
        got = load_file(str(tmp_path / out / index[name]))
        assert torch.equal(got[name].view(torch.uint8), tensors[name].view(torch.uint8)), out
        assert torch.equal(got[name[:-6] + "scale"].view(torch.uint8),
                           tensors[name[:-6] + "scale"].view(torch.uint8)), out
