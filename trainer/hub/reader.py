"""Read a DeepSeek-V4 checkpoint directory as native tensors, one tensor (or one slice) at a time.

Three formats are recognised by :func:`detect_format`:

- ``hub``: the published layout (original DeepSeek names, FP8 + ``.scale`` blocks, MXFP4 or FP8 routed
  experts, legacy ``config.json``), or its BF16 form (no ``quantization_config``);
- ``hf``: transformers' ``save_pretrained`` layout (``model.`` names, fused experts);
- ``trex``: a T-Rex export (transformers' layout plus ``trex_model_config`` in ``config.json``).

Opening a checkpoint reads only ``config.json`` and the safetensors headers, and checks every tensor's
presence, dtype and shape against the layout the config implies: a missing or unexpected tensor, a shape
or dtype mismatch or an unsupported quantisation raises :class:`CheckpointError` naming the tensor and the
file. :meth:`CheckpointReader.read` then returns one native tensor, or only the slice a rank owns (each
dimension a contiguous range), reading just the bytes it needs: a whole tensor or a run of whole rows with
plain reads (:func:`pread_tensor`, nothing mapped), any other slice with ``safe_open(...).get_slice`` (one shard
mapped at a time); :attr:`CheckpointReader.bytes_read` counts them.
"""

from __future__ import annotations

import json
import math
import re
import struct
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from torch.overrides import TorchFunctionMode
from safetensors import safe_open

from trainer.hub.names import Source, hf_source, hub_kind, hub_source
from trainer.hub.quant import BLOCK, E8M0, FP8, MX_GROUP, dequant_fp4, dequant_fp8
from trainer.models.deepseek_v4.args import ModelArgs
from trainer.models.deepseek_v4.model import Transformer
from trainer.models.deepseek_v4.state_dict_adapter import model_config_from_hf

Format = Literal["hub", "hf", "trex"]
Index = tuple[slice, ...]
_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F8_E4M3": FP8, "F8_E8M0": E8M0,
           "I8": torch.int8, "U8": torch.uint8, "I64": torch.int64, "I32": torch.int32}


class CheckpointError(ValueError):
    """A checkpoint that does not match its own config or the layout of its format."""


@dataclass(frozen=True)
class Scheme:
    """How a hub checkpoint is quantised: ``flash`` (E8M0 scales, MXFP4 experts), ``flash-base`` (float32
    scales, FP8 experts), ``flash-e8m0-fp8`` (E8M0 scales, FP8 experts) or ``bf16`` (none)."""

    name: str
    scale_dtype: torch.dtype | None
    experts: Literal["fp4", "fp8", "bf16"]


FLASH = Scheme("flash", E8M0, "fp4")
FLASH_BASE = Scheme("flash-base", torch.float32, "fp8")
BF16 = Scheme("bf16", None, "bf16")
SCHEMES = {s.name: s for s in (FLASH, FLASH_BASE, BF16, Scheme("flash-e8m0-fp8", E8M0, "fp8"))}


def read_header(path: Path) -> dict[str, dict]:
    """``{name: {"dtype", "shape", "data_offsets", "start"}}`` from a safetensors file's header (no tensor data
    is read); ``start`` is the file offset of the tensor's first byte."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    for h in header.values():
        h["start"] = 8 + n + h["data_offsets"][0]
    return header


def _row_range(index: list[slice], shape: list[int]) -> tuple[int, int] | None:
    """``(first, last)`` rows when ``index`` takes a range of the first dimension and every other dimension
    whole (a contiguous run of bytes in the file), else None."""
    if not shape:
        return 0, 1
    for s, d in zip(index[1:], shape[1:]):
        if s.indices(d)[:2] != (0, d) or s.step not in (None, 1):
            return None
    if index[0].step not in (None, 1):
        return None
    lo, hi, _ = index[0].indices(shape[0])
    return lo, max(lo, hi)


def pread_tensor(path: Path, start: int, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    """``shape`` elements of ``dtype`` from ``path`` at byte ``start``, read into a fresh tensor with plain
    reads (no mmap: a mapped shard's pages would count in this process's RSS while it is read)."""
    n = math.prod(shape) * dtype.itemsize
    buf = torch.empty(n, dtype=torch.uint8)
    view, done = memoryview(buf.numpy()), 0
    with open(path, "rb", buffering=0) as f:
        f.seek(start)
        while done < n:
            got = f.readinto(view[done:])
            if not got:
                raise CheckpointError(f"{path}: file ends {n - done} bytes short of a tensor at offset {start}")
            done += got
    return buf.view(dtype).view(shape) if n else torch.empty(shape, dtype=dtype)


def weight_files(root: Path) -> dict[str, str]:
    """``{tensor name: shard file name}`` from ``model.safetensors.index.json`` or a single file."""
    index = root / "model.safetensors.index.json"
    if index.is_file():
        return dict(json.loads(index.read_text())["weight_map"])
    single = root / "model.safetensors"
    if single.is_file():
        return {k: "model.safetensors" for k in read_header(single)}
    raise FileNotFoundError(f"{root}: no model.safetensors or model.safetensors.index.json")


def from_saved_name(name: str) -> str:
    """A tensor name of transformers' ``save_pretrained`` (5.x reverses its renaming only partly) -> the
    published name: no ``model.`` prefix, ``embed_tokens`` -> ``embed``, ``hc_head.hc_X`` -> ``hc_head_X``,
    ``attn.norm`` (its reversal of ``kv_norm``) -> ``attn.kv_norm``."""
    n = name.removeprefix("model.")
    n = {"embed_tokens.weight": "embed.weight"}.get(n, n)
    if n.startswith("hc_head.hc_"):
        n = "hc_head_" + n[len("hc_head.hc_"):]
    return re.sub(r"^(layers\.\d+\.attn)\.norm\.", r"\1.kv_norm.", n)


def detect_format(root: str | Path) -> Format:
    root = Path(root)
    cfg_file = root / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{root}: no config.json (not a model checkpoint directory)")
    config = json.loads(cfg_file.read_text())
    if config.get("model_type") != "deepseek_v4":
        raise CheckpointError(f"{cfg_file}: model_type {config.get('model_type')!r} is not deepseek_v4")
    if "trex_model_config" in config:
        return "trex"
    names = weight_files(root)
    if "embed.weight" in names:
        return "hub"
    if "model.embed_tokens.weight" in names:
        return "hf"  # transformers' layout (as it holds it in memory, or as its save_pretrained writes it)
    raise CheckpointError(f"{root}: neither embed.weight (published layout) nor model.embed_tokens.weight "
                          f"(transformers layout) is among its {len(names)} tensors")


def hub_scheme(config: dict, headers: dict[str, dict], cfg_file: Path) -> Scheme:
    """The quantisation of a hub checkpoint from its config and the dtype of its scales."""
    q = config.get("quantization_config")
    if not q:
        return BF16
    if q.get("quant_method") != "fp8" or q.get("fmt", "e4m3") != "e4m3" or \
            list(q.get("weight_block_size") or [BLOCK, BLOCK]) != [BLOCK, BLOCK]:
        raise CheckpointError(f"{cfg_file}: unsupported quantization_config {q} (T-Rex reads fp8 e4m3 with "
                              f"128x128 blocks)")
    experts = config.get("expert_dtype", "fp4")  # vLLM's default too
    if experts not in ("fp4", "fp8"):
        raise CheckpointError(f"{cfg_file}: unsupported expert_dtype {experts!r} (fp4 or fp8)")
    scale_types = {h["dtype"] for n, h in headers.items() if n.endswith(".scale") and ".experts." not in n}
    if len(scale_types) > 1:
        raise CheckpointError(f"{cfg_file}: FP8 scales of mixed dtypes {sorted(scale_types)}")
    scale = _DTYPES.get(scale_types.pop(), None) if scale_types else E8M0
    if scale not in (E8M0, torch.float32):
        raise CheckpointError(f"{cfg_file}: FP8 scales must be F8_E8M0 or F32")
    for s in SCHEMES.values():
        if s.scale_dtype == scale and s.experts == experts:
            return s
    raise CheckpointError(f"{cfg_file}: unsupported combination of {scale} scales and {experts} experts")


class _ShapesOnly(TorchFunctionMode):
    """While a model is built on the meta device for its shapes alone (then thrown away): initialisers are skipped
    and ``arange`` runs on the CPU, so the rotary tables computed from it are small CPU tensors. On meta both go through torch's Python decompositions, whose first use imports
    ``torch._dynamo`` -- 0.5 s of a fresh process's first checkpoint open, a fifth of a 1.2 GB conversion."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__module__", None) == "torch.nn.init":
            t = args[0] if args else kwargs.get("tensor")
            if isinstance(t, torch.Tensor) and t.is_meta:
                return t
        if func is torch.arange and torch.device(kwargs.get("device") or "cpu").type == "meta":
            return func(*args, **{**kwargs, "device": "cpu"})  # (the small position tables it feeds stay on CPU)
        return func(*args, **kwargs)


def native_shapes(cfg: ModelArgs, vocab: int) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """Every native tensor's shape and dtype, without allocating the model."""
    with _ShapesOnly(), torch.device("meta"):
        sd = Transformer(cfg, vocab).state_dict()
    return {k: (v.shape, v.dtype) for k, v in sd.items()}


def expected_hub(src: Source, shape: torch.Size, scheme: Scheme) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The hub file tensors (with their scales) that make a native tensor of ``shape``."""
    if src.kind == "zero":
        return {}
    if src.kind == "experts":
        e, a, b = shape
        per = (b, a)  # w_gate/w_up native [E, D, I] <- [I, D]; w_down [E, I, D] <- [D, I]
        shapes = {n: per for n in src.names}
    elif src.kind == "wo_a":
        g, n_in, r = shape
        shapes = {src.names[0]: (g * r, n_in)}
    elif src.kind == "eh_proj":
        d = shape[0]
        shapes = {n: (d, d) for n in src.names}
    else:
        shapes = {src.names[0]: tuple(shape)}
    out = {}
    for name, shp in shapes.items():
        kind = hub_kind(name)
        scale = name[: -len("weight")] + "scale"
        if kind == "f32":
            out[name] = (shp, torch.float32)
        elif kind == "i64":
            out[name] = (shp, torch.int64)
        elif kind == "bf16" or scheme.scale_dtype is None:
            out[name] = (shp, torch.bfloat16)
        elif kind == "expert" and scheme.experts == "fp4":
            if shp[1] % MX_GROUP:
                raise CheckpointError(f"{name}: MXFP4 needs an input width divisible by {MX_GROUP}, got {shp}")
            out[name] = ((shp[0], shp[1] // 2), torch.int8)
            out[scale] = ((shp[0], shp[1] // MX_GROUP), E8M0)
        else:
            out[name] = (shp, FP8)
            out[scale] = ((math.ceil(shp[0] / BLOCK), math.ceil(shp[1] / BLOCK)), scheme.scale_dtype)
    return out


def _more(names: list[str]) -> str:
    return f" (and {len(names) - 1} more)" if len(names) > 1 else ""


def _full(index: Index | None, shape) -> list[slice]:
    index = list(index or ())
    index += [slice(None)] * (len(shape) - len(index))
    out = []
    for s, n in zip(index, shape):
        a, b, step = s.indices(n)
        if step != 1:
            raise ValueError("checkpoint slices must be contiguous (step 1)")
        out.append(slice(a, b))
    return out


class CheckpointReader:
    """One checkpoint directory; see the module docstring."""

    def __init__(self, root: str | Path, max_open: int = 1):
        self.root = Path(root)
        self.format: Format = detect_format(self.root)
        cfg_file = self.root / "config.json"
        self.config = json.loads(cfg_file.read_text())
        if self.format == "trex":
            self.args, self.vocab_size = ModelArgs(**self.config["trex_model_config"]), self.config["vocab_size"]
        else:
            try:
                self.args, self.vocab_size = model_config_from_hf(self.config)
            except (KeyError, ValueError) as e:
                raise CheckpointError(f"{cfg_file}: cannot read the model architecture: {e}") from e
        files = weight_files(self.root)
        headers: dict[str, dict] = {}
        for shard in sorted(set(files.values())):
            path = self.root / shard
            if not path.is_file():
                held = [n for n, f in files.items() if f == shard]
                raise CheckpointError(f"{path}: shard named by the index is missing (it holds {held[0]!r}"
                                      f"{_more(held)})")
            for name, h in read_header(path).items():
                if files.get(name) != shard:
                    raise CheckpointError(f"{path}: tensor {name!r} is not listed for this file in the index")
                headers[name] = h
        # transformers' save_pretrained writes original names under "model." (with a few of its own): read them
        # as the published layout, unquantised
        self.saved_by_transformers = self.format == "hf" and any(".attn." in n or ".ffn." in n for n in headers)
        rename = from_saved_name if self.saved_by_transformers else (lambda n: n)
        self.stored = {rename(n): n for n in headers}  # our name -> the name in the file
        self.headers = {rename(n): h for n, h in headers.items()}
        self.files = {rename(n): f for n, f in files.items()}
        if self.format != "hub" and self.args.mtp_layers and not any(n.startswith("mtp.") for n in self.headers):
            self.args = self.args.model_copy(update={"mtp_layers": 0})  # transformers keeps no MTP block
        self.layout = "hub" if self.format == "hub" or self.saved_by_transformers else "hf"
        self.scheme = hub_scheme(self.config, self.headers, cfg_file) if self.format == "hub" else \
            (BF16 if self.saved_by_transformers else None)
        self.shapes = native_shapes(self.args, self.vocab_size)
        self.sources = {k: (hub_source if self.layout == "hub" else hf_source)(k, self.args) for k in self.shapes}
        self.bytes_read = 0
        self._count, self._mapped = threading.Lock(), threading.Lock()
        self._open: OrderedDict[str, object] = OrderedDict()
        self._max_open = max_open
        self._validate()

    # ------------------------------------------------------------------------------------ validation
    def _validate(self) -> None:
        expected: dict[str, tuple[tuple[int, ...], torch.dtype | None]] = {}
        for key, (shape, _) in self.shapes.items():
            src = self.sources[key]
            if self.layout == "hub":
                expected.update(expected_hub(src, shape, self.scheme))
            else:
                expected.update({n: (None, None) for n in src.names})
        if self.layout != "hub" and self.args.tie_embeddings:
            expected.pop("lm_head.weight", None)
        index = self.root / ("model.safetensors.index.json" if (self.root / "model.safetensors.index.json").is_file()
                             else "model.safetensors")
        for name, (shape, dtype) in expected.items():  # first what is there: a wrong dtype says more than its
            if name not in self.headers:                   # then missing scale
                continue
            h, f = self.headers[name], self.root / self.files[name]
            got = _DTYPES.get(h["dtype"])
            if got is None:
                raise CheckpointError(f"{f}: tensor {name!r} has unsupported dtype {h['dtype']}")
            if self.saved_by_transformers and got.is_floating_point and got.itemsize >= 2:
                dtype = None  # saved in the model's dtype
            if dtype is not None and got != dtype:
                raise CheckpointError(f"{f}: tensor {name!r} is {h['dtype']}, the {self.scheme.name} layout stores "
                                      f"it as {dtype}")
            if shape is not None and tuple(h["shape"]) != tuple(shape):
                raise CheckpointError(f"{f}: tensor {name!r} has shape {h['shape']}, config.json implies "
                                      f"{list(shape)}")
        missing = [n for n in expected if n not in self.headers]
        if missing:
            n = missing[0]
            where = f"{self.root / self.files[n]} (where the index puts it)" if n in self.files else str(index)
            raise CheckpointError(f"{where}: missing tensor {n!r}{_more(missing)} that config.json's architecture "
                                  f"needs")
        unexpected = [n for n in self.headers if n not in expected]
        if unexpected:
            n = unexpected[0]
            raise CheckpointError(f"{self.root / self.files[n]}: unexpected tensor {n!r}{_more(unexpected)} that "
                                  f"config.json's architecture does not have")
        if self.layout != "hub":
            for key, (shape, _) in self.shapes.items():
                src = self.sources[key]
                if src.kind in ("rename",) and tuple(self.headers[src.names[0]]["shape"]) != tuple(shape):
                    n = src.names[0]
                    raise CheckpointError(f"{self.root / self.files[n]}: tensor {n!r} has shape "
                                          f"{self.headers[n]['shape']}, config.json implies {list(shape)}")

    # --------------------------------------------------------------------------------------- reading
    def native_keys(self) -> list[str]:
        return list(self.shapes)

    def _handle(self, name: str):
        shard = self.files[name]
        if shard in self._open:
            self._open.move_to_end(shard)
            return self._open[shard]
        while len(self._open) >= self._max_open:
            _, old = self._open.popitem(last=False)
            old.__exit__(None, None, None)
        h = safe_open(str(self.root / shard), framework="pt")
        h.__enter__()
        self._open[shard] = h
        return h

    def close(self) -> None:
        while self._open:
            self._open.popitem()[1].__exit__(None, None, None)

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _get(self, name: str, index: list[slice]) -> torch.Tensor:
        h = self.headers[name]
        rows = _row_range(index, h["shape"])
        if rows is None:
            with self._mapped:  # the open-shard cache is shared by a conversion's worker threads
                t = self._handle(name).get_slice(self.stored[name])[tuple(index)]
        else:  # a contiguous run of whole rows: plain reads (see pread_tensor), no mapping
            dtype, shape = _DTYPES[h["dtype"]], list(h["shape"])
            offset = h["start"]
            if shape:
                offset += rows[0] * math.prod(shape[1:]) * dtype.itemsize
                shape[0] = rows[1] - rows[0]
            t = pread_tensor(self.root / self.files[name], offset, dtype, shape)
        with self._count:  # conversions read from worker threads
            self.bytes_read += t.numel() * t.element_size()
        return t

    def _file_tensor(self, name: str, index: list[slice], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``index`` of file tensor ``name``, dequantised to ``dtype`` (float32 or bfloat16; int64 stays)."""
        stored = self.headers[name]["dtype"]
        scale = name[: -len("weight")] + "scale"
        if stored == "F8_E4M3" and scale in self.headers:
            rows, cols = index
            s = self._get(scale, [slice(rows.start // BLOCK, math.ceil(rows.stop / BLOCK)),
                                  slice(cols.start // BLOCK, math.ceil(cols.stop / BLOCK))])
            return dequant_fp8(self._get(name, index), s, rows.start, cols.start, dtype)
        if stored == "I8" and scale in self.headers:  # MXFP4: widen to whole 32-groups, then crop
            rows, cols = index
            g0, g1 = cols.start // MX_GROUP, math.ceil(cols.stop / MX_GROUP)
            packed = self._get(name, [rows, slice(g0 * MX_GROUP // 2, g1 * MX_GROUP // 2)])
            w = dequant_fp4(packed, self._get(scale, [rows, slice(g0, g1)]), dtype)
            return w[:, cols.start - g0 * MX_GROUP: cols.stop - g0 * MX_GROUP]
        if stored in ("F8_E4M3", "I8", "U8", "F8_E8M0"):
            raise CheckpointError(f"{self.root / self.files[name]}: tensor {name!r} is {stored} without a "
                                  f"{scale!r} to dequantise it with")
        t = self._get(name, index)
        return t if t.dtype == torch.int64 else t.to(dtype)

    def read_file_tensor(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Hub-layout file tensor ``name`` whole, dequantised to ``dtype`` (float32 or bfloat16, the float32
        values rounded; int64 stays)."""
        shape = list(self.headers[name]["shape"])
        if self.headers[name]["dtype"] == "I8" and name[: -len("weight")] + "scale" in self.headers:
            shape[1] *= 2  # MXFP4: two codes per byte
        return self._file_tensor(name, [slice(0, d) for d in shape], dtype)

    def read_stored(self, name: str) -> torch.Tensor:
        """File tensor ``name`` whole, in its stored dtype."""
        return self._get(name, [slice(0, d) for d in self.headers[name]["shape"]])

    def stored_quantised(self, name: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The file's own ``(codes, scale)`` of hub tensor ``name`` when it is stored quantised, else None."""
        scale = name[: -len("weight")] + "scale"
        if self.layout != "hub" or name not in self.headers or scale not in self.headers:
            return None
        full = lambda n: [slice(0, d) for d in self.headers[n]["shape"]]  # noqa: E731
        return self._get(name, full(name)), self._get(scale, full(scale))

    @staticmethod
    def dequantised(name: str, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return dequant_fp4(codes, scale) if codes.dtype == torch.int8 else dequant_fp8(codes, scale)

    def read(self, key: str, index: Index | None = None) -> torch.Tensor:
        """Native tensor ``key`` (float32, or int64 for ``tid2eid``), or its ``index`` slice."""
        if key not in self.shapes:
            raise KeyError(f"{self.root}: {key!r} is not a tensor of this model")
        shape, _ = self.shapes[key]
        idx = _full(index, shape)
        src = self.sources[key]
        if src.kind == "rename":
            return self._file_tensor(src.names[0], idx)
        if src.kind == "zero":
            return torch.zeros(shape)[tuple(idx)]
        if src.kind == "wo_a":  # native [G, in, r] <- [G*r, in]
            g, n_in, r = shape
            sg, si, sr = idx
            rows = self._file_tensor(src.names[0], [slice(sg.start * r, sg.stop * r), si])
            return rows.view(sg.stop - sg.start, r, -1).transpose(1, 2)[:, :, sr].contiguous()
        if src.kind == "experts":  # native [E, a, b] <- per expert [b, a], filled one expert at a time
            se, sa, sb = idx
            out = torch.empty(se.stop - se.start, sa.stop - sa.start, sb.stop - sb.start)
            for i, e in enumerate(range(se.start, se.stop)):
                out[i] = self._file_tensor(src.names[e], [sb, sa]).t()
            return out
        if src.kind == "eh_proj":  # native [D, 2D] <- e_proj [D, D] | h_proj [D, D]
            sr, sc = idx
            d = shape[0]
            parts = []
            for j, name in enumerate(src.names):
                lo, hi = max(sc.start, j * d), min(sc.stop, (j + 1) * d)
                if lo < hi:
                    parts.append(self._file_tensor(name, [sr, slice(lo - j * d, hi - j * d)]))
            return torch.cat(parts, dim=1)
        if src.kind in ("fused_gate", "fused_up"):  # native [E, D, I] <- gate_up [E, 2I, D]
            se, sd, si = idx
            off = 0 if src.kind == "fused_gate" else shape[2]
            t = self._file_tensor(src.names[0], [se, slice(si.start + off, si.stop + off), sd])
            return t.transpose(1, 2).contiguous()
        if src.kind == "fused_down":  # native [E, I, D] <- down [E, D, I]
            se, si, sd = idx
            return self._file_tensor(src.names[0], [se, sd, si]).transpose(1, 2).contiguous()
        raise AssertionError(src.kind)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Every native tensor (the whole model: for one process and small models)."""
        return {k: self.read(k) for k in self.shapes}


def open_checkpoint(root: str | Path) -> CheckpointReader:
    return CheckpointReader(root)


def load_model(root: str | Path, args: ModelArgs | None = None) -> Transformer:
    """The native model (fp32, eval mode) from a hub, transformers or T-Rex checkpoint directory. ``args``
    (e.g. the run's config) may change training-only fields but not the architecture."""
    with CheckpointReader(root) as reader:
        cfg = check_args(reader, args) if args is not None else reader.args
        model = Transformer(cfg, reader.vocab_size)
        state = model.state_dict()  # the parameters and buffers themselves: filled in place, one tensor at a time
        with torch.no_grad():
            for key in reader.native_keys():
                state[key].copy_(reader.read(key))
    model.eval()
    return model


ARCH_FREE = {"bias_update_rate", "mtp_loss_weight", "indexer_loss_weight", "init_std", "kv_norm_init",
             "max_seq_len", "hc_streams_fp32"}


def check_args(reader: CheckpointReader, args: ModelArgs) -> ModelArgs:
    """The checkpoint's architecture with the fields ``args`` set explicitly (its YAML keys) that do not
    change the weights (:data:`ARCH_FREE`); an explicitly set field that contradicts ``config.json`` is an
    error naming both values."""
    ckpt = reader.args.model_dump()
    given = args.model_dump()
    for k in sorted(args.model_fields_set - ARCH_FREE):
        if k in ("layer_types", "mlp_layer_types"):
            prop = "attention_types" if k == "layer_types" else "moe_types"
            v, c = getattr(args, prop), getattr(reader.args, prop)
        else:
            v, c = given[k], ckpt[k]
        if v != c:
            raise CheckpointError(f"model.{k}={v!r} contradicts {reader.root / 'config.json'}, which has {c!r}")
    return ModelArgs(**{**ckpt, **{k: given[k] for k in args.model_fields_set & ARCH_FREE}})
