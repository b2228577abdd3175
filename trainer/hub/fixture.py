"""Tiny random DeepSeek-V4 checkpoints in the exact published layout (V4-Flash / V4-Flash-Base).

:func:`write_hub_checkpoint` writes what ``deepseek-ai/DeepSeek-V4-Flash`` (``variant="flash"``) or
``-Flash-Base`` (``"flash-base"``) ship, at any size: the original DeepSeek tensor names (no ``model.``
prefix), every tensor in its published dtype and shape, ``model-000NN-of-000MM.safetensors`` shards with a
``model.safetensors.index.json``, and the published legacy ``config.json`` (``compress_ratios``,
``num_hash_layers``, ``qk_rope_head_dim``, ``rope_scaling``, ``quantization_config``, ``expert_dtype``).

Published tensors (D hidden, H heads, hd head dim, E experts, I expert width, n hc streams, V vocab):

- BF16: ``embed.weight`` [V, D], ``head.weight`` [V, D], ``norm.weight`` and every ``*norm.weight``,
  ``ffn.gate.weight`` [E, D], ``attn.compressor.{wkv,wgate}.weight`` ([2hd, D] at ratio 4, [hd, D] at
  ratio 128), ``attn.indexer.compressor.{wkv,wgate}.weight`` [2 idx_hd, D],
  ``attn.indexer.weights_proj.weight`` [idx_H, D];
- F32: ``hc_{attn,ffn}_{fn [(2+n)n, nD], base [(2+n)n], scale [3]}``, ``hc_head_{fn [n, nD], base [n],
  scale [1]}``, ``attn.attn_sink`` [H], ``attn.compressor.ape`` ([4, 2hd] / [128, hd]),
  ``attn.indexer.compressor.ape`` [4, 2 idx_hd], ``ffn.gate.bias`` [E] (top-k layers);
- I64: ``ffn.gate.tid2eid`` [V, top_k] (the first ``num_hash_layers`` layers, which have no gate bias);
- FP8 e4m3 + ``.scale`` [ceil(out/128), ceil(in/128)] (E8M0 in Flash, F32 in Flash-Base):
  ``attn.{wq_a, wq_b, wkv, wo_a, wo_b}``, ``attn.indexer.wq_b``, ``ffn.shared_experts.w{1,2,3}``,
  ``mtp.N.{e,h}_proj``;
- routed experts ``ffn.experts.M.w{1,3}`` [I, D], ``w2`` [D, I]: Flash = int8 bytes of two E2M1 codes
  [out, in/2] (low nibble = even input) + F8_E8M0 ``.scale`` [out, in/32]; Base = FP8 + F32 block scale;
- ``mtp.N.*``: a full block without compressor (its ratio, the last ``compress_ratios`` entry, is 0) with a
  gate bias, plus ``e_proj``/``h_proj`` [D, D], ``enorm``/``hnorm``/``norm`` and ``hc_head_*``.

Shards follow the published grouping (``embed`` | one layer each | ``head``/``norm``/``hc_head`` | MTP);
``max_shard_bytes`` splits a group that is bigger. Shards are generated and written one at a time, so
memory stays bounded by one shard (a >= 1 GB benchmark checkpoint is a bigger ``config``).

Quantised tensors are drawn as a real checkpoint holds them: random float32 weights (std ``init_std``) put
through a small quantiser written from the published formulas (independent of ``trainer.hub.quant``, so the
two check each other): per 128x128 block a power-of-two scale ``2^ceil(log2(amax/448))`` (max |code| in the
top binade, [224, 448]), stored as E8M0 (Flash) or as float32 (Flash-Base); MXFP4 per 32 inputs
``2^ceil(log2(amax/6))``, codes rounded to nearest, ties to even, on the E2M1 grid (a group's largest code is
3, 4 or 6). Flash-Base's float32 scales are powers of two by default because its published config says
``scale_fmt: ue8m0``: transformers' FP8 path then holds them as E8M0 and would round any other value
(``base_scales="amax"`` writes ``s = amax/448``, max |code| == 448, to exercise readers on such scales).
Every tensor is drawn from its own generator (seed + name), so its values do not depend on the shard layout.

:func:`trainer.hub.placement.fp8_placement_problems` checks a directory the way transformers' FP8 loading
path (the one a GPU takes: weights stay FP8/FP4, ``.scale`` -> ``weight_scale_inv``) places it, with the GPU check bypassed;
the CPU path dequantises leniently and would accept misplaced tensors.
"""

from __future__ import annotations

import json
import math
import shutil
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

VARIANTS = ("flash", "flash-base")
BLOCK = 128
MX_GROUP = 32
FP8_MAX = 448.0
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
PUBLISHED_DIR = Path(__file__).resolve().parent / "published"

# safetensors dtype names
BF16, F32, I64, I8, F8_E4M3, F8_E8M0 = "BF16", "F32", "I64", "I8", "F8_E4M3", "F8_E8M0"
TORCH_DTYPES = {BF16: torch.bfloat16, F32: torch.float32, I64: torch.int64, I8: torch.int8,
                F8_E4M3: torch.float8_e4m3fn, F8_E8M0: torch.float8_e8m0fnu}
DTYPE_NAMES = {v: k for k, v in TORCH_DTYPES.items()}
_BYTES = {BF16: 2, F32: 4, I64: 8, I8: 1, F8_E4M3: 1, F8_E8M0: 1}

# The tiny default (legacy config.json keys): FP8 dims both over one block (256 = 2 x 128) and partial
# (96, 64 < 128: the ceil in the scale grid), multiples of 32 where MXFP4 needs them (the experts' inputs D,
# I); every attention type (0 sliding, 4 CSA with indexer, 128 HCA), a hash layer, MTP. No dim is a
# partial block after full ones (e.g. 192 = 128 + 64): transformers 5.24 dequantises such a weight wrongly
# (Fp8Dequantize infers the block as dim // grid = 96), so parity with it would fail; the real checkpoints'
# dims are all multiples of 128. ``config={"hidden_size": 192}`` writes such a checkpoint for other readers.
TINY = {
    "vocab_size": 300, "hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 2, "head_dim": 64,
    "qk_rope_head_dim": 16, "q_lora_rank": 96, "o_groups": 2, "o_lora_rank": 48, "index_n_heads": 2,
    "index_head_dim": 32, "index_topk": 8, "sliding_window": 32, "moe_intermediate_size": 96,
    "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1, "num_hash_layers": 1,
    "compress_ratios": [0, 4, 128, 4, 0], "max_position_embeddings": 4096,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 4, "original_max_position_embeddings": 1024,
                     "type": "yarn"},
    "num_nextn_predict_layers": 1,
}


def published_flash_config() -> dict:
    """The published ``deepseek-ai/DeepSeek-V4-Flash`` ``config.json`` (284 B total / 13 B activated)."""
    return json.loads((PUBLISHED_DIR / "deepseek-v4-flash.config.json").read_text())


def _default_ratios(n: int) -> list[int]:
    """``compress_ratios`` for ``n`` layers (+ the MTP entry): sliding first, then CSA / HCA alternating."""
    return [0] + [4 if i % 2 else 128 for i in range(1, n)] + [0]


def hub_config(variant: str = "flash", config: dict | None = None) -> dict:
    """The ``config.json`` :func:`write_hub_checkpoint` writes: the published Flash config with the tiny
    dims (:data:`TINY`), then ``config``'s keys, in the published legacy form for ``variant``."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, not {variant!r}")
    cfg = {**published_flash_config(), **TINY, **(config or {})}
    n = cfg["num_hidden_layers"]
    if config and "num_hidden_layers" in config and "compress_ratios" not in config:
        cfg["compress_ratios"] = _default_ratios(n)
    ratios = list(cfg["compress_ratios"])
    mtp = cfg.get("num_nextn_predict_layers", 0)
    if len(ratios) == n:  # the MTP block's entry (no compressor)
        ratios.append(0)
    if len(ratios) < n or any(r not in (0, 4, 128) for r in ratios):
        raise ValueError(f"compress_ratios {ratios} must give 0/4/128 for each of the {n} layers (+ MTP)")
    if mtp and len(ratios) > n and ratios[n] != 0:
        raise ValueError("the MTP block has no compressor: compress_ratios[num_hidden_layers] must be 0")
    cfg["compress_ratios"] = ratios
    cfg["expert_dtype"] = "fp4" if variant == "flash" else "fp8"
    if (cfg["num_attention_heads"] * cfg["head_dim"]) % cfg["o_groups"]:
        raise ValueError("num_attention_heads * head_dim must be divisible by o_groups")
    if variant == "flash" and (cfg["hidden_size"] % MX_GROUP or cfg["moe_intermediate_size"] % MX_GROUP):
        raise ValueError("MXFP4 experts need hidden_size and moe_intermediate_size divisible by 32")
    if cfg["num_experts_per_tok"] > cfg["n_routed_experts"]:
        raise ValueError("num_experts_per_tok must be <= n_routed_experts")
    return cfg


# ----------------------------------------------------------------------------------------------- layout
@dataclass(frozen=True)
class Spec:
    """One stored tensor: safetensors dtype, shape, and how to draw it (``kind``)."""

    dtype: str
    shape: tuple[int, ...]
    kind: str  # matrix | embed | norm | hc_fn | hc_base | hc_scale | sink | ape | bias | tid2eid | fp8 | fp8_scale | fp4 | fp4_scale

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _BYTES[self.dtype]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _fp8(out: dict, name: str, rows: int, cols: int, scale_dtype: str) -> None:
    out[f"{name}.weight"] = Spec(F8_E4M3, (rows, cols), "fp8")
    out[f"{name}.scale"] = Spec(scale_dtype, (_cdiv(rows, BLOCK), _cdiv(cols, BLOCK)), "fp8_scale")


def _expert(out: dict, name: str, rows: int, cols: int, variant: str) -> None:
    if variant == "flash":
        out[f"{name}.weight"] = Spec(I8, (rows, cols // 2), "fp4")
        out[f"{name}.scale"] = Spec(F8_E8M0, (rows, cols // MX_GROUP), "fp4_scale")
    else:
        _fp8(out, name, rows, cols, F32)


def _block(out: dict, p: str, cfg: dict, ratio: int, hash_moe: bool, variant: str) -> None:
    d, n = cfg["hidden_size"], cfg["hc_mult"]
    h, hd, ql = cfg["num_attention_heads"], cfg["head_dim"], cfg["q_lora_rank"]
    g, orank = cfg["o_groups"], cfg["o_lora_rank"]
    e, i = cfg["n_routed_experts"], cfg["moe_intermediate_size"]
    sd = F8_E8M0 if variant == "flash" else F32
    for hc in ("attn", "ffn"):
        out[f"{p}hc_{hc}_fn"] = Spec(F32, ((2 + n) * n, n * d), "hc_fn")
        out[f"{p}hc_{hc}_base"] = Spec(F32, ((2 + n) * n,), "hc_base")
        out[f"{p}hc_{hc}_scale"] = Spec(F32, (3,), "hc_scale")
    out[f"{p}attn_norm.weight"] = Spec(BF16, (d,), "norm")
    out[f"{p}ffn_norm.weight"] = Spec(BF16, (d,), "norm")
    _fp8(out, f"{p}attn.wq_a", ql, d, sd)
    out[f"{p}attn.q_norm.weight"] = Spec(BF16, (ql,), "norm")
    _fp8(out, f"{p}attn.wq_b", h * hd, ql, sd)
    _fp8(out, f"{p}attn.wkv", hd, d, sd)
    out[f"{p}attn.kv_norm.weight"] = Spec(BF16, (hd,), "norm")
    _fp8(out, f"{p}attn.wo_a", g * orank, h * hd // g, sd)
    _fp8(out, f"{p}attn.wo_b", d, g * orank, sd)
    out[f"{p}attn.attn_sink"] = Spec(F32, (h,), "sink")
    if ratio:
        c = 2 if ratio == 4 else 1  # CSA's overlapping windows: two halves
        out[f"{p}attn.compressor.wkv.weight"] = Spec(BF16, (c * hd, d), "matrix")
        out[f"{p}attn.compressor.wgate.weight"] = Spec(BF16, (c * hd, d), "matrix")
        out[f"{p}attn.compressor.ape"] = Spec(F32, (ratio, c * hd), "ape")
        out[f"{p}attn.compressor.norm.weight"] = Spec(BF16, (hd,), "norm")
    if ratio == 4:
        ih, ihd = cfg["index_n_heads"], cfg["index_head_dim"]
        _fp8(out, f"{p}attn.indexer.wq_b", ih * ihd, ql, sd)
        out[f"{p}attn.indexer.weights_proj.weight"] = Spec(BF16, (ih, d), "matrix")
        out[f"{p}attn.indexer.compressor.wkv.weight"] = Spec(BF16, (2 * ihd, d), "matrix")
        out[f"{p}attn.indexer.compressor.wgate.weight"] = Spec(BF16, (2 * ihd, d), "matrix")
        out[f"{p}attn.indexer.compressor.ape"] = Spec(F32, (ratio, 2 * ihd), "ape")
        out[f"{p}attn.indexer.compressor.norm.weight"] = Spec(BF16, (ihd,), "norm")
    out[f"{p}ffn.gate.weight"] = Spec(BF16, (e, d), "matrix")
    if hash_moe:
        out[f"{p}ffn.gate.tid2eid"] = Spec(I64, (cfg["vocab_size"], cfg["num_experts_per_tok"]), "tid2eid")
    else:
        out[f"{p}ffn.gate.bias"] = Spec(F32, (e,), "bias")
    si = i * cfg.get("n_shared_experts", 1)
    if si:
        _fp8(out, f"{p}ffn.shared_experts.w1", si, d, sd)
        _fp8(out, f"{p}ffn.shared_experts.w2", d, si, sd)
        _fp8(out, f"{p}ffn.shared_experts.w3", si, d, sd)
    for j in range(e):
        _expert(out, f"{p}ffn.experts.{j}.w1", i, d, variant)
        _expert(out, f"{p}ffn.experts.{j}.w2", d, i, variant)
        _expert(out, f"{p}ffn.experts.{j}.w3", i, d, variant)


def _hc_head(out: dict, p: str, cfg: dict) -> None:
    d, n = cfg["hidden_size"], cfg["hc_mult"]
    out[f"{p}hc_head_fn"] = Spec(F32, (n, n * d), "hc_fn")
    out[f"{p}hc_head_base"] = Spec(F32, (n,), "hc_base")
    out[f"{p}hc_head_scale"] = Spec(F32, (1,), "hc_scale")


def hub_layout(cfg: dict, variant: str) -> list[dict[str, Spec]]:
    """The published tensors of ``cfg`` (a :func:`hub_config`), in the published shard groups."""
    d, v, n_layers = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    ratios, n_hash = cfg["compress_ratios"], cfg.get("num_hash_layers", 3)
    groups: list[dict[str, Spec]] = [{"embed.weight": Spec(BF16, (v, d), "embed")}]
    for i in range(n_layers):
        layer: dict[str, Spec] = {}
        _block(layer, f"layers.{i}.", cfg, ratios[i], i < n_hash, variant)
        groups.append(layer)
    top: dict[str, Spec] = {}
    _hc_head(top, "", cfg)
    top["head.weight"] = Spec(BF16, (v, d), "embed")
    top["norm.weight"] = Spec(BF16, (d,), "norm")
    groups.append(top)
    for k in range(cfg.get("num_nextn_predict_layers", 0)):
        mtp: dict[str, Spec] = {}
        _block(mtp, f"mtp.{k}.", cfg, 0, False, variant)
        sd = F8_E8M0 if variant == "flash" else F32
        _fp8(mtp, f"mtp.{k}.e_proj", d, d, sd)
        _fp8(mtp, f"mtp.{k}.h_proj", d, d, sd)
        for norm in ("enorm", "hnorm", "norm"):
            mtp[f"mtp.{k}.{norm}.weight"] = Spec(BF16, (d,), "norm")
        _hc_head(mtp, f"mtp.{k}.", cfg)
        groups.append(mtp)
    return groups


# ------------------------------------------------------------------------------------------- quantiser
def _pow2_ceil(x: torch.Tensor) -> torch.Tensor:
    """Smallest power of two >= x (x > 0), exactly: frexp gives x = m * 2^e with m in [0.5, 1)."""
    m, e = torch.frexp(x)
    return torch.ldexp(torch.ones_like(x), torch.where(m == 0.5, e - 1, e))


def _block_amax(w: torch.Tensor) -> torch.Tensor:
    r, c = w.shape
    pad = torch.zeros(_cdiv(r, BLOCK) * BLOCK, _cdiv(c, BLOCK) * BLOCK, dtype=torch.float32)
    pad[:r, :c] = w.abs()
    return pad.view(_cdiv(r, BLOCK), BLOCK, _cdiv(c, BLOCK), BLOCK).amax(dim=(1, 3))


def _quant_fp8(w: torch.Tensor, scale_dtype: str, base_scales: str = "pow2") -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 e4m3 codes [out, in] and the per-128x128-block scale (``W ~= q * s``)."""
    w = w.float()
    amax = _block_amax(w)
    if scale_dtype == F8_E8M0 or base_scales == "pow2":
        s = torch.where(amax > 0, _pow2_ceil(amax / FP8_MAX), torch.ones_like(amax))
    else:
        s = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    r, c = w.shape
    s_full = s.repeat_interleave(BLOCK, 0)[:r].repeat_interleave(BLOCK, 1)[:, :c]
    q = (w / s_full).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, s.to(TORCH_DTYPES[scale_dtype])


_E2M1_MIDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)  # decision points between neighbouring grid values


def _round_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Indices (0..7) into :data:`E2M1_GRID` of |x| <= 6 rounded to nearest, ties to the even index."""
    mids = torch.tensor(_E2M1_MIDS)
    a = x.abs().contiguous()
    idx = torch.bucketize(a, mids)  # number of decision points < a: a tie at mids[k] gives k (rounds down)
    tie = a == mids[idx.clamp(max=len(_E2M1_MIDS) - 1)]
    return idx + (tie & (idx % 2 == 1))  # a tie between k and k + 1 goes to the even one


def _quant_fp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4: int8 bytes [out, in/2] (two E2M1 codes, low nibble = even input) + E8M0 scale [out, in/32]."""
    w = w.float()
    r, c = w.shape
    groups = w.view(r, c // MX_GROUP, MX_GROUP)
    amax = groups.abs().amax(-1)
    s = torch.where(amax > 0, _pow2_ceil(amax / E2M1_GRID[-1]), torch.ones_like(amax))
    v = groups / s.unsqueeze(-1)
    idx = _round_e2m1(v)
    code = (idx | torch.where((v < 0) & (idx > 0), 8, 0)).view(r, c).to(torch.uint8)
    packed = code[:, 0::2] | (code[:, 1::2] << 4)
    return packed.view(torch.int8), s.to(torch.float8_e8m0fnu)


# ------------------------------------------------------------------------------------------- generation
def _generator(seed: int, name: str) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))


def _draw(name: str, spec: Spec, seed: int, std: float, tid2eid_experts: int) -> torch.Tensor:
    g = _generator(seed, name)
    shape = spec.shape

    def randn(*s):
        return torch.randn(*s, generator=g)

    if spec.kind == "matrix":
        t = randn(*shape) * std
    elif spec.kind == "embed":
        t = randn(*shape) * 2.5 * std  # a wider embedding / head: logits that are not nearly uniform
    elif spec.kind == "norm":
        t = 1.0 + 0.1 * randn(*shape)
    elif spec.kind == "hc_fn":
        t = randn(*shape) * std
    elif spec.kind in ("hc_base", "sink", "ape"):
        t = 0.1 * randn(*shape)
    elif spec.kind == "hc_scale":
        t = 1.0 + 0.1 * randn(*shape)
    elif spec.kind == "bias":
        t = 0.05 * randn(*shape)
    elif spec.kind == "tid2eid":
        v, k = shape
        t = torch.rand(v, tid2eid_experts, generator=g).argsort(-1)[:, :k]
    else:
        raise ValueError(f"{name}: {spec.kind} is drawn with its weight")
    return t.to(TORCH_DTYPES[spec.dtype]).contiguous()


def _shard_tensors(group: dict[str, Spec], cfg: dict, seed: int, std: float, base_scales: str) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name, spec in group.items():
        if spec.kind in ("fp8_scale", "fp4_scale"):
            continue  # written with their weight
        if spec.kind in ("fp8", "fp4"):
            stem = name.removesuffix(".weight")
            g = _generator(seed, name)
            rows = spec.shape[0]
            cols = spec.shape[1] * (2 if spec.kind == "fp4" else 1)
            w = torch.randn(rows, cols, generator=g) * std
            # a random binade per 128x128 block: neighbouring blocks get different scales, so a reader that
            # maps a block to the wrong scale gets different numbers
            k = torch.randint(-1, 2, (_cdiv(rows, BLOCK), _cdiv(cols, BLOCK)), generator=g).float().exp2()
            w *= k.repeat_interleave(BLOCK, 0)[:rows].repeat_interleave(BLOCK, 1)[:, :cols]
            if spec.kind == "fp4":
                q, s = _quant_fp4(w)
            else:
                q, s = _quant_fp8(w, group[f"{stem}.scale"].dtype, base_scales)
            out[name], out[f"{stem}.scale"] = q, s
        else:
            out[name] = _draw(name, spec, seed, std, cfg["n_routed_experts"])
    for name, spec in group.items():  # the layout is the contract: check what was drawn against it
        t = out[name]
        if tuple(t.shape) != spec.shape or DTYPE_NAMES[t.dtype] != spec.dtype:
            raise AssertionError(f"{name}: drew {DTYPE_NAMES[t.dtype]}{list(t.shape)}, layout {spec}")
    return out


def _split(groups: list[dict[str, Spec]], max_shard_bytes: int | None) -> list[dict[str, Spec]]:
    """The published groups, each cut into pieces of at most ``max_shard_bytes`` (a weight and its scale
    stay together; one tensor over the limit gets a shard of its own)."""
    if max_shard_bytes is None:
        return groups
    shards: list[dict[str, Spec]] = []
    for group in groups:
        cur: dict[str, Spec] = {}
        size = 0
        for unit in _units(group):
            b = sum(s.nbytes for s in unit.values())
            if cur and size + b > max_shard_bytes:
                shards.append(cur)
                cur, size = {}, 0
            cur.update(unit)
            size += b
        if cur:
            shards.append(cur)
    return shards


def _units(group: dict[str, Spec]) -> Iterator[dict[str, Spec]]:
    for name, spec in group.items():
        if spec.kind in ("fp8_scale", "fp4_scale"):
            continue
        unit = {name: spec}
        if spec.kind in ("fp8", "fp4"):
            scale = name.removesuffix(".weight") + ".scale"
            unit[scale] = group[scale]
        yield unit


def _tokenizer_files(tokenizer_dir: Path) -> tuple[list[Path], int, int | None, int | None]:
    """(files to copy, vocab size, bos id, eos id) of a tokenizer directory holding ``tokenizer.json``."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    vocab = tok.get_vocab_size(with_added_tokens=True)
    bos = eos = None
    cfg_path = tokenizer_dir / "tokenizer_config.json"
    if cfg_path.is_file():
        tcfg = json.loads(cfg_path.read_text())

        def tid(key):
            t = tcfg.get(key)
            t = t.get("content") if isinstance(t, dict) else t
            return tok.token_to_id(t) if t else None

        bos, eos = tid("bos_token"), tid("eos_token")
    skip = {"config.json", "model.safetensors.index.json"}
    files = [f for f in sorted(tokenizer_dir.iterdir())
             if f.is_file() and f.name not in skip and not f.name.endswith((".safetensors", ".bin", ".pt"))]
    return files, vocab, bos, eos


def write_hub_checkpoint(out_dir: str | Path, variant: str = "flash", config: dict | None = None, seed: int = 0,
                         max_shard_bytes: int | None = None, tokenizer_dir: str | Path | None = None, *,
                         init_std: float | None = None, base_scales: str = "pow2") -> Path:
    """Write a random DeepSeek-V4 checkpoint in the published layout into ``out_dir`` and return it.

    ``variant``: ``"flash"`` (FP8 + E8M0 scales, MXFP4 routed experts) or ``"flash-base"`` (FP8 + F32
    scales everywhere). ``config``: ``config.json`` keys over the tiny default (:data:`TINY`); a new
    ``num_hidden_layers`` without ``compress_ratios`` gets sliding, then CSA/HCA alternating. ``max_shard_bytes``
    cuts the published shard groups further. ``tokenizer_dir``: its tokenizer files are copied in and the
    vocabulary (and bos/eos ids) follow it. ``init_std`` (default: the config's ``initializer_range``) is the
    std of the random matrices. ``base_scales`` (Flash-Base's float32 scales): ``"pow2"`` (the default,
    ``2^ceil(log2(amax/448))``, as E8M0 would hold them) or ``"amax"`` (``amax/448``).
    """
    if base_scales not in ("amax", "pow2"):
        raise ValueError("base_scales must be 'amax' or 'pow2'")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    overrides = dict(config or {})
    tok_files: list[Path] = []
    if tokenizer_dir is not None:
        tok_files, vocab, bos, eos = _tokenizer_files(Path(tokenizer_dir))
        overrides["vocab_size"] = vocab
        if bos is not None:
            overrides.setdefault("bos_token_id", bos)
        if eos is not None:
            overrides.setdefault("eos_token_id", eos)
    cfg = hub_config(variant, overrides)
    std = init_std if init_std is not None else cfg.get("initializer_range", 0.02)
    shards = _split(hub_layout(cfg, variant), max_shard_bytes)
    total = len(shards)
    weight_map: dict[str, str] = {}
    total_size = 0
    for k, group in enumerate(shards, 1):
        fname = f"model-{k:05d}-of-{total:05d}.safetensors"
        tensors = _shard_tensors(group, cfg, seed, std, base_scales)
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        for name, t in tensors.items():
            weight_map[name] = fname
            total_size += t.numel() * t.element_size()
        del tensors
    index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    for f in tok_files:
        shutil.copy2(f, out / f.name)
    return out
