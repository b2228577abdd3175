"""``trex convert``, ``trex model-info --checkpoint`` and ``trex hub-fixture`` (typer's CliRunner, in process)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from trainer.hub.fixture import PUBLISHED_DIR, write_hub_checkpoint
from trainer.hub.reader import CheckpointReader, load_model
from trex.cli.main import app

runner = CliRunner()


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def fixture_dir(tmp_path_factory):
    return write_hub_checkpoint(tmp_path_factory.mktemp("hub") / "flash", "flash")


def read_all(path: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        for name, t in load_file(str(f)).items():
            assert name not in out
            out[name] = t
    return out


def same_tensors(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
        and torch.equal(a[k].contiguous().view(torch.uint8), b[k].contiguous().view(torch.uint8)) for k in a)


def last_json(output: str) -> dict:
    return json.loads(output.strip().splitlines()[-1])


def flat(text: str) -> str:
    """Without whitespace: rich wraps long error lines at the console width."""
    return re.sub(r"\s+", "", text)


# ---------------------------------------------------------------------------------------- convert
def test_convert_round_trip(fixture_dir, tmp_path):
    hf = tmp_path / "hf"
    res = runner.invoke(app, ["convert", str(fixture_dir), str(hf), "--to", "hf"])
    assert res.exit_code == 0, res.output
    summary = last_json(res.stdout)
    assert (summary["source_format"], summary["target"], summary["path"]) == ("hub", "hf", str(hf))
    with CheckpointReader(hf) as r:
        assert r.format == "trex"

    # back to the published layout, keeping the source's config and scheme (--like): the original bytes
    back = tmp_path / "back"
    res = runner.invoke(app, ["convert", str(hf), str(back), "--like", str(fixture_dir), "--shard-gb", "0.0002"])
    assert res.exit_code == 0, res.output
    summary = last_json(res.stdout)
    assert (summary["source_format"], summary["target"], summary["scheme"]) == ("trex", "hub-fp8", "flash")
    assert summary["shards"] > 1 and summary["shards"] == len(list(back.glob("model-*.safetensors")))
    assert same_tensors(read_all(back), read_all(fixture_dir))
    cfg = json.loads((back / "config.json").read_text())
    assert cfg.pop("trex_provenance")["source_format"] == "trex"
    assert cfg == json.loads((fixture_dir / "config.json").read_text())

    # --scheme picks the quantisation: Flash-Base's float32 scales and FP8 experts
    base = tmp_path / "base"
    res = runner.invoke(app, ["convert", str(hf), str(base), "--to", "hub-fp8", "--scheme", "flash-base"])
    assert res.exit_code == 0, res.output
    with CheckpointReader(base) as r:
        assert r.scheme.name == "flash-base"
        assert r.headers["layers.1.ffn.experts.0.w1.scale"]["dtype"] == "F32"
        assert r.headers["layers.1.ffn.experts.0.w1.weight"]["dtype"] == "F8_E4M3"


@pytest.mark.parametrize("case", ["nonexistent", "no_config", "not_deepseek", "missing_tensor"])
def test_convert_bad_source_exits_2(fixture_dir, tmp_path, case):
    src = tmp_path / "src"
    if case == "no_config":
        src.mkdir()
        want = "config.json"
    elif case == "not_deepseek":
        shutil.copytree(fixture_dir, src)
        cfg = json.loads((src / "config.json").read_text())
        (src / "config.json").write_text(json.dumps({**cfg, "model_type": "llama"}))
        want = "'llama'"
    elif case == "missing_tensor":
        shutil.copytree(fixture_dir, src)
        index = json.loads((src / "model.safetensors.index.json").read_text())
        del index["weight_map"]["head.weight"]  # the index no longer knows the LM head
        shard = next(f for f in sorted(src.glob("model-*.safetensors")) if "head.weight" in load_file(str(f)))
        t = load_file(str(shard))
        t.pop("head.weight")
        save_file(t, str(shard), metadata={"format": "pt"})
        (src / "model.safetensors.index.json").write_text(json.dumps(index))
        want = "'head.weight'"
    else:
        want = str(src)
    dst = tmp_path / "dst"
    res = runner.invoke(app, ["convert", str(src), str(dst), "--to", "hf"])
    assert res.exit_code == 2, (res.exit_code, res.output, res.exception)
    assert "error" in res.stderr and flat(want) in flat(res.stderr), res.stderr
    assert flat(str(src)) in flat(res.stderr), res.stderr  # the message says which checkpoint
    assert not dst.exists() and not (tmp_path / ".dst.partial").exists()


def test_convert_bad_target_or_scheme_exits_2(fixture_dir, tmp_path):
    res = runner.invoke(app, ["convert", str(fixture_dir), str(tmp_path / "a"), "--to", "gguf"])
    assert res.exit_code == 2 and "gguf" in res.stderr, res.output
    res = runner.invoke(app, ["convert", str(fixture_dir), str(tmp_path / "b"), "--scheme", "int4"])
    assert res.exit_code == 2 and "int4" in res.stderr, res.output
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


# ------------------------------------------------------------------------------------- model-info
def test_model_info_on_a_fixture(fixture_dir):
    res = runner.invoke(app, ["model-info", "--checkpoint", str(fixture_dir)])
    assert res.exit_code == 0, res.output
    assert "routed experts" in res.stdout  # the table
    info = last_json(res.stdout)
    assert info["format"] == "hub" and info["scheme"] == "flash" and info["expert_dtype"] == "fp4"
    assert info["shards"] == 7 and info["tensors"] == len(read_all(fixture_dir))
    groups = info["groups"]
    # 4 layers + the MTP block, 8 experts each, w1 / w2 / w3
    assert groups["routed experts"] == {"tensors": 120, "dtypes": ["I8"], "bytes": 5 * 8 * (96 * 128 * 2 + 256 * 48)}
    assert groups["scales of routed experts"]["dtypes"] == ["F8_E8M0"]
    assert groups["scales of routed experts"]["tensors"] == 120
    assert groups["FP8 block-quantised linears"]["dtypes"] == ["F8_E4M3"]
    assert groups["scales of FP8 linears"]["dtypes"] == ["F8_E8M0"]
    assert groups["hash routing tables"] == {"tensors": 1, "dtypes": ["I64"], "bytes": 300 * 2 * 8}
    total = sum(t.numel() * t.element_size() for t in read_all(fixture_dir).values())
    assert sum(g["bytes"] for g in groups.values()) == total
    assert sum(g["tensors"] for g in groups.values()) == info["tensors"]
    n = load_model(fixture_dir).num_params()
    assert (info["params"]["total"], info["params"]["active"]) == (n["total"], n["active"])


def test_model_info_on_the_published_config_alone(tmp_path):
    shutil.copy(PUBLISHED_DIR / "deepseek-v4-flash.config.json", tmp_path / "config.json")
    res = runner.invoke(app, ["model-info", "--checkpoint", str(tmp_path)])
    assert res.exit_code == 0, res.output
    info = last_json(res.stdout)
    p = info["params"]
    assert 283e9 < p["total"] < 285.5e9, p
    assert 12.5e9 < p["active"] < 14e9, p
    assert info["format"] == "config-only" and info["expert_dtype"] == "fp4"
    assert (p["layers"], p["experts"], p["vocab_size"]) == (43, 256, 129280)


def test_model_info_on_a_bad_checkpoint_exits_2(tmp_path):
    res = runner.invoke(app, ["model-info", "--checkpoint", str(tmp_path / "nowhere")])
    assert res.exit_code == 2 and "config.json" in res.stderr, res.output


# ------------------------------------------------------------------------------------ hub-fixture
def test_hub_fixture_writes_a_loadable_checkpoint(tmp_path):
    out = tmp_path / "fx"
    res = runner.invoke(app, ["hub-fixture", str(out), "--variant", "flash-base", "--seed", "3"])
    assert res.exit_code == 0, res.output
    assert res.stdout.strip().splitlines()[-1] == str(out)
    with CheckpointReader(out) as r:
        assert r.format == "hub" and r.scheme.name == "flash-base"
    model = load_model(out)
    with torch.no_grad():
        logits = model(torch.randint(0, model.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0)))
    assert torch.isfinite(logits).all() and logits.std() > 0.1
    # the options reach the writer: the same bytes as write_hub_checkpoint(seed=3, "flash-base") with the
    # tokenizer it ships (if any: the vocabulary follows it)
    tok = out if (out / "tokenizer.json").is_file() else None
    if tok is not None:
        from tokenizers import Tokenizer

        vocab = Tokenizer.from_file(str(out / "tokenizer.json")).get_vocab_size(with_added_tokens=True)
        assert json.loads((out / "config.json").read_text())["vocab_size"] == vocab == model.vocab_size
    ref = write_hub_checkpoint(tmp_path / "ref", "flash-base", seed=3, tokenizer_dir=tok)
    assert same_tensors(read_all(out), read_all(ref))
    other = write_hub_checkpoint(tmp_path / "seed0", "flash-base", tokenizer_dir=tok)
    assert not same_tensors(read_all(out), read_all(other))
