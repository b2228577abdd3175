"""The reader's plain-read path (``pread_tensor``, used for every contiguous run of rows instead of a mapped
``safe_open`` slice) returns exactly what safetensors does, for every stored dtype and odd shapes, and a
truncated shard is an error naming the file."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from trainer.hub.quant import E8M0, FP8
from trainer.hub.reader import CheckpointError, _row_range, pread_tensor, read_header


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _tensors(g: torch.Generator) -> dict[str, torch.Tensor]:
    return {
        "f32": torch.randn(7, 5, generator=g),
        "bf16": torch.randn(3, 129, generator=g).bfloat16(),
        "fp8": (torch.randn(130, 17, generator=g) * 50).to(FP8),
        "e8m0": torch.randint(100, 140, (2, 3), generator=g, dtype=torch.uint8).view(E8M0),
        "i8": torch.randint(-128, 128, (5, 16), generator=g, dtype=torch.int8),
        "i64": torch.randint(0, 1 << 40, (11,), generator=g),
        "scalar": torch.tensor(2.5),
        "stack": torch.randn(4, 3, 2, generator=g),
    }


def test_plain_reads_equal_safetensors(tmp_path):
    g = torch.Generator().manual_seed(0)
    path = tmp_path / "x.safetensors"
    ts = _tensors(g)
    save_file(ts, str(path))
    header = read_header(path)
    assert set(header) == set(ts)
    with safe_open(str(path), framework="pt") as f:
        for name, t in ts.items():
            h = header[name]
            shape = list(h["shape"])
            full = pread_tensor(path, h["start"], t.dtype, shape)
            assert full.dtype == t.dtype and full.shape == t.shape and torch.equal(_bytes(full), _bytes(t)), name
            if not shape:
                continue
            for lo, hi in ((0, shape[0]), (1, shape[0]), (shape[0] // 2, shape[0] // 2 + 1)):
                idx = [slice(lo, hi)] + [slice(0, d) for d in shape[1:]]
                assert _row_range(idx, shape) == (lo, hi)
                row_bytes = t[0].numel() * t.element_size()
                got = pread_tensor(path, h["start"] + lo * row_bytes, t.dtype, [hi - lo] + shape[1:])
                want = f.get_slice(name)[tuple(idx)]
                assert torch.equal(_bytes(got), _bytes(want)), (name, lo, hi)


def test_row_range_only_for_contiguous_runs():
    assert _row_range([slice(0, 4), slice(0, 3)], [4, 3]) == (0, 4)
    assert _row_range([slice(0, 4), slice(1, 3)], [4, 3]) is None  # a column slice is strided in the file
    assert _row_range([slice(0, 4, 2), slice(0, 3)], [4, 3]) is None
    assert _row_range([slice(1, 2), slice(0, 3), slice(0, 2)], [4, 3, 2]) == (1, 2)
    assert _row_range([slice(1, 2), slice(0, 3), slice(0, 1)], [4, 3, 2]) is None


def test_truncated_shard_names_the_file(tmp_path):
    path = tmp_path / "cut.safetensors"
    save_file({"w": torch.randn(64, 64)}, str(path))
    h = read_header(path)["w"]
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])
    with pytest.raises(CheckpointError, match=r"cut\.safetensors: file ends 100 bytes short"):
        pread_tensor(path, h["start"], torch.float32, [64, 64])


def test_shard_writer_streams_tensors_into_shards(tmp_path):
    """``ShardWriter`` writes each tensor at once (a body file per open shard, the header put in front when it
    ends): the shards load back bit for bit, split by group and size, no body file is left behind."""
    from safetensors.torch import load_file

    from trainer.hub.writer import ShardWriter

    g = torch.Generator().manual_seed(1)
    ts = {"a.x": torch.randn(3, 4, generator=g), "a.y": (torch.randn(130, 17, generator=g) * 9).to(FP8),
          "b.x": torch.randint(0, 9, (5,), generator=g), "b.y": torch.randn(64, 64, generator=g).bfloat16(),
          "b.z": torch.tensor(1.5)}
    w = ShardWriter(tmp_path, max_bytes=64 * 64 * 2 + 40, group=lambda n: n.split(".")[0], index=True)
    for name, t in ts.items():
        w.add(name, t.clone())
    weight_map = w.finish()
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors", "model-00003-of-00003.safetensors",
        "model.safetensors.index.json"]
    assert weight_map == {"a.x": "model-00001-of-00003.safetensors", "a.y": "model-00001-of-00003.safetensors",
                          "b.x": "model-00002-of-00003.safetensors", "b.y": "model-00002-of-00003.safetensors",
                          "b.z": "model-00003-of-00003.safetensors"}
    back = {}
    for f in set(weight_map.values()):
        back.update(load_file(str(tmp_path / f)))
    for name, t in ts.items():
        assert back[name].dtype == t.dtype and torch.equal(_bytes(back[name]), _bytes(t)), name
    with pytest.raises(ValueError, match="written twice"):
        w.add("a.x", ts["a.x"])


def test_native_shapes_equal_the_model_built_plainly_on_meta():
    """The shapes-only build (initialisers skipped, position tables on the CPU) names the same tensors, shapes and
    dtypes as a plain meta build of the model."""
    from trainer.hub.fixture import hub_config
    from trainer.hub.reader import native_shapes
    from trainer.models.deepseek_v4.model import Transformer
    from trainer.models.deepseek_v4.state_dict_adapter import model_config_from_hf

    args, vocab = model_config_from_hf(hub_config("flash"))
    with torch.device("meta"):
        plain = {k: (v.shape, v.dtype) for k, v in Transformer(args, vocab).state_dict().items()}
    assert native_shapes(args, vocab) == plain and len(plain) > 50
