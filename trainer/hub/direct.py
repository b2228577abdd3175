"""Hub-to-hub conversion at disk speed: dequantised straight into reused I/O buffers, written with ``O_DIRECT``.

The general path (:func:`trainer.hub.writer.write_checkpoint`) hands the writer a fresh tensor per file tensor and
lets the page cache take the output. On a VM whose freed memory goes back to the host, every fresh page costs a
fault into the hypervisor the first time it is touched: a 3.6 GB hub-bf16 output meant 3.6 GB of fresh tensors and
3.6 GB of fresh page cache, and that, not the dequantisation (10-40 GB/s here), bounded the conversion. This path
touches no fresh memory per tensor:

- the source shards are mapped (their page-cache pages are read in place; ``MADV_WILLNEED`` starts the disk
  read of a cold shard ahead of the kernel that consumes it);
- every output tensor is produced into a ring of page-aligned buffers allocated once (``dequant_mxfp4`` /
  ``dequant_fp8`` write bf16 straight into them, row chunk by row chunk; stored tensors are copied or cast in);
- a writer thread writes each full buffer with ``O_DIRECT`` (no page cache: the bytes go from the buffer to the
  device) while the next is filled; a file's last, partial block is written padded and the file truncated to its
  size. Where ``O_DIRECT`` is refused (tmpfs, a platform without it) the same buffers are written through the page
  cache.

Every output header is known before its shard is written (each target tensor's dtype and shape follow from the
source's), padded with spaces (safetensors' padding) so that the data starts on a 4 KiB boundary. Shard
boundaries, tensor order and bytes are the general path's (:func:`plan_shards` applies :class:`ShardWriter`'s
rule): only the header's padding differs.

It covers what a hub-to-hub conversion can write without re-quantising: ``hub-bf16`` from any hub checkpoint, and
``hub-fp8`` in the source's own scheme (the stored codes and scales copied). Anything else (re-quantisation, an
adapter to merge, the ``hf`` layout) takes the general path: :func:`hub_pieces` returns None.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import queue
import struct
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from kernels.dequant import dequant_fp8, dequant_mxfp4
from trainer.hub.names import hub_kind
from trainer.hub.reader import _DTYPES, CheckpointError, CheckpointReader, Scheme
from trainer.hub.writer import _ST_DTYPES, Target, ends_shard, published_group, write_config

ALIGN = 4096  # the largest logical block size O_DIRECT asks offsets, lengths and buffers to be aligned to
BUFFER_BYTES = 16 << 20  # (16 MB x 4 vs 32 x 3, 8 x 6, 4 x 8 here: 1.71 vs 1.82, 1.78, 1.95 s, medians of 3)
BUFFERS = 4
FP8_BLOCK = 128


@dataclass(frozen=True)
class Piece:
    """One output tensor and how it is made from the source: ``copy`` (the stored bytes), ``cast`` (the stored
    values in ``dtype``), ``fp8`` / ``fp4`` (the stored codes times their scales, in bfloat16)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    how: str
    file: str
    start: int  # the source file offset of the stored tensor (the codes)
    stored: torch.dtype
    scale_start: int = 0
    scale_dtype: torch.dtype | None = None
    scale_shape: tuple[int, ...] = ()

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def stored_bytes(self) -> int:
        """The stored tensor's bytes in the source (codes: one byte per FP8 value, one per two MXFP4 values)."""
        n = math.prod(self.shape)
        return {"fp8": n, "fp4": n // 2}.get(self.how, n * self.stored.itemsize)

    @property
    def scale_bytes(self) -> int:
        return math.prod(self.scale_shape) * self.scale_dtype.itemsize if self.scale_dtype else 0


def hub_pieces(reader: CheckpointReader, names: list[str], to: Target, scheme: Scheme,
               reference: CheckpointReader | None) -> list[Piece] | None:
    """The output tensors of a hub-to-hub conversion of file tensors ``names`` (in order), or None where one of them
    needs the general path (re-quantisation)."""
    if reader.format != "hub" or to not in ("hub-bf16", "hub-fp8"):
        return None
    if to == "hub-fp8" and (reference is not reader or scheme != reader.scheme):
        return None
    out: list[Piece] = []
    for name in names:
        h, file = reader.headers[name], reader.files[name]
        stored = _DTYPES[h["dtype"]]
        kind = hub_kind(name)
        scale = name[: -len("weight")] + "scale"
        if kind in ("bf16", "f32", "i64") or scale not in reader.headers:
            if kind in ("fp8", "expert") and to == "hub-fp8" and reader.scheme.scale_dtype is not None:
                return None  # (a quantised layout whose weight has no scale: the reader's validation names it)
            want = {"i64": torch.int64, "f32": torch.float32}.get(kind, torch.bfloat16)
            if not want.is_floating_point and stored != want:
                return None
            out.append(Piece(name, want, tuple(h["shape"]), "copy" if stored == want else "cast", file, h["start"],
                             stored))
            continue
        s = reader.headers[scale]
        sdt = _DTYPES[s["dtype"]]
        if to == "hub-fp8":  # the source's own codes and scales, as stored
            out.append(Piece(name, stored, tuple(h["shape"]), "copy", file, h["start"], stored))
            out.append(Piece(scale, sdt, tuple(s["shape"]), "copy", reader.files[scale], s["start"], sdt))
            continue
        if reader.files[scale] != file:
            return None  # a scale in another shard than its codes: the general path reads it
        r, c = h["shape"]
        if stored == torch.int8:
            out.append(Piece(name, torch.bfloat16, (r, 2 * c), "fp4", file, h["start"], stored, s["start"], sdt,
                             tuple(s["shape"])))
        elif stored == torch.float8_e4m3fn:
            out.append(Piece(name, torch.bfloat16, (r, c), "fp8", file, h["start"], stored, s["start"], sdt,
                             tuple(s["shape"])))
        else:
            return None
    return out


def plan_shards(pieces: list[Piece], max_bytes: int) -> list[list[Piece]]:
    """The pieces split into shards as :class:`trainer.hub.writer.ShardWriter` splits a hub stream: a new shard when
    the next tensor's published group differs or it would take the shard past ``max_bytes``."""
    shards: list[list[Piece]] = [[]]
    size, group = 0, None
    for p in pieces:
        g = published_group(p.name)
        if ends_shard(bool(shards[-1]), size, p.nbytes, max_bytes, g, group):
            shards.append([])
            size = 0
        group = g
        shards[-1].append(p)
        size += p.nbytes
    return shards if shards[-1] else shards[:-1]


def header_bytes(pieces: list[Piece]) -> bytes:
    """The shard's safetensors prefix (length + JSON), padded with spaces so that its data starts at a multiple of
    :data:`ALIGN`."""
    entries, off = {"__metadata__": {"format": "pt"}}, 0
    for p in pieces:
        entries[p.name] = {"dtype": _ST_DTYPES[p.dtype], "shape": list(p.shape), "data_offsets": [off, off + p.nbytes]}
        off += p.nbytes
    blob = json.dumps(entries, separators=(",", ":")).encode()
    n = -(-(8 + len(blob)) // ALIGN) * ALIGN - 8
    return struct.pack("<Q", n) + blob + b" " * (n - len(blob))


class DirectWriter:
    """Files written one after another, sequentially, through a ring of ``buffers`` page-aligned buffers of
    ``buffer_bytes``: the caller fills the current buffer (:meth:`space`, then :meth:`advance`); a full one is
    written by the writer thread (``O_DIRECT`` where the file system takes it) while the next fills. A write's
    error is raised at the caller's next call."""

    def __init__(self, buffer_bytes: int = BUFFER_BYTES, buffers: int = BUFFERS, direct: bool = True):
        self.size = buffer_bytes // ALIGN * ALIGN
        self.maps = [mmap.mmap(-1, self.size + ALIGN) for _ in range(max(2, buffers))]  # (+ a padded last block)
        self.views = [torch.frombuffer(m, dtype=torch.uint8) for m in self.maps]
        self.direct = direct and hasattr(os, "O_DIRECT")
        self.direct_files = 0
        self.free: queue.Queue = queue.Queue()
        for i in range(len(self.maps)):
            self.free.put(i)
        self.jobs: queue.Queue = queue.Queue()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True, name="direct-write")
        self.thread.start()
        self.fd, self.cur, self.fill, self.offset = None, None, 0, 0

    # ----------------------------------------------------------------------------------------- the writer thread
    def _run(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            try:
                if self.error is None:
                    self._do(job)
            except BaseException as e:  # noqa: BLE001 (raised in the caller)
                self.error = e
            finally:
                if job[0] == "write":
                    self.free.put(job[2])

    def _do(self, job: tuple) -> None:
        if job[0] == "write":
            _, fd, i, n, offset = job
            view, done = memoryview(self.maps[i])[:n], 0
            while done < n:
                done += os.pwrite(fd, view[done:], offset + done)
        else:  # ("close", fd, size, fsync)
            _, fd, size, fsync = job
            try:
                os.ftruncate(fd, size)
                if fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)

    def _check(self) -> None:
        if self.error is not None:
            raise self.error

    # ------------------------------------------------------------------------------------------------ the caller
    def open(self, path: Path) -> None:
        self._check()
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        fd = None
        if self.direct:
            try:
                fd = os.open(path, flags | os.O_DIRECT, 0o644)
                self.direct_files += 1
            except OSError:  # (EINVAL: this file system has no O_DIRECT)
                fd = None
        self.fd = fd if fd is not None else os.open(path, flags, 0o644)
        self.cur, self.fill, self.offset = self.free.get(), 0, 0

    def _submit(self, final: bool) -> None:
        """Hand the current buffer to the writer: all of it padded to a block (``final``), else its whole blocks,
        the rest carried to the start of the next buffer."""
        n = -(-self.fill // ALIGN) * ALIGN if final else self.fill // ALIGN * ALIGN
        self.jobs.put(("write", self.fd, self.cur, n, self.offset))
        self.offset += n
        if final:
            self.cur, self.fill = None, 0
            return
        nxt = self.free.get()
        tail = self.fill - n
        if tail:
            self.views[nxt][:tail].copy_(self.views[self.cur][n:self.fill])
        self.cur, self.fill = nxt, tail
        self._check()

    def space(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` (at most the buffer size less a block) of the current buffer to fill, as uint8."""
        if nbytes > self.size - ALIGN:
            raise ValueError(f"a piece of {nbytes} bytes does not fit a {self.size}-byte I/O buffer")
        if self.fill + nbytes > self.size:
            self._submit(final=False)
        return self.views[self.cur][self.fill:self.fill + nbytes]

    def advance(self, nbytes: int) -> None:
        self.fill += nbytes

    def write(self, data: torch.Tensor) -> None:
        """Bytes (a uint8 tensor of any length) copied in."""
        data, done = data.reshape(-1), 0
        while done < data.numel():
            k = min(data.numel() - done, self.size - ALIGN)
            self.space(k).copy_(data[done:done + k])
            self.advance(k)
            done += k

    def close(self, fsync: bool) -> None:
        """The file's last bytes written, then (on the writer thread, in order) truncated to its size, fsynced if
        asked, closed."""
        size = self.offset + self.fill
        self._submit(final=True)
        self.jobs.put(("close", self.fd, size, fsync))
        self.fd = None

    def finish(self, failed: bool = False) -> None:
        """Wait for every write; raise the first error (``failed``: the caller is raising its own; a file it left
        open is closed)."""
        if self.fd is not None:
            self.jobs.put(("close", self.fd, self.offset, False))
            self.fd = None
        self.jobs.put(None)
        self.thread.join()
        if not failed:
            self._check()


class SourceMaps:
    """The source shards mapped, at most ``keep`` at once (the longest unused unmapped first); :meth:`release` drops
    the pages of a region read (``MADV_DONTNEED``: they stay in the page cache, out of this process's RSS)."""

    def __init__(self, root: Path, keep: int = 2):
        self.root, self.keep, self.open_maps = root, keep, {}

    def region(self, file: str, start: int, nbytes: int, what: str) -> torch.Tensor:
        m = self.open_maps.pop(file, None)
        if m is None:
            with open(self.root / file, "rb") as f:
                m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if os.fstat(f.fileno()).st_size else None
            if m is not None and hasattr(mmap, "MADV_WILLNEED"):
                m.madvise(mmap.MADV_WILLNEED)
            m = (m, torch.frombuffer(m, dtype=torch.uint8) if m is not None else torch.empty(0, dtype=torch.uint8))
        self.open_maps[file] = m  # (most recently used last)
        while len(self.open_maps) > self.keep:
            self._drop(next(iter(self.open_maps)))
        if start + nbytes > m[1].numel():
            raise CheckpointError(f"{self.root / file}: file ends {start + nbytes - m[1].numel()} bytes short of "
                                  f"tensor {what!r}")
        return m[1][start:start + nbytes]

    def release(self, file: str, start: int, nbytes: int) -> None:
        m = self.open_maps.get(file)
        if m is None or m[0] is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        lo = start // mmap.PAGESIZE * mmap.PAGESIZE
        hi = min(len(m[0]), -(-(start + nbytes) // mmap.PAGESIZE) * mmap.PAGESIZE)
        if hi > lo:  # (a private, never-written mapping: dropping its pages loses nothing)
            m[0].madvise(mmap.MADV_DONTNEED, lo, hi - lo)

    def _drop(self, file: str) -> None:
        m, view = self.open_maps.pop(file)
        del view
        if m is not None:
            m.close()

    def close(self) -> None:
        for f in list(self.open_maps):
            self._drop(f)


def _fill(piece: Piece, src: SourceMaps, out: DirectWriter) -> None:
    """Produce ``piece`` into the writer's buffers, a row chunk at a time; then its source pages released."""
    _produce(piece, src, out)
    src.release(piece.file, piece.start, piece.stored_bytes)
    if piece.scale_dtype is not None:
        src.release(piece.file, piece.scale_start, piece.scale_bytes)


def _produce(piece: Piece, src: SourceMaps, out: DirectWriter) -> None:
    numel = math.prod(piece.shape)
    if piece.how == "copy":
        out.write(src.region(piece.file, piece.start, piece.stored_bytes, piece.name))
        return
    if piece.how == "cast":
        values = src.region(piece.file, piece.start, piece.stored_bytes, piece.name).view(piece.stored)
        per = max(1, (out.size - ALIGN) // piece.dtype.itemsize)
        for i in range(0, numel, per):
            k = min(per, numel - i)
            out.space(k * piece.dtype.itemsize).view(piece.dtype).copy_(values[i:i + k])
            out.advance(k * piece.dtype.itemsize)
        return
    r, c = piece.shape
    code_row = c // 2 if piece.how == "fp4" else c
    codes = src.region(piece.file, piece.start, piece.stored_bytes, piece.name)
    scale = src.region(piece.file, piece.scale_start, piece.scale_bytes,
                       piece.name[: -len("weight")] + "scale").view(piece.scale_dtype).view(piece.scale_shape)
    row_bytes = c * 2
    unit = 1 if piece.how == "fp4" else FP8_BLOCK  # an FP8 chunk starts on a scale block row
    rows = max(unit, (out.size - ALIGN) // row_bytes // unit * unit)
    if rows * row_bytes > out.size - ALIGN:
        raise ValueError(f"{piece.name}: {unit} rows of {row_bytes} bytes do not fit a {out.size}-byte I/O buffer")
    for r0 in range(0, r, rows):
        k = min(rows, r - r0)
        dst = out.space(k * row_bytes).view(torch.bfloat16).view(k, c)
        q = codes[r0 * code_row:(r0 + k) * code_row]
        if piece.how == "fp4":
            dequant_mxfp4(q.view(torch.int8).view(k, code_row), scale[r0:r0 + k], torch.bfloat16, out=dst)
        else:
            b0, b1 = r0 // FP8_BLOCK, -(-(r0 + k) // FP8_BLOCK)
            dequant_fp8(q.view(torch.float8_e4m3fn).view(k, c), scale[b0:b1], torch.bfloat16, out=dst)
        out.advance(k * row_bytes)


def write_direct(reader: CheckpointReader, out_dir: Path, pieces: list[Piece], max_shard_bytes: int,
                 fsync: bool, direct: bool = True, buffer_bytes: int = BUFFER_BYTES) -> tuple[dict[str, str], dict]:
    """Write ``pieces`` as sharded safetensors into ``out_dir`` (named and indexed as the general path names them);
    the weight map and a summary (``direct_io``: the shards written with O_DIRECT)."""
    shards = plan_shards(pieces, max_shard_bytes)
    n = len(shards)
    weight_map: dict[str, str] = {}
    fp8_chunk = max((FP8_BLOCK * p.shape[1] * 2 for p in pieces if p.how == "fp8"), default=0)
    writer = DirectWriter(max(buffer_bytes, fp8_chunk + 2 * ALIGN), direct=direct)  # (an FP8 chunk: 128 rows)
    src = SourceMaps(reader.root)
    try:
        for i, shard in enumerate(shards):
            name = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            writer.open(out_dir / name)
            writer.write(torch.frombuffer(bytearray(header_bytes(shard)), dtype=torch.uint8))
            for p in shard:
                _fill(p, src, writer)
                reader.bytes_read += p.stored_bytes + p.scale_bytes
                weight_map[p.name] = name
            writer.close(fsync)
    except BaseException:
        src.close()
        writer.finish(failed=True)
        raise
    src.close()
    writer.finish()
    total = sum(p.nbytes for p in pieces)
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2, sort_keys=True))
    return weight_map, {"direct_io": writer.direct_files == n and n > 0}
