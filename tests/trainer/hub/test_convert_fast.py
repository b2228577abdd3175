"""The conversion pipeline's parts: tensors converted by parallel workers and written behind a reserved header,
shards flushed in the background -- the same bytes whichever way it runs."""

from __future__ import annotations

import json
import struct
import threading
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from trainer.hub.convert import convert, source_header_bytes
from trainer.hub.fixture import write_hub_checkpoint
from trainer.hub.reader import CheckpointReader
from trainer.hub.writer import ShardWriter, ahead, ordered_map, published_group


def tensors(d: Path) -> dict[str, tuple[torch.dtype, tuple, bytes]]:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            for k in h.keys():
                t = h.get_tensor(k)
                out[k] = (t.dtype, tuple(t.shape), t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return out


@pytest.fixture(scope="module")
def flash(tmp_path_factory):
    return write_hub_checkpoint(tmp_path_factory.mktemp("hub") / "flash", "flash")


@pytest.mark.parametrize("to, scheme", [("hub-bf16", None), ("hub-fp8", None), ("hub-fp8", "flash-base"), ("hf", None)])
def test_workers_and_fsync_change_nothing(flash, tmp_path, to, scheme):
    """One worker with fsync, three without: the same tensors, bit for bit, in the same shards; a pass-through
    hub-fp8 keeps every source tensor's bytes."""
    a = convert(flash, tmp_path / "a", to, scheme, workers=1, fsync=True, direct=False)
    b = convert(flash, tmp_path / "b", to, scheme, workers=3, fsync=False, direct=False)
    assert (a["workers"], b["workers"], a["fsync"], b["fsync"]) == (1, 3, True, False)
    ta, tb = tensors(tmp_path / "a"), tensors(tmp_path / "b")
    assert ta == tb and len(ta) == a["tensors"]
    index = tmp_path / "a" / "model.safetensors.index.json"
    if index.exists():
        assert index.read_text() == (tmp_path / "b" / "model.safetensors.index.json").read_text()
    if to == "hub-fp8" and scheme is None:
        assert ta == tensors(flash)


def test_hub_conversion_reserves_the_source_headers_room(flash, tmp_path):
    """Each hub-bf16 shard's header sits in the room of its source shard's header (the data written once, behind
    it): the header length field is the source's plus slack, 8-byte aligned, the rest padded with spaces. (The
    general path: ``direct=False``; the direct one knows each header first, tests/trainer/hub/test_convert_direct.py.)"""
    with CheckpointReader(flash) as r:
        room = source_header_bytes(r)
    convert(flash, tmp_path / "out", "hub-bf16", direct=False)
    weight_map = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(weight_map.values())) == len(room)
    for shard in sorted(set(weight_map.values())):
        group = published_group(next(k for k, f in weight_map.items() if f == shard))
        with open(tmp_path / "out" / shard, "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            blob = f.read(n)
        assert n == -(-(room[group] + 256) // 8) * 8, shard
        assert blob.endswith(b" ") and set(json.loads(blob)) - {"__metadata__"} == \
            {k for k, f in weight_map.items() if f == shard}


def test_shard_writer_header_outgrowing_its_room_is_rewritten(tmp_path):
    """A header larger than the room reserved for it goes in front of the data in a new file: same tensors."""
    w = ShardWriter(tmp_path, max_bytes=1 << 20, group=lambda n: n.split(".")[0], index=True,
                    reserve=lambda g: 16 if g == "a" else None, fsync=True)
    ts = {f"a.{i}": torch.full((3, i + 1), float(i)) for i in range(40)} | {"b.x": torch.arange(7)}
    for k, t in ts.items():
        w.add(k, t)
    weight_map = w.finish()
    assert w.rewritten == 1 and sorted(p.name for p in tmp_path.iterdir() if p.suffix != ".json") == [
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    back = {}
    for f in set(weight_map.values()):
        with safe_open(str(tmp_path / f), "pt") as h:
            back.update({k: h.get_tensor(k) for k in h.keys()})
    assert back.keys() == ts.keys() and all(torch.equal(back[k], t) for k, t in ts.items())


@pytest.mark.parametrize("budget", [1, 1 << 20])
def test_write_behind_shards_are_the_same_bytes(tmp_path, budget):
    """writers=2 (one thread per shard file, two shards at once, a tiny or a roomy in-flight budget) writes the
    very bytes writers=0 does, the rewritten-header path and fsync included."""
    g = torch.Generator().manual_seed(0)
    ts = {f"{grp}.{i}": torch.randn(17, i + 1, generator=g) for grp in "abcde" for i in range(30)}
    out = {}
    for writers in (0, 2):
        d = tmp_path / f"w{writers}"
        d.mkdir()
        w = ShardWriter(d, max_bytes=20_000, group=lambda n: n.split(".")[0], index=True,
                        reserve=lambda grp: 16 if grp == "c" else None, fsync=True, writers=writers,
                        inflight_bytes=budget)
        for k, t in ts.items():
            w.add(k, t)
        out[writers] = (w.finish(), w.rewritten, {f.name: f.read_bytes() for f in sorted(d.iterdir())})
    assert out[0][0] == out[2][0] and out[0][1] == out[2][1] >= 1
    assert out[0][2] == out[2][2] and len(out[0][2]) > 6


def test_ahead_keeps_order_and_raises_in_the_consumer():
    assert list(ahead(iter(range(50)), 3)) == list(range(50))

    def broken():
        yield 1
        raise KeyError("no such tensor")

    got = []
    with pytest.raises(KeyError, match="no such tensor"):
        for x in ahead(broken(), 2):
            got.append(x)
    assert got == [1]
    before = threading.active_count()
    for x in ahead(iter(range(10**6)), 2):  # the consumer stops early: the producer stops too
        if x == 3:
            break
    assert threading.active_count() == before


def test_ordered_map_keeps_order_and_raises():
    assert list(ordered_map(lambda x: x * x, range(30), workers=3, depth=4)) == [x * x for x in range(30)]

    def f(x):
        if x == 5:
            raise ValueError("tensor 5")
        return x

    with pytest.raises(ValueError, match="tensor 5"):
        list(ordered_map(f, range(10), workers=2, depth=2))
