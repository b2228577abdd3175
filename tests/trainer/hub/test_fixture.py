"""The tiny published-layout checkpoints of ``trainer.hub.fixture``: the layout (against a table written
from the published format), transformers' loading (CPU: dequantised; and the FP8 path a GPU takes, whose
placement checks catch what the lenient CPU path accepts), transformers' dequantisation against the formulas,
and T-Rex's load of the same directory against transformers."""

from __future__ import annotations

import importlib.util
import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from trainer.hub.fixture import hub_config, published_flash_config, write_hub_checkpoint
from trainer.hub.placement import fp8_placement_problems

VARIANTS = ("flash", "flash-base")
BF16, F32, I64, I8, F8, E8M0 = (torch.bfloat16, torch.float32, torch.int64, torch.int8, torch.float8_e4m3fn,
                                torch.float8_e8m0fnu)
V, D, LAYERS = 300, 256, 4
RATIOS = [0, 4, 128, 4]


# ------------------------------------------------------------------------------- the expected table
def expected_layout(variant: str) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """Every tensor of the tiny default checkpoint, written out from the published format
    (/work/shared/reference/deepseek-v4-checkpoint-format.md section 1) for D=256, V=300, H=2 heads of
    hd=64, q_lora=96, o_groups=2 x o_rank=48, E=8 experts of I=96, top-2, hc_mult=4, indexer 2 x 32."""
    s = E8M0 if variant == "flash" else F32  # FP8 block-scale dtype
    hc = lambda p: {f"{p}hc_{k}_fn": (F32, (24, 1024)) for k in ("attn", "ffn")} | \
        {f"{p}hc_{k}_base": (F32, (24,)) for k in ("attn", "ffn")} | {f"{p}hc_{k}_scale": (F32, (3,)) for k in ("attn", "ffn")}
    head = lambda p: {f"{p}hc_head_fn": (F32, (4, 1024)), f"{p}hc_head_base": (F32, (4,)),
                      f"{p}hc_head_scale": (F32, (1,))}

    def block(p: str, ratio: int, hash_moe: bool) -> dict:
        t = {**hc(p), f"{p}attn_norm.weight": (BF16, (256,)), f"{p}ffn_norm.weight": (BF16, (256,)),
             f"{p}attn.wq_a.weight": (F8, (96, 256)), f"{p}attn.wq_a.scale": (s, (1, 2)),
             f"{p}attn.q_norm.weight": (BF16, (96,)),
             f"{p}attn.wq_b.weight": (F8, (128, 96)), f"{p}attn.wq_b.scale": (s, (1, 1)),
             f"{p}attn.wkv.weight": (F8, (64, 256)), f"{p}attn.wkv.scale": (s, (1, 2)),
             f"{p}attn.kv_norm.weight": (BF16, (64,)),
             f"{p}attn.wo_a.weight": (F8, (96, 64)), f"{p}attn.wo_a.scale": (s, (1, 1)),
             f"{p}attn.wo_b.weight": (F8, (256, 96)), f"{p}attn.wo_b.scale": (s, (2, 1)),
             f"{p}attn.attn_sink": (F32, (2,)),
             f"{p}ffn.gate.weight": (BF16, (8, 256)),
             f"{p}ffn.shared_experts.w1.weight": (F8, (96, 256)), f"{p}ffn.shared_experts.w1.scale": (s, (1, 2)),
             f"{p}ffn.shared_experts.w3.weight": (F8, (96, 256)), f"{p}ffn.shared_experts.w3.scale": (s, (1, 2)),
             f"{p}ffn.shared_experts.w2.weight": (F8, (256, 96)), f"{p}ffn.shared_experts.w2.scale": (s, (2, 1))}
        t |= {f"{p}ffn.gate.tid2eid": (I64, (300, 2))} if hash_moe else {f"{p}ffn.gate.bias": (F32, (8,))}
        if ratio == 4:  # CSA: overlapping windows (2 hd wide), an indexer
            t |= {f"{p}attn.compressor.wkv.weight": (BF16, (128, 256)), f"{p}attn.compressor.wgate.weight": (BF16, (128, 256)),
                  f"{p}attn.compressor.ape": (F32, (4, 128)), f"{p}attn.compressor.norm.weight": (BF16, (64,)),
                  f"{p}attn.indexer.wq_b.weight": (F8, (64, 96)), f"{p}attn.indexer.wq_b.scale": (s, (1, 1)),
                  f"{p}attn.indexer.weights_proj.weight": (BF16, (2, 256)),
                  f"{p}attn.indexer.compressor.wkv.weight": (BF16, (64, 256)),
                  f"{p}attn.indexer.compressor.wgate.weight": (BF16, (64, 256)),
                  f"{p}attn.indexer.compressor.ape": (F32, (4, 64)),
                  f"{p}attn.indexer.compressor.norm.weight": (BF16, (32,))}
        elif ratio == 128:  # HCA
            t |= {f"{p}attn.compressor.wkv.weight": (BF16, (64, 256)), f"{p}attn.compressor.wgate.weight": (BF16, (64, 256)),
                  f"{p}attn.compressor.ape": (F32, (128, 64)), f"{p}attn.compressor.norm.weight": (BF16, (64,))}
        for j in range(8):
            e = f"{p}ffn.experts.{j}"
            if variant == "flash":  # MXFP4: int8 [out, in/2] + E8M0 [out, in/32]
                t |= {f"{e}.w1.weight": (I8, (96, 128)), f"{e}.w1.scale": (E8M0, (96, 8)),
                      f"{e}.w3.weight": (I8, (96, 128)), f"{e}.w3.scale": (E8M0, (96, 8)),
                      f"{e}.w2.weight": (I8, (256, 48)), f"{e}.w2.scale": (E8M0, (256, 3))}
            else:
                t |= {f"{e}.w1.weight": (F8, (96, 256)), f"{e}.w1.scale": (F32, (1, 2)),
                      f"{e}.w3.weight": (F8, (96, 256)), f"{e}.w3.scale": (F32, (1, 2)),
                      f"{e}.w2.weight": (F8, (256, 96)), f"{e}.w2.scale": (F32, (2, 1))}
        return t

    out = {"embed.weight": (BF16, (300, 256)), "head.weight": (BF16, (300, 256)), "norm.weight": (BF16, (256,)),
           **head("")}
    for i, r in enumerate(RATIOS):
        out |= block(f"layers.{i}.", r, hash_moe=i == 0)
    out |= block("mtp.0.", 0, hash_moe=False)
    out |= {"mtp.0.e_proj.weight": (F8, (256, 256)), "mtp.0.e_proj.scale": (s, (2, 2)),
            "mtp.0.h_proj.weight": (F8, (256, 256)), "mtp.0.h_proj.scale": (s, (2, 2)),
            "mtp.0.enorm.weight": (BF16, (256,)), "mtp.0.hnorm.weight": (BF16, (256,)),
            "mtp.0.norm.weight": (BF16, (256,)), **head("mtp.0.")}
    return out


# ----------------------------------------------------------------------------------------- helpers
def read_all(path: Path) -> dict[str, tuple[torch.Tensor, str]]:
    """Every tensor of every shard (name -> (tensor, file)); a name in two shards fails."""
    out: dict[str, tuple[torch.Tensor, str]] = {}
    for f in sorted(path.glob("*.safetensors")):
        for name, t in load_file(str(f)).items():
            assert name not in out, f"{name} in {out[name][1]} and {f.name}"
            out[name] = (t, f.name)
    return out


def deq_fp8(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """W[i, j] = float(q[i, j]) * s[i // 128, j // 128] (fp32)."""
    r, c = q.shape
    i, j = torch.arange(r)[:, None] // 128, torch.arange(c)[None, :] // 128
    return q.float() * s.float()[i, j]


E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def deq_fp4(packed: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Byte [r, c]: element 2c = low nibble, 2c+1 = high nibble; code = sign bit 3 + E2M1 index; times
    the E8M0 scale of its 32 inputs."""
    b = packed.view(torch.uint8).long()
    codes = torch.stack([b & 0xF, b >> 4], -1).flatten(1)
    vals = E2M1[codes & 7] * torch.where(codes & 8 > 0, -1.0, 1.0)
    return vals * s.float().repeat_interleave(32, 1)


def edit(path: Path, fn) -> None:
    """Rewrite the shards through ``fn(tensors) -> tensors | None`` (None: unchanged), index included."""
    index_file = path / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    for f in sorted(set(index["weight_map"].values())):
        before = load_file(str(path / f))
        after = fn(dict(before))
        if after is None:
            continue
        save_file(after, str(path / f), metadata={"format": "pt"})
        for k in set(before) - set(after):
            del index["weight_map"][k]
        index["weight_map"].update({k: f for k in set(after) - set(before)})
    index_file.write_text(json.dumps(index))


@pytest.fixture(scope="module")
def accelerate_or_stub():
    """transformers' FP8 quantizer refuses to run without accelerate even when it only dequantises (the CPU
    path uses none of it); stub the availability check where the package is not installed."""
    import transformers.quantizers.quantizer_finegrained_fp8 as qf

    with pytest.MonkeyPatch.context() as mp:
        if importlib.util.find_spec("accelerate") is None:
            mp.setattr(qf, "is_accelerate_available", lambda: True)
        yield


@pytest.fixture(scope="module")
def hub_dirs(tmp_path_factory) -> dict[str, Path]:
    return {v: write_hub_checkpoint(tmp_path_factory.mktemp(v), v) for v in VARIANTS}


@pytest.fixture(scope="module")
def hf_models(hub_dirs, accelerate_or_stub):
    """transformers' CPU load of each directory (dequantised, fp32) and its loading info."""
    from transformers import AutoModelForCausalLM

    out = {}
    for v, path in hub_dirs.items():
        model, info = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
        out[v] = (model.eval(), info)
    return out


def _ids(b: int = 2, t: int = 150) -> torch.Tensor:  # t > 128: the HCA layer compresses a block too
    return torch.randint(0, V, (b, t), generator=torch.Generator().manual_seed(3))


# ------------------------------------------------------------------------------------------ layout
@pytest.mark.parametrize("variant", VARIANTS)
def test_layout_is_the_published_one(hub_dirs, variant):
    path = hub_dirs[variant]
    tensors = read_all(path)
    expected = expected_layout(variant)
    assert sorted(tensors) == sorted(expected)
    for name, (t, _) in tensors.items():
        assert (t.dtype, tuple(t.shape)) == expected[name], name

    # the published shard grouping: embed | one layer each | head, norm, hc_head | MTP
    files = sorted(p.name for p in path.glob("*.safetensors"))
    assert files == [f"model-{k:05d}-of-00007.safetensors" for k in range(1, 8)]
    shard_of = {name: int(f[6:11]) for name, (_, f) in tensors.items()}
    assert {shard_of["embed.weight"]} == {1}
    for name, k in shard_of.items():
        m = re.match(r"(layers|mtp)\.(\d+)\.", name)
        want = 1 if name == "embed.weight" else (7 if name.startswith("mtp.") else
                                                 (int(m.group(2)) + 2 if m else 6))
        assert k == want, name

    # the index covers every tensor exactly once, in the file that holds it
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == {name: f for name, (_, f) in tensors.items()}
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t, _ in tensors.values())


@pytest.mark.parametrize("variant", VARIANTS)
def test_config_is_the_published_legacy_form(hub_dirs, variant):
    cfg = json.loads((hub_dirs[variant] / "config.json").read_text())
    published = published_flash_config()
    assert set(cfg) == set(published)  # the same keys as the published config.json, no more, no fewer
    assert cfg["architectures"] == ["DeepseekV4ForCausalLM"] and cfg["model_type"] == "deepseek_v4"
    assert cfg["compress_ratios"] == RATIOS + [0] and cfg["num_hidden_layers"] == LAYERS
    assert cfg["num_hash_layers"] == 1 and cfg["num_nextn_predict_layers"] == 1
    assert cfg["qk_rope_head_dim"] == 16 and cfg["compress_rope_theta"] == 160000
    assert cfg["rope_scaling"]["type"] == "yarn"
    assert cfg["quantization_config"] == {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                          "scale_fmt": "ue8m0", "weight_block_size": [128, 128]}
    assert cfg["expert_dtype"] == ("fp4" if variant == "flash" else "fp8")
    assert cfg["torch_dtype"] == "bfloat16" and (cfg["bos_token_id"], cfg["eos_token_id"]) == (0, 1)
    assert cfg["vocab_size"] == V and cfg["hidden_size"] == D


def test_published_flash_config():
    cfg = published_flash_config()
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["n_routed_experts"], cfg["vocab_size"]) == \
        (4096, 43, 256, 129280)
    assert cfg["compress_ratios"] == [0, 0] + [4, 128] * 20 + [4, 0]  # 43 layers + the MTP block
    assert cfg["expert_dtype"] == "fp4" and cfg["num_hash_layers"] == 3 and cfg["num_nextn_predict_layers"] == 1
    # the published layout of the full config: 284 B parameters (without MTP), 13 B activated
    from trainer.hub.fixture import hub_layout

    full = hub_config("flash", cfg)
    assert full == {**cfg}  # the published config passes through unchanged
    params = sum(math.prod(spec.shape) * (2 if spec.dtype == "I8" else 1)  # I8: two FP4 values a byte
                 for group in hub_layout(full, "flash") for name, spec in group.items()
                 if not name.startswith("mtp.") and not name.endswith(".scale") and spec.dtype != "I64")
    assert 283e9 < params < 285e9, params


@pytest.mark.parametrize("variant", VARIANTS)
def test_quantised_data_is_canonical(hub_dirs, variant):
    tensors = {k: t for k, (t, _) in read_all(hub_dirs[variant]).items()}
    for name, q in tensors.items():
        if not name.endswith(".weight") or q.dtype not in (F8, I8):
            continue
        s = tensors[name.removesuffix(".weight") + ".scale"]
        sf = s.float()
        assert torch.equal(sf, torch.exp2(torch.log2(sf).round())), name  # powers of two (E8M0 or pow2 F32)
        if q.dtype == F8:  # each block's largest |code| in the top binade
            r, c = q.shape
            a = torch.zeros(s.shape[0] * 128, s.shape[1] * 128)
            a[:r, :c] = q.float().abs()
            amax = a.view(s.shape[0], 128, s.shape[1], 128).amax((1, 3))
            assert ((amax >= 224) & (amax <= 448)).all(), name
        else:  # each 32-group's largest E2M1 magnitude is 3, 4 or 6 (amax / s in (3, 6], rounded)
            mags = deq_fp4(q, torch.ones_like(sf)).abs().view(q.shape[0], -1, 32).amax(-1)
            assert set(mags.unique().tolist()) <= {3.0, 4.0, 6.0}, name
    if variant == "flash":  # MXFP4 round to nearest even on the grid, checked on the exact ties
        from trainer.hub.fixture import _quant_fp4

        w = torch.tensor([[0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -5.0, 6.0, -0.25] + [0.0] * 22])
        packed, scale = _quant_fp4(w)
        assert scale.float().item() == 1.0
        assert deq_fp4(packed, scale)[0, :10].tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -4.0, 6.0, 0.0]


def test_float32_amax_scales_and_sharding(tmp_path):
    """``base_scales="amax"``: s = amax/448, so each block's max |code| is 448; ``max_shard_bytes`` cuts the
    groups further, with the same tensors."""
    a = write_hub_checkpoint(tmp_path / "a", "flash-base", base_scales="amax")
    q = read_all(a)["layers.1.attn.wq_a.weight"][0]
    assert q[:, :128].float().abs().max() == 448 and q[:, 128:].float().abs().max() == 448
    limit = 64 << 10
    small = write_hub_checkpoint(tmp_path / "b", "flash", max_shard_bytes=limit)
    ref = write_hub_checkpoint(tmp_path / "c", "flash")
    x, y = read_all(small), read_all(ref)
    assert len({f for _, f in x.values()}) > 7
    assert x.keys() == y.keys() and all(same(x[k][0], y[k][0]) for k in x)  # values independent of sharding
    for f in sorted(small.glob("*.safetensors")):
        shard = load_file(str(f))
        weights = [n for n in shard if not n.endswith(".scale")]
        # a weight and its scale share a shard; a shard over the limit holds one tensor (and its scale)
        assert all(n.removesuffix(".scale") + ".weight" in shard for n in shard if n.endswith(".scale"))
        assert sum(t.numel() * t.element_size() for t in shard.values()) <= limit or len(weights) == 1, f.name


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (FP8/E8M0 compared as bytes)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.element_size() == 1 else torch.equal(a, b)


def test_tokenizer_dir(tmp_path):
    from trainer.tokenizer import train_tokenizer

    texts = [f"minimise {i} x + {i + 1} y subject to x + y >= {i}" for i in range(50)]
    tok = train_tokenizer(texts, tmp_path / "tok", vocab_size=320, min_frequency=1)
    path = write_hub_checkpoint(tmp_path / "ckpt", "flash", tokenizer_dir=tmp_path / "tok")
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["vocab_size"] == tok.get_vocab_size()
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (tok.token_to_id("<|bos|>"), tok.token_to_id("<|eos|>"))
    assert {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"} <= {p.name for p in path.iterdir()}
    t = read_all(path)
    assert t["embed.weight"][0].shape == (cfg["vocab_size"], D) and t["layers.0.ffn.gate.tid2eid"][0].shape[0] == cfg["vocab_size"]


def test_native_model_takes_the_tiny_dims(hub_dirs):
    """The tiny config parses into native ModelArgs, and the native model runs it (finite outputs)."""
    from trainer.models.deepseek_v4.model import Transformer
    from trainer.models.deepseek_v4.state_dict_adapter import model_config_from_hf

    args, vocab = model_config_from_hf(json.loads((hub_dirs["flash"] / "config.json").read_text()))
    assert (vocab, args.attention_types, args.moe_types, args.mtp_layers) == (
        V, ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
            "compressed_sparse_attention"], ["hash_moe", "moe", "moe", "moe"], 1)
    model = Transformer(args, vocab)
    model.init_weights(0)
    with torch.no_grad():
        logits, mtp = model.forward_train(_ids())
    assert torch.isfinite(logits).all() and all(torch.isfinite(m).all() for m in mtp)


# ---------------------------------------------------------------------------------- transformers
@pytest.mark.parametrize("variant", VARIANTS)
def test_transformers_loads_it(hf_models, variant):
    model, info = hf_models[variant]
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert not info["error_msgs"]
    with torch.no_grad():
        logits = model(input_ids=_ids()).logits
    assert torch.isfinite(logits).all()
    assert logits.std() > 0.3  # not degenerate: the log-probs vary


@pytest.mark.parametrize("variant", VARIANTS)
def test_fp8_path_places_every_quantised_tensor(hub_dirs, variant):
    assert fp8_placement_problems(hub_dirs[variant]) == []


@pytest.mark.parametrize("variant", VARIANTS)
def test_fp8_path_catches_misplaced_tensors(hub_dirs, tmp_path, variant, accelerate_or_stub):
    from transformers import AutoModelForCausalLM

    # one FP8 weight written as BF16 without its scale: the CPU path dequantises around it silently ...
    bf16 = Path(shutil.copytree(hub_dirs[variant], tmp_path / "bf16"))

    def as_bf16(t):
        if "layers.1.attn.wo_b.weight" not in t:
            return None
        t["layers.1.attn.wo_b.weight"] = deq_fp8(t["layers.1.attn.wo_b.weight"],
                                                 t.pop("layers.1.attn.wo_b.scale")).bfloat16()
        return t

    edit(bf16, as_bf16)
    _, info = AutoModelForCausalLM.from_pretrained(bf16, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    # ... the FP8 path does not
    problems = fp8_placement_problems(bf16)
    assert "missing: model.layers.1.self_attn.o_b_proj.weight_scale_inv" in problems
    assert any(p.startswith("dtype: layers.1.attn.wo_b.weight is BF16") for p in problems), problems

    # one routed expert's scale missing
    no_scale = Path(shutil.copytree(hub_dirs[variant], tmp_path / "no_scale"))
    edit(no_scale, lambda t: (t.pop("layers.2.ffn.experts.3.w2.scale"), t)[1]
         if "layers.2.ffn.experts.3.w2.scale" in t else None)
    problems = fp8_placement_problems(no_scale)
    assert any(p.startswith("mismatched: model.layers.2.mlp.experts.down_proj_scale_inv") for p in problems), problems

    # a scale beside a BF16 weight (the compressor's): the CPU path multiplies it in, the FP8 path rejects it
    extra = Path(shutil.copytree(hub_dirs[variant], tmp_path / "extra"))
    scale_dtype = E8M0 if variant == "flash" else F32
    edit(extra, lambda t: {**t, "layers.1.attn.compressor.wkv.scale": torch.ones(1, 2).to(scale_dtype)}
         if "layers.1.attn.compressor.wkv.weight" in t else None)
    assert fp8_placement_problems(extra) == ["unexpected: layers.1.self_attn.compressor.kv_proj.weight_scale_inv"]


def test_fp8_path_rounds_float32_scales_to_e8m0(tmp_path):
    """Flash-Base's config says scale_fmt ue8m0: transformers' FP8 path holds its F32 scales as E8M0, so
    only power-of-two F32 scales (the fixture's default) survive; s = amax/448 would be rounded."""
    path = write_hub_checkpoint(tmp_path / "amax", "flash-base", base_scales="amax")
    problems = fp8_placement_problems(path)
    assert problems and all(re.match(r"values: .*\.scale \(F32\) changes when .* casts it to F8_E8M0", p)
                            for p in problems), problems[:5]


@pytest.mark.parametrize("variant", VARIANTS)
def test_transformers_dequantises_by_the_formulas(hub_dirs, hf_models, variant):
    state = hf_models[variant][0].state_dict()
    t = {k: x for k, (x, _) in read_all(hub_dirs[variant]).items()}
    fp8 = lambda n: deq_fp8(t[f"{n}.weight"], t[f"{n}.scale"])
    for hub, hf in [("layers.1.attn.wq_a", "model.layers.1.self_attn.q_a_proj"),  # 2 column blocks
                    ("layers.2.attn.wo_b", "model.layers.2.self_attn.o_b_proj"),  # 2 row blocks
                    ("layers.3.attn.indexer.wq_b", "model.layers.3.self_attn.compressor.indexer.q_b_proj"),
                    ("layers.0.ffn.shared_experts.w2", "model.layers.0.mlp.shared_experts.down_proj")]:
        assert torch.equal(state[f"{hf}.weight"], fp8(hub)), hub
    expert = fp8 if variant == "flash-base" else (lambda n: deq_fp4(t[f"{n}.weight"], t[f"{n}.scale"]))
    for i, j in [(0, 0), (2, 5), (3, 7)]:
        e = f"layers.{i}.ffn.experts.{j}"
        gate_up = state[f"model.layers.{i}.mlp.experts.gate_up_proj"][j]
        assert torch.equal(gate_up, torch.cat([expert(f"{e}.w1"), expert(f"{e}.w3")])), e
        assert torch.equal(state[f"model.layers.{i}.mlp.experts.down_proj"][j], expert(f"{e}.w2")), e


# ------------------------------------------------------------------------------- T-Rex's own load
@pytest.mark.parametrize("variant", VARIANTS)
def test_trex_load_matches_transformers(hub_dirs, hf_models, variant):
    from trainer.hub import load_model
    from trainer.models.deepseek_v4.state_dict_adapter import to_hf

    path = hub_dirs[variant]
    native = load_model(path)
    hf = hf_models[variant][0]
    # the same numbers in every parameter (both dequantise the same bytes in fp32)
    mine = to_hf({k: v for k, v in native.state_dict().items() if not k.startswith("mtp.")}, native.cfg)
    theirs = hf.state_dict()
    assert mine.keys() == theirs.keys()
    assert [k for k in theirs if not torch.equal(mine[k].float(), theirs[k].float())] == []
    # the MTP block, which transformers does not load: eh_proj = [e_proj | h_proj]
    t = {k: x for k, (x, _) in read_all(path).items()}
    eh = torch.cat([deq_fp8(t["mtp.0.e_proj.weight"], t["mtp.0.e_proj.scale"]),
                    deq_fp8(t["mtp.0.h_proj.weight"], t["mtp.0.h_proj.scale"])], dim=1)
    assert torch.equal(native.state_dict()["mtp.0.eh_proj.weight"], eh)
    # per-token log-probs
    ids = _ids()
    with torch.no_grad():
        a = native(ids).log_softmax(-1)[:, :-1].gather(-1, ids[:, 1:, None])
        b = hf(input_ids=ids).logits.log_softmax(-1)[:, :-1].gather(-1, ids[:, 1:, None])
    assert (a - b).abs().max().item() <= 1e-5
