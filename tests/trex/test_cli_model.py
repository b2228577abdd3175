"""trex model-info / generate / score on a small exported model."""

import json

import torch
from typer.testing import CliRunner

from tests.trainer.helpers import tiny_model
from trainer.export import export, load_export
from trainer.tokenizer import ChatTokenizer, train_tokenizer
from trex.cli import app

runner = CliRunner()


def _exported(tmp_path):
    texts = ["minimise the cost of shipping 12 pallets", "maximise profit 3x + 4y subject to x + y <= 10"] * 20
    train_tokenizer(texts, tmp_path / "tok", vocab_size=300)
    vocab = ChatTokenizer(tmp_path / "tok").vocab_size
    model = tiny_model(seed=2, vocab=vocab, max_seq_len=256)
    export(model, tmp_path / "tok", tmp_path / "model" / "export")
    return tmp_path / "model"  # a stage directory holding export/


def test_model_info_counts_the_real_shapes_on_meta():
    res = runner.invoke(app, ["model-info", "--config", "configs/deepseek_v4_flash.yaml"])
    assert res.exit_code == 0, res.output
    info = json.loads(res.output.strip().splitlines()[-1])
    assert abs(info["total"] / 284e9 - 1) < 0.02 and abs(info["active"] / 13e9 - 1) < 0.05
    res = runner.invoke(app, ["model-info", "--config", "configs/deepseek_v4_pro.yaml"])
    info = json.loads(res.output.strip().splitlines()[-1])
    assert abs(info["total"] / 1.6e12 - 1) < 0.03 and abs(info["active"] / 49e9 - 1) < 0.03


def test_generate_and_score(tmp_path):
    d = _exported(tmp_path)
    (tmp_path / "in.jsonl").write_text(json.dumps({"prompt": "maximise profit"}) + "\n" +
                                       json.dumps({"messages": [{"role": "user", "content": "minimise cost"}]}) + "\n")
    res = runner.invoke(app, ["generate", "--model", str(d), "--input", str(tmp_path / "in.jsonl"),
                              "--max-new-tokens", "6", "--output", str(tmp_path / "out.jsonl")])
    assert res.exit_code == 0, res.output
    rows = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(0 < r["tokens"] <= 6 for r in rows)
    (tmp_path / "s.jsonl").write_text(json.dumps({"text": "maximise profit 3x + 4y"}) + "\n")
    res = runner.invoke(app, ["score", "--model", str(d), "--input", str(tmp_path / "s.jsonl"),
                              "--output", str(tmp_path / "scores.jsonl")])
    assert res.exit_code == 0, res.output
    row = json.loads((tmp_path / "scores.jsonl").read_text())
    tok, net = ChatTokenizer(d / "export"), load_export(d / "export")
    ids = tok.encode_text("maximise profit 3x + 4y")
    assert ids[0] == tok.bos_id
    with torch.no_grad():
        ref = torch.log_softmax(net(torch.tensor([ids]))[0, :-1], -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    assert row["token_ids"] == ids[1:] and torch.allclose(torch.tensor(row["logprobs"]), ref, atol=1e-5)


def test_bad_input_names_the_line(tmp_path):
    d = _exported(tmp_path)
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{not json\n')
    res = runner.invoke(app, ["score", "--model", str(d), "--input", str(tmp_path / "bad.jsonl")])
    assert res.exit_code == 2 and "bad.jsonl:2" in res.output
    res = runner.invoke(app, ["score", "--model", str(tmp_path / "nope"), "--input", str(tmp_path / "bad.jsonl")])
    assert res.exit_code == 2
