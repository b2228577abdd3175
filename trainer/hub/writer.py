"""Write native tensors, streamed, as a checkpoint in the published or transformers layout.

``write_checkpoint`` takes an iterator of ``(native name, tensor)`` and writes sharded safetensors as it
goes: each tensor's bytes are written as soon as it is converted and a shard ends once it holds
``max_shard_bytes``, so memory is bounded by the few tensors being converted, whatever the model and shard
size. Targets:

- ``hub-fp8``: original DeepSeek names, re-quantised to ``scheme`` (V4-Flash: FP8 + E8M0 scales and
  MXFP4 experts; V4-Flash-Base: FP8 + float32 scales), BF16 / F32 / I64 elsewhere as published;
- ``hub-bf16``: the same names, BF16 instead of FP8 / MXFP4, no scales, and ``quantization_config`` /
  ``expert_dtype`` removed from ``config.json``;
- ``hf``: transformers' ``DeepseekV4ForCausalLM`` names and fused experts, float32 (the T-Rex export:
  ``config.json`` also holds ``trex_model_config``).

Shards are ``model-000NN-of-000MM.safetensors`` with ``model.safetensors.index.json``; a hub target is
sharded as published (the embedding, one shard per layer, the head, the MTP block; split further at
``max_shard_bytes``), an ``hf`` one by size only (one shard: just ``model.safetensors``). The directory is written into a hidden ``.<name>.partial`` sibling and renamed into
place by the caller (:func:`trainer.hub.convert.publish`).
"""

from __future__ import annotations

import ctypes
import json
import os
import queue
import shutil
import struct
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterable, Iterator, Literal

import torch

from trainer.checkpoint import fsync_path
from trainer.hub.names import hf_source, hub_kind, hub_source
from trainer.hub.quant import quant_fp4, quant_fp8
from trainer.hub.reader import BF16, CheckpointReader, Scheme
from trainer.models.deepseek_v4.args import ModelArgs
from trainer.models.deepseek_v4.state_dict_adapter import hf_config

Target = Literal["hub-fp8", "hub-bf16", "hf"]
TARGETS = ("hub-fp8", "hub-bf16", "hf")
DEFAULT_SHARD_BYTES = 4 << 30


_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float8_e4m3fn: "F8_E4M3",
              torch.float8_e8m0fnu: "F8_E8M0", torch.int8: "I8", torch.uint8: "U8", torch.int64: "I64",
              torch.int32: "I32"}


def _entry(t: torch.Tensor, offset: int) -> dict:
    n = t.numel() * t.element_size()
    return {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}


def _write_bytes(f, t: torch.Tensor) -> None:
    if t.numel():
        f.write(t.contiguous().reshape(-1).view(torch.uint8).numpy().data)


def _copy_file(src, dst) -> None:
    """The rest of open file ``src`` appended to open file ``dst``, in the kernel where it can
    (``copy_file_range``): no user-space buffer the size of a shard."""
    while True:
        try:
            n = os.copy_file_range(src.fileno(), dst.fileno(), 1 << 30)
        except (AttributeError, OSError):
            shutil.copyfileobj(src, dst, 8 << 20)
            return
        if n == 0:
            return


def published_group(name: str) -> str:
    """The published shard a hub tensor belongs in: the embedding, one per layer, the head (norm, mHC head,
    LM head), one per MTP block (V4-Flash: 1 + 43 + 1 + 1 = 46 shards)."""
    parts = name.split(".")
    if parts[0] in ("layers", "mtp"):
        return ".".join(parts[:2])
    return "embed" if parts[0] == "embed" else "head"


def ends_shard(has_tensors: bool, size: int, n: int, max_bytes: int, group: str | None, current: str | None) -> bool:
    """Whether a tensor of ``n`` bytes in ``group`` starts a new shard after one of ``size`` bytes in ``current``:
    the rule of :class:`ShardWriter` (and of the direct path's plan, ``trainer.hub.direct.plan_shards``)."""
    return has_tensors and (size + n > max_bytes or group != current)


def write_config(out: Path, config: dict, extra: dict | None) -> None:
    config.update(extra or {})
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))


class ShardWriter:
    """Writes tensors into shards as they come: a shard ends whenever ``max_bytes`` is reached or, with
    ``group``, the group of the next tensor differs (:func:`published_group`); ``index`` writes the index even
    for one shard.

    Each tensor's bytes go to the open shard's file at once (the caller's tensor can be freed right after
    :meth:`add`), behind room left for the safetensors header: ``reserve(group)`` bytes where the caller knows
    the header's size (a conversion: the source shard's header), else 1.25 x the last shard's header (64 KiB for
    the first). When the shard ends its header goes into that room, padded with spaces (safetensors' padding),
    so every byte is written once; a header that outgrew its room is written in front of the data in a new file
    (the data copied behind it by the kernel). No shard is ever held in memory. With ``fsync``, each finished
    shard is flushed to disk by a background thread while the next one is written; :meth:`finish` waits.

    ``writers > 0``: the bytes are written behind :meth:`add` by one thread per shard file, up to ``writers`` shards
    at once (the next shard's writes start while the last one's finish: one file per thread, since buffered writes
    to one file serialise in the kernel -- 3.6 GB into the page cache took 2.3-2.7 s from one thread into one file,
    0.6 s from two threads into two files here), holding at most ``inflight_bytes`` of tensors not yet written."""

    def __init__(self, out: Path, max_bytes: int, group: Callable[[str], str] | None = None, index: bool = False,
                 reserve: Callable[[str | None], int | None] | None = None, fsync: bool = False, writers: int = 0,
                 inflight_bytes: int = 512 << 20):
        self.out, self.max_bytes, self.group, self.index = out, max_bytes, group, index
        self.reserve_hint, self.reserved, self.last_header = reserve, 0, 0
        self.header: dict[str, dict] = {}  # the open shard's tensors
        self.file = None  # and its file
        self.size = 0
        self.shards: list[tuple[str, list[str]]] = []
        self.total = 0
        self.current: str | None = None
        self.seen: set[str] = set()
        self.rewritten = 0  # shards whose header outgrew its room
        self.syncer = ThreadPoolExecutor(1, thread_name_prefix="shard-fsync") if fsync and not writers else None
        self.syncs: list = []
        self.fsync, self.writers, self.budget = fsync, writers, inflight_bytes
        self.lane: ThreadPoolExecutor | None = None  # the open shard's writer thread (writers > 0)
        self.lanes: deque = deque()  # (executor, its last future) of shards still being written
        self.inflight, self.cond = 0, threading.Condition()
        self.writes: list = []

    def _tmp(self, suffix: str) -> Path:
        return self.out / f"shard-{len(self.shards):05d}.{suffix}"

    def _room(self, group: str | None) -> int:
        hint = self.reserve_hint(group) if self.reserve_hint else None
        n = hint if hint is not None else (self.last_header * 5 // 4 if self.last_header else 64 << 10)
        return -(-(n + 256) // 8) * 8  # 8-byte aligned data

    def add(self, name: str, t: torch.Tensor) -> None:
        if name in self.seen:
            raise ValueError(f"tensor {name!r} written twice")
        if t.dtype not in _ST_DTYPES:
            raise ValueError(f"tensor {name!r}: safetensors has no dtype for {t.dtype}")
        self.seen.add(name)
        n = t.numel() * t.element_size()
        g = self.group(name) if self.group else None
        if ends_shard(bool(self.header), self.size, n, self.max_bytes, g, self.current):
            self.flush()
        self.current = g
        if self.file is None:
            self.reserved = self._room(g)
            self.file = open(self._tmp("safetensors"), "wb")
            self.file.seek(8 + self.reserved)
            if self.writers:
                while len(self.lanes) >= self.writers:  # at most `writers` shards being written
                    pool, last = self.lanes.popleft()
                    last.result()
                    pool.shutdown()
                self.lane = ThreadPoolExecutor(1, thread_name_prefix="shard-write")
        self.header[name] = _entry(t, self.size)
        if self.writers:
            self._write_behind(self.file, t, n)
        else:
            _write_bytes(self.file, t)
        self.size += n
        self.total += n

    def _write_behind(self, f, t: torch.Tensor, n: int) -> None:
        with self.cond:
            while self.inflight and self.inflight + n > self.budget:
                self.cond.wait()
            self.inflight += n

        def write() -> None:
            try:
                _write_bytes(f, t)
            finally:
                with self.cond:
                    self.inflight -= n
                    self.cond.notify_all()

        self.writes.append(self.lane.submit(write))

    def flush(self) -> None:
        if not self.header:
            return
        path = self._tmp("safetensors")
        blob = json.dumps({"__metadata__": {"format": "pt"}, **self.header}, separators=(",", ":")).encode()
        self.last_header = len(blob)
        if self.writers:  # the header, the close and the fsync after the shard's last write, on its thread
            last = self.lane.submit(self._close, self.file, path, blob, self.reserved, self.fsync)
            self.writes.append(last)
            self.lanes.append((self.lane, last))
            self.lane = None
        else:
            self._close(self.file, path, blob, self.reserved, False)
            if self.syncer is not None:
                self.syncs.append(self.syncer.submit(fsync_path, path))
        self.shards.append((path.name, list(self.header)))
        self.header, self.file, self.size = {}, None, 0

    def _close(self, file, path: Path, blob: bytes, reserved: int, fsync: bool) -> None:
        if len(blob) <= reserved:
            file.seek(0)
            file.write(struct.pack("<Q", reserved) + blob + b" " * (reserved - len(blob)))
            file.close()
        else:  # the header outgrew its room: a new file, the header, then the data behind it
            file.close()
            blob += b" " * (-len(blob) % 8)
            moved = path.with_suffix(".data")
            os.replace(path, moved)
            with open(path, "wb") as f, open(moved, "rb") as src:
                f.write(struct.pack("<Q", len(blob)))
                f.write(blob)
                f.flush()
                src.seek(8 + reserved)
                _copy_file(src, f)
            moved.unlink()
            with self.cond:
                self.rewritten += 1
        if fsync:
            fsync_path(path)

    def finish(self) -> dict[str, str]:
        """Name the shards ``model-000NN-of-000MM`` (or ``model.safetensors``), write the index; the
        weight map."""
        self.flush()
        for f in self.writes:  # (the first error of a write-behind thread is raised here)
            f.result()
        for pool, _ in self.lanes:
            pool.shutdown()
        self.lanes.clear()
        if self.syncer is not None:
            for f in self.syncs:
                f.result()
            self.syncer.shutdown()
        n = len(self.shards)
        weight_map: dict[str, str] = {}
        for i, (tmp, names) in enumerate(self.shards):
            final = "model.safetensors" if n == 1 and not self.index else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            (self.out / tmp).rename(self.out / final)
            weight_map.update({k: final for k in names})
        if n > 1 or self.index:
            (self.out / "model.safetensors.index.json").write_text(json.dumps(
                {"metadata": {"total_size": self.total}, "weight_map": weight_map}, indent=2, sort_keys=True))
        return weight_map


def _hub_tensors(name: str, t: torch.Tensor, args: ModelArgs) -> Iterator[tuple[str, torch.Tensor]]:
    """The hub file tensors (float, unquantised) of native tensor ``name``."""
    src = hub_source(name, args)
    if src.kind == "zero":
        return
    if src.kind == "experts":
        for e, n in enumerate(src.names):
            yield n, t[e].t()
    elif src.kind == "wo_a":
        g, n_in, r = t.shape
        yield src.names[0], t.transpose(1, 2).reshape(g * r, n_in)
    elif src.kind == "eh_proj":
        d = t.shape[0]
        yield src.names[0], t[:, :d]
        yield src.names[1], t[:, d:]
    else:
        yield src.names[0], t


def encode_hub(name: str, w: torch.Tensor, target: Target, scheme: Scheme,
                reference: CheckpointReader | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    kind = hub_kind(name)
    scale_name = name[: -len("weight")] + "scale"
    if reference is not None and target == "hub-fp8" and kind in ("fp8", "expert") and reference.scheme == scheme:
        stored = reference.stored_quantised(name)
        if stored is not None and torch.equal(reference.dequantised(name, *stored), w.float()):
            yield from zip((name, scale_name), stored)  # unchanged: the reference's own bytes
            return
    if kind == "i64":
        yield name, w.to(torch.int64)
    elif kind == "f32":
        yield name, w.float()
    elif kind == "bf16" or target == "hub-bf16" or scheme.scale_dtype is None:
        yield name, w.to(torch.bfloat16)
    elif kind == "expert" and scheme.experts == "fp4":
        yield from zip((name, scale_name), quant_fp4(w))
    else:
        yield from zip((name, scale_name), quant_fp8(w, scheme.scale_dtype))


def hub_stream(tensors: Iterable[tuple[str, torch.Tensor]], args: ModelArgs, target: Target, scheme: Scheme,
               reference: CheckpointReader | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """The hub file tensors; with ``reference`` (a hub checkpoint of the same scheme, e.g. the one training
    started from), a quantised tensor whose values are unchanged keeps the reference's bytes (its scales
    included), so re-exporting untrained weights reproduces the published file exactly, whatever scale
    choices its quantiser made where two encodings hold the same values."""
    for name, t in tensors:
        for file_name, w in _hub_tensors(name, t, args):
            yield from encode_hub(file_name, w, target, scheme, reference)


def hf_stream(tensors: Iterable[tuple[str, torch.Tensor]], args: ModelArgs) -> Iterator[tuple[str, torch.Tensor]]:
    """transformers' names and layouts (float32); gate and up experts are fused when both have come."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in tensors:
        src = hf_source(name, args)
        if src.kind == "zero" or (name == "lm_head.weight" and args.tie_embeddings):
            continue
        t = t if t.dtype == torch.int64 else t.float()
        if src.kind in ("fused_gate", "fused_up"):
            slot = pending.setdefault(src.names[0], {})
            slot[src.kind] = t
            if len(slot) == 2:
                del pending[src.names[0]]
                yield src.names[0], torch.cat([slot["fused_gate"].transpose(1, 2), slot["fused_up"].transpose(1, 2)], 1)
        elif src.kind == "fused_down":
            yield src.names[0], t.transpose(1, 2)
        elif src.kind == "wo_a":
            g, n_in, r = t.shape
            yield src.names[0], t.transpose(1, 2).reshape(g * r, n_in)
        else:
            yield src.names[0], t
    if pending:
        raise ValueError(f"experts {sorted(pending)} got only one of their gate / up halves")


def hub_config(args: ModelArgs, vocab: int, target: Target, scheme: Scheme, source: dict | None = None) -> dict:
    """``config.json`` in the published (legacy) form: the source's own when converting a hub checkpoint,
    otherwise derived from ``args``; quantisation keys per ``target``."""
    if source is not None:
        config = dict(source)
    else:
        current = hf_config(args, vocab)
        rate = {"sliding_attention": 0, "compressed_sparse_attention": args.compress_rate_csa,
                "heavily_compressed_attention": args.compress_rate_hca}
        types = args.moe_types
        n_hash = next((i for i, k in enumerate(types) if k != "hash_moe"), len(types))
        if "hash_moe" in types[n_hash:]:
            raise ValueError("the published config has hash-routed layers only as a prefix (num_hash_layers)")
        keep = ("architectures", "model_type", "vocab_size", "hidden_size", "moe_intermediate_size",
                "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "q_lora_rank",
                "num_experts_per_tok", "n_routed_experts", "n_shared_experts", "scoring_func", "norm_topk_prob",
                "routed_scaling_factor", "max_position_embeddings", "rope_theta", "compress_rope_theta",
                "hc_mult", "hc_sinkhorn_iters", "hc_eps", "swiglu_limit", "sliding_window", "o_groups",
                "o_lora_rank", "index_n_heads", "index_head_dim", "index_topk", "num_nextn_predict_layers",
                "rms_norm_eps", "initializer_range", "tie_word_embeddings", "hidden_act", "attention_bias",
                "attention_dropout")
        config = {k: current[k] for k in keep}
        config.update(compress_ratios=[rate[t] for t in args.attention_types] + [0] * args.mtp_layers,
                      num_hash_layers=n_hash, qk_rope_head_dim=args.rope_head_dim, topk_method="noaux_tc")
        if (args.compress_rate_csa, args.compress_rate_hca) != (4, 128):  # the legacy ratios cannot say which is which
            config.update(layer_types=args.attention_types, compress_rates=current["compress_rates"])
        if args.compress_yarn is not None:
            y = args.compress_yarn
            config["rope_scaling"] = {"type": "yarn", "factor": y.factor, "beta_fast": y.beta_fast,
                                      "beta_slow": y.beta_slow,
                                      "original_max_position_embeddings": y.original_max_position_embeddings}
    config["torch_dtype"] = "bfloat16"
    if target == "hub-fp8" and scheme.scale_dtype is not None:
        config["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                         "scale_fmt": "ue8m0", "weight_block_size": [128, 128]}
        config["expert_dtype"] = scheme.experts
    else:
        config.pop("quantization_config", None)
        config.pop("expert_dtype", None)
    return config


M_MMAP_THRESHOLD = -3  # glibc mallopt parameter


@contextmanager
def large_allocations_mapped(threshold: int = 1 << 20):
    """While converting, glibc serves every allocation of ``threshold`` bytes or more by ``mmap``, so a freed
    tensor goes back to the system at once. Otherwise the many shard-sized-and-smaller tensors a conversion
    allocates and frees fragment the heap (measured: hub-fp8 -> hub-bf16 of a 1.17 GB checkpoint peaked at
    3.1 GB instead of 1.7 GB). Afterwards the threshold is 32 MiB (glibc's own upper bound for it) and the
    heap is trimmed. A no-op where there is no glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt, libc.malloc_trim  # noqa: B018 (present: glibc)
    except (OSError, AttributeError):
        yield
        return
    libc.mallopt(M_MMAP_THRESHOLD, threshold)
    try:
        yield
    finally:
        libc.mallopt(M_MMAP_THRESHOLD, 32 << 20)
        libc.malloc_trim(0)


def write_checkpoint(out: Path, tensors: Iterable[tuple[str, torch.Tensor]], args: ModelArgs, vocab: int,
                     target: Target, scheme: Scheme | None = None, source_config: dict | None = None,
                     extra: dict | None = None, max_shard_bytes: int = DEFAULT_SHARD_BYTES,
                     on_weights: Callable[[], None] | None = None,
                     reference: CheckpointReader | None = None, encoded: bool = False,
                     reserve: Callable[[str | None], int | None] | None = None, fsync: bool = False,
                     prefetch: int = 0, writers: int = 0) -> dict[str, str]:
    """Write weights and ``config.json`` into the (existing, empty) directory ``out``; the weight map.
    ``on_weights`` is called after the weights, before the config (a kill point). ``encoded``: ``tensors`` are
    already the target's file tensors (names, dtypes, scales), written as they come. ``reserve``, ``fsync``: see
    :class:`ShardWriter` (and ``writers``: shards written behind the stream, one thread each). ``prefetch``: the
    stream is produced by a background thread up to that many tensors ahead of the writes (reading and converting
    the next tensors while the last are written)."""
    if target not in TARGETS:
        raise ValueError(f"unknown checkpoint target {target!r} (one of {TARGETS})")
    hub = target != "hf"
    shards = ShardWriter(out, max_shard_bytes, published_group if hub else None, index=hub, reserve=reserve,
                         fsync=fsync, writers=writers)
    if target == "hf":
        stream = tensors if encoded else hf_stream(tensors, args)
        config = {**hf_config(args, vocab), "torch_dtype": "float32", "trex_model_config": args.model_dump(mode="json")}
    else:
        if scheme is None and target == "hub-bf16":
            scheme = BF16
        if scheme is None:
            raise ValueError(f"--to {target} needs a quantisation scheme (flash or flash-base)")
        stream = tensors if encoded else hub_stream(tensors, args, target, scheme, reference)
        config = hub_config(args, vocab, target, scheme, source_config)
    with large_allocations_mapped():
        for name, t in (ahead(stream, prefetch) if prefetch else stream):
            shards.add(name, t)
        weight_map = shards.finish()
    if on_weights:
        on_weights()
    write_config(out, config, extra)
    return weight_map


_DONE = object()


def ahead(items: Iterable, depth: int) -> Iterator:
    """``items`` as they come, produced by a background thread at most ``depth`` items ahead of the consumer (its
    exception raised here, in order). Stopping early (an exception in the consumer) stops the producer."""
    q: queue.Queue = queue.Queue(maxsize=max(1, depth))
    stop = threading.Event()

    def produce() -> None:
        try:
            for x in items:
                while not stop.is_set():
                    try:
                        q.put((True, x), timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            q.put((True, _DONE))
        except BaseException as e:  # noqa: BLE001 (re-raised in the consumer)
            q.put((False, e))

    t = threading.Thread(target=produce, daemon=True, name="checkpoint-prefetch")
    t.start()
    try:
        while True:
            ok, x = q.get()
            if not ok:
                raise x
            if x is _DONE:
                return
            yield x
    finally:
        stop.set()
        t.join()


def ordered_map(fn: Callable, items: Iterable, workers: int, depth: int) -> Iterator:
    """``fn(item)`` for each item, in order, computed by ``workers`` threads at most ``depth`` items ahead (torch
    ops and file reads release the GIL)."""
    if workers <= 1:
        yield from map(fn, items)
        return
    pending: deque = deque()
    with ThreadPoolExecutor(workers, thread_name_prefix="checkpoint-convert") as pool:
        try:
            for item in items:
                pending.append(pool.submit(fn, item))
                if len(pending) >= max(depth, workers):
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:
            for f in pending:
                f.cancel()
