"""The direct conversion path (``trainer/hub/direct.py``): dequantised into reused buffers, written with O_DIRECT --
the same tensors, shards, index and config as the general path, whatever the buffer size, the file system or the
scheme; bad sources and failed writes named, never a hang."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
import torch

from trainer.hub import direct as direct_mod
from trainer.hub.convert import convert, hub_file_names
from trainer.hub.direct import ALIGN, DirectWriter, hub_pieces, plan_shards, write_direct
from trainer.hub.fixture import write_hub_checkpoint
from trainer.hub.reader import SCHEMES, CheckpointError, CheckpointReader
from trainer.hub.writer import published_group

from tests.trainer.hub.test_convert_fast import tensors


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("direct")
    # odd widths: rows of the MXFP4 experts and FP8 blocks not a multiple of 128 (a partial last scale block row)
    odd = {"hidden_size": 160, "moe_intermediate_size": 96, "vocab_size": 331}
    return {"flash": write_hub_checkpoint(root / "flash", "flash", odd, max_shard_bytes=40_000),
            "flash-base": write_hub_checkpoint(root / "base", "flash-base", odd)}


def o_direct_works(d: Path) -> bool:
    try:
        os.close(os.open(d / "probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644))
        return True
    except (OSError, AttributeError):
        return False


def _meta(d: Path) -> tuple[str, dict]:
    cfg = json.loads((d / "config.json").read_text())
    cfg["trex_provenance"].pop("source", None)
    return (d / "model.safetensors.index.json").read_text(), cfg


@pytest.mark.parametrize("variant, to", [("flash", "hub-bf16"), ("flash", "hub-fp8"), ("flash-base", "hub-bf16"),
                                         ("flash-base", "hub-fp8")])
def test_direct_equals_the_general_path(sources, tmp_path, variant, to):
    """Tensors bit for bit, shard boundaries, index and config.json as the general path writes them; every shard's
    data starts on a 4 KiB boundary; a pass-through hub-fp8 keeps the source's bytes."""
    src = sources[variant]
    a = convert(src, tmp_path / "direct", to, max_shard_bytes=30_000)
    b = convert(src, tmp_path / "general", to, max_shard_bytes=30_000, direct=False)
    assert a["direct_io"] == o_direct_works(tmp_path) and b["direct_io"] is False and a["bytes_read"] == b["bytes_read"]
    ta = tensors(tmp_path / "direct")
    assert ta == tensors(tmp_path / "general") and len(ta) == a["tensors"] and a["shards"] == b["shards"] > 2
    assert _meta(tmp_path / "direct") == _meta(tmp_path / "general")
    for f in (tmp_path / "direct").glob("*.safetensors"):
        with open(f, "rb") as h:
            assert (8 + struct.unpack("<Q", h.read(8))[0]) % ALIGN == 0, f.name
    if to == "hub-fp8":
        assert ta == tensors(src)


@pytest.mark.parametrize("buffer_bytes, direct", [(3 * ALIGN, True), (5 * ALIGN + 0, False), (64 << 10, True)])
def test_any_buffer_size_and_either_write_mode_give_the_same_bytes(sources, tmp_path, buffer_bytes, direct):
    """Buffers of a few blocks (every tensor split into row chunks, the unaligned tail of each write carried into
    the next buffer) and buffered writes instead of O_DIRECT: the same files as the default."""
    src = sources["flash"]
    convert(src, tmp_path / "want", "hub-bf16")
    with CheckpointReader(src) as r:
        pieces = hub_pieces(r, list(hub_file_names(r)), "hub-bf16", SCHEMES["bf16"], r)
        out = tmp_path / "got"
        out.mkdir()
        write_direct(r, out, pieces, 4 << 30, fsync=False, direct=direct, buffer_bytes=buffer_bytes)
    for f in (tmp_path / "want").glob("*.safetensors"):
        assert (out / f.name).read_bytes() == f.read_bytes(), f.name


def test_requantisation_takes_the_general_path(sources, tmp_path):
    with CheckpointReader(sources["flash"]) as r:
        assert hub_pieces(r, list(hub_file_names(r)), "hub-fp8", SCHEMES["flash-base"], r) is None
        assert hub_pieces(r, list(hub_file_names(r)), "hf", SCHEMES["flash"], r) is None
    s = convert(sources["flash"], tmp_path / "o", "hub-fp8", "flash-base")
    assert s["direct_io"] is False


def test_plan_shards_follows_groups_and_size(sources):
    with CheckpointReader(sources["flash"]) as r:
        pieces = hub_pieces(r, list(hub_file_names(r)), "hub-bf16", SCHEMES["bf16"], r)
    shards = plan_shards(pieces, 1 << 40)
    groups = [{published_group(p.name) for p in s} for s in shards]
    assert all(len(g) == 1 for g in groups[1:-2])  # one published group per shard
    assert sum(len(s) for s in shards) == len(pieces)
    small = plan_shards(pieces, 20_000)
    assert len(small) > len(shards) and all(sum(p.nbytes for p in s) <= 20_000 or len(s) == 1 for s in small)


def test_a_truncated_source_shard_is_named(sources, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for f in sources["flash"].iterdir():
        (src / f.name).write_bytes(f.read_bytes())
    victim = sorted(src.glob("model-*.safetensors"))[1]
    with open(victim, "r+b") as f:
        f.truncate(os.path.getsize(victim) - 100)
    with pytest.raises(CheckpointError, match=rf"{victim.name}: file ends \d+ bytes short of tensor"):
        convert(src, tmp_path / "out", "hub-bf16")
    assert not (tmp_path / "out").exists()


def test_a_failed_write_is_raised_not_hung(sources, tmp_path, monkeypatch):
    calls = {"n": 0}
    real = os.pwrite

    def failing(fd, data, offset):
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError(28, "No space left on device")
        return real(fd, data, offset)

    monkeypatch.setattr(direct_mod.os, "pwrite", failing)
    with CheckpointReader(sources["flash"]) as r:
        pieces = hub_pieces(r, list(hub_file_names(r)), "hub-bf16", SCHEMES["bf16"], r)
        (tmp_path / "o").mkdir()
        with pytest.raises(OSError, match="No space left"):
            write_direct(r, tmp_path / "o", pieces, 30_000, fsync=False, buffer_bytes=2 * ALIGN)


def test_writer_refuses_a_piece_larger_than_its_buffer(tmp_path):
    w = DirectWriter(2 * ALIGN)
    w.open(tmp_path / "f")
    with pytest.raises(ValueError, match="does not fit"):
        w.space(2 * ALIGN)
    w.write(torch.arange(10_000, dtype=torch.int64).view(torch.uint8))  # any length goes through write()
    w.close(fsync=True)
    w.finish()
    assert (tmp_path / "f").read_bytes() == torch.arange(10_000, dtype=torch.int64).numpy().tobytes()
