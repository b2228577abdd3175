"""``trex convert SRC DST --to {hub-fp8, hub-bf16, hf}``: any DeepSeek-V4 checkpoint (hub, transformers,
T-Rex export, or a training run's DCP checkpoint) to any target layout, one tensor at a time.

The output directory is staged in a hidden ``.<name>.partial`` sibling and renamed into place
(:func:`publish`), so a killed conversion leaves no half-written checkpoint. Tokenizer files of the source
(or of ``tokenizer_dir``) are copied beside the weights; a hub target keeps the source's generation config.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Iterator

import torch

from trainer.checkpoint import fsync_path
from trainer.hub.dcp_source import DcpSource, is_dcp
from trainer.hub.names import hub_kind
from trainer.hub.reader import ARCH_FREE, FLASH, SCHEMES, CheckpointError, CheckpointReader, Scheme
from trainer.hub.direct import hub_pieces, write_direct
from trainer.hub.writer import (DEFAULT_SHARD_BYTES, Target, encode_hub, hub_config, hub_stream, ordered_map,
                                published_group, write_checkpoint, write_config)
from trainer.lora import AdapterFile, merge_state
from trex.core.config import LoRAConfig
from trainer.models.deepseek_v4.state_dict_adapter import model_config_from_hf
from trainer.tokenizer import copy_tokenizer_files


def open_source(src: str | Path) -> CheckpointReader | DcpSource:
    return DcpSource(src) if is_dcp(src) else CheckpointReader(src)


def hub_file_names(reader: CheckpointReader) -> Iterator[str]:
    """A hub source's own weight tensors (no scales), in the order native keys name them."""
    for key in reader.native_keys():
        yield from reader.sources[key].names


def encode_file_tensor(reader: CheckpointReader, name: str, to: Target, scheme: Scheme,
                       reference: CheckpointReader | None) -> list[tuple[str, torch.Tensor]]:
    """Hub source tensor ``name`` as the target's file tensors (the weight, and its scale when quantised): as stored
    where the target keeps the source's dtype; the source's own codes and scale where the target is the source's
    quantisation and the source is the reference (an unchanged tensor keeps its bytes); else dequantised straight
    to bfloat16 for a bf16 target (float32 only to be re-quantised). One expert's matrix at a time."""
    if hub_kind(name) in ("bf16", "f32", "i64"):  # written as stored: no float32 copy of the embedding
        return list(encode_hub(name, reader.read_stored(name), to, scheme, reference))
    if to == "hub-fp8" and reference is reader and scheme == reader.scheme:
        stored = reader.stored_quantised(name)
        if stored is not None:
            return list(zip((name, name[: -len("weight")] + "scale"), stored))
    w = reader.read_file_tensor(name, torch.bfloat16 if to == "hub-bf16" else torch.float32)
    return list(encode_hub(name, w, to, scheme, reference))


def encoded_hub_tensors(reader: CheckpointReader, to: Target, scheme: Scheme, reference: CheckpointReader | None,
                        workers: int) -> Iterator[tuple[str, torch.Tensor]]:
    """Every file tensor of a hub-to-hub conversion in order, ``workers`` tensors converted at once."""
    for encoded in ordered_map(lambda n: encode_file_tensor(reader, n, to, scheme, reference),
                               hub_file_names(reader), workers, 2 * workers):
        yield from encoded


def source_header_bytes(reader: CheckpointReader) -> dict[str, int]:
    """Each published shard group's largest header among the source files holding it: the room a hub-to-hub
    conversion leaves for the header of the shard it writes for that group (the same names, as many scales or
    fewer)."""
    out: dict[str, int] = {}
    for name, h in reader.headers.items():  # a tensor's data starts 8 + header bytes + its offset into the file
        g = published_group(name)
        out[g] = max(out.get(g, 0), h["start"] - 8 - h["data_offsets"][0])
    return out


def source_tensors(reader: CheckpointReader | DcpSource) -> Iterator[tuple[str, torch.Tensor]]:
    """The native tensors of a source; a distributed LoRA run's DCP checkpoint with its adapters merged."""
    if isinstance(reader, DcpSource):
        lora = reader.lora()
        if lora is None:
            yield from reader.iter_tensors()
        else:
            yield from merge_state(reader.iter_tensors(), lora[0], LoRAConfig(**lora[1]).scale)
    else:
        for key in reader.native_keys():
            yield key, reader.read(key)


class RequantCount:
    """Beside a hub-fp8 stream: how many quantised tensors the merge + re-quantisation left bit-identical to the
    reference's codes, and the share of codes unchanged in the others."""

    def __init__(self, reference: CheckpointReader):
        self.reference, self.tensors, self.unchanged, self.codes, self.codes_same = reference, 0, 0, 0, 0

    def __call__(self, stream):
        for name, t in stream:
            if name.endswith(".weight") and t.dtype in (torch.float8_e4m3fn, torch.int8):
                stored = self.reference.stored_quantised(name)
                if stored is not None and stored[0].shape == t.shape:
                    self.tensors += 1
                    same = int((stored[0].view(torch.uint8) == t.view(torch.uint8)).sum())
                    if same == t.numel():
                        self.unchanged += 1
                    else:
                        self.codes, self.codes_same = self.codes + t.numel(), self.codes_same + same
            yield name, t

    def summary(self) -> dict:
        return {"requantised_tensors": self.tensors, "unchanged_tensors": self.unchanged,
                "changed_tensors_codes_unchanged": self.codes_same / self.codes if self.codes else None}


def target_scheme(reader, to: Target, scheme: str | None) -> Scheme | None:
    """The quantisation to write: ``scheme`` if given, else the source's own (a quantised hub source), else
    V4-Flash's (FP8 + E8M0, MXFP4 experts)."""
    if to == "hf":
        return None
    if scheme is not None:
        if scheme not in SCHEMES:
            raise ValueError(f"unknown scheme {scheme!r} (one of {sorted(SCHEMES)})")
        return SCHEMES[scheme]
    own = getattr(reader, "scheme", None)
    return own if own is not None and own.scale_dtype is not None else FLASH


def stage_dir(final: Path) -> Path:
    final.parent.mkdir(parents=True, exist_ok=True)
    staged = final.parent / f".{final.name}.partial"
    if staged.exists():
        shutil.rmtree(staged)  # a killed conversion's leftover
    staged.mkdir()
    return staged


def publish(staged: Path, final: Path, keep_others: bool = True, fsync: bool = True) -> Path:
    """fsync ``staged`` (unless ``fsync`` is off) and rename it to ``final``; an existing ``final`` is swapped out
    (its files that the new one lacks carried over when ``keep_others``) and removed only after the new one is in
    place."""
    if final.is_dir() and keep_others:
        for old in final.iterdir():
            if not (staged / old.name).exists() and not old.name.endswith(".safetensors") \
                    and old.name != "model.safetensors.index.json":
                (shutil.copytree if old.is_dir() else shutil.copy2)(old, staged / old.name)
    for f in staged.rglob("*") if fsync else ():
        if f.is_file():
            fsync_path(f)
    previous = final.parent / f".{final.name}.previous"
    if previous.exists():
        shutil.rmtree(previous)
    if final.exists():
        os.replace(final, previous)
    os.replace(staged, final)
    if fsync:
        fsync_path(final.parent)
    shutil.rmtree(previous, ignore_errors=True)
    return final


def copy_tokenizer(src: Path, dst: Path) -> list[str]:
    """The tokenizer files (``trainer.tokenizer.copy_tokenizer_files``) and the generation config of ``src``."""
    copied = copy_tokenizer_files(src, dst)
    if (src / "generation_config.json").is_file():
        shutil.copy2(src / "generation_config.json", dst / "generation_config.json")
        copied.append("generation_config.json")
    return copied


def _same_architecture(reader, source_config: dict) -> None:
    """A kept ``config.json`` (``--like``) must describe the weights being written."""
    args, vocab = model_config_from_hf(source_config)
    ours, theirs = reader.args.model_dump(), args.model_dump()
    diff = [k for k in ours if k not in ARCH_FREE and ours[k] != theirs[k]]
    if vocab != reader.vocab_size:
        diff.insert(0, "vocab_size")
    if diff:
        k = diff[0]
        a, b = (reader.vocab_size, vocab) if k == "vocab_size" else (ours[k], theirs[k])
        raise CheckpointError(f"the config.json to keep describes another model than {reader.root}: {k} is {b!r} "
                              f"there and {a!r} here")


def convert(src: str | Path, dst: str | Path, to: Target, scheme: str | None = None,
            tokenizer_dir: str | Path | None = None, max_shard_bytes: int = DEFAULT_SHARD_BYTES,
            extra: dict | None = None, source_config: dict | None = None,
            reference: CheckpointReader | None = None, source_name: str | None = None,
            workers: int | None = None, fsync: bool = True, adapter: str | Path | None = None,
            direct: bool = True) -> dict:
    """Convert ``src`` into ``dst`` (see the module docstring); a summary: formats, tensors, bytes read.
    ``source_config``: the published ``config.json`` to keep for a hub target (default: ``src``'s own when it
    is a hub checkpoint; e.g. the base model's when ``src`` is a fine-tuned export of it). ``reference``: a hub
    checkpoint whose bytes an unchanged quantised tensor keeps (default: ``src`` itself when it is one).
    ``source_name``: how ``config.json``'s ``trex_provenance.source`` names ``src`` (default: its resolved path;
    a stage whose output is content-hashed names the source's content instead, not where it happens to live).
    ``workers``: tensors converted at once (default: the CPUs, at most 4; reads and writes overlap them either
    way). ``fsync``: each shard is flushed to disk as it is finished (in the background) and the directory before
    it is published; off, the page cache holds it until the system writes it back. ``adapter``: a LoRA adapter
    directory (PEFT layout, ``trainer.lora``) merged into ``src``'s weights on the way (float32, then the target's
    scheme); the summary then says how many quantised tensors the re-quantisation left as they were. ``direct``: a
    hub-to-hub conversion that re-quantises nothing (to hub-bf16, or to the source's own scheme) is dequantised
    straight into reused I/O buffers and written with O_DIRECT (:mod:`trainer.hub.direct`; the summary's
    ``direct_io``); False: through the general path."""
    src, final = Path(src), Path(dst)
    reader = open_source(src)
    try:
        sch = target_scheme(reader, to, scheme)
        out = stage_dir(final)
        provenance = {"source": source_name or str(src.resolve()), "source_format": reader.format, "target": to,
                      **({"scheme": sch.name} if sch and to == "hub-fp8" else {})}
        if source_config is None and reader.format == "hub":
            source_config = reader.config
        elif source_config is not None:
            _same_architecture(reader, source_config)
        if reference is None and reader.format == "hub":
            reference = reader  # unchanged quantised tensors keep their bytes
        hub_to_hub = to != "hf" and isinstance(reader, CheckpointReader) and reader.layout == "hub"
        n = workers or min(4, os.cpu_count() or 1)
        meta = {"trex_provenance": provenance, **(extra or {})}
        merged: dict = {}
        pieces = hub_pieces(reader, list(hub_file_names(reader)), to, sch, reference) \
            if direct and adapter is None and isinstance(reader, CheckpointReader) else None
        if pieces is not None:
            weight_map, merged = write_direct(reader, out, pieces, max_shard_bytes, fsync)
            write_config(out, hub_config(reader.args, reader.vocab_size, to, sch, source_config), meta)
        elif adapter is not None:
            lora = AdapterFile(adapter)
            provenance["adapter"] = str(Path(adapter).resolve())
            tensors = lora.merge(source_tensors(reader))
            merged = {"adapter": str(adapter), "adapted_tensors": len(lora.targets)}
            if to == "hf":
                weight_map = write_checkpoint(out, tensors, reader.args, reader.vocab_size, to, sch, source_config,
                                              meta, max_shard_bytes, fsync=fsync, prefetch=2)
            else:
                count = RequantCount(reference) if reference is not None and to == "hub-fp8" else None
                stream = hub_stream(tensors, reader.args, to, sch, reference)
                weight_map = write_checkpoint(out, count(stream) if count else stream, reader.args,
                                              reader.vocab_size, to, sch, source_config, meta, max_shard_bytes,
                                              encoded=True, fsync=fsync, prefetch=2)
                merged |= count.summary() if count else {}
        elif hub_to_hub:
            room = source_header_bytes(reader)
            weight_map = write_checkpoint(out, encoded_hub_tensors(reader, to, sch, reference, n), reader.args,
                                          reader.vocab_size, to, sch, source_config, meta, max_shard_bytes,
                                          encoded=True, reserve=room.get, fsync=fsync, prefetch=2 * n,
                                          writers=2)
        else:
            weight_map = write_checkpoint(out, source_tensors(reader), reader.args, reader.vocab_size, to, sch,
                                          source_config, meta, max_shard_bytes, reference=reference, fsync=fsync,
                                          prefetch=2, writers=2)
        tok_src = tokenizer_dir or (getattr(reader, "tokenizer_dir", None) if is_dcp(src) else src)
        tok_src = Path(tok_src) if tok_src else None
        copied = copy_tokenizer(tok_src, out) if tok_src else []
        publish(out, final, keep_others=False, fsync=fsync)
        return {"source_format": reader.format, "target": to, "scheme": sch.name if sch and to == "hub-fp8" else None,
                "tensors": len(weight_map), "shards": len(set(weight_map.values())), "bytes_read": reader.bytes_read,
                "tokenizer_files": copied, "path": str(final), "workers": n, "fsync": fsync,
                **({"direct_io": False} if pieces is None else {}), **merged}
    finally:
        reader.close()
