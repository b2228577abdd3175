"""Exports and checkpoints of every format through the user-facing paths: transformers' tokenizer of an export
tokenizes as training did (plain text with its BOS, chats by the template), so transformers scores a text as
``trex score`` does; ``trex score`` / ``trex generate`` and the native evaluation backend take a published-layout
checkpoint, transformers' ``save_pretrained`` and a T-Rex export of the same weights alike."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from trainer.export import export
from trainer.hub import load_model
from trainer.hub.fixture import write_hub_checkpoint
from trainer.tokenizer import ChatTokenizer, train_tokenizer
from trex.cli.main import app

runner = CliRunner()
TEXTS = ["maximise profit 3x + 4y subject to x + y <= 12", "min cost: 7 a + 2 b", "ünïcode  spaces\tand\n 0042"]
CHATS = [[{"role": "system", "content": "You write OR programs."}, {"role": "user", "content": "min 3x, x >= 2"},
          {"role": "assistant", "content": "x = 2\nprint(6)"}, {"role": "user", "content": "and max?"}]]


@pytest.fixture(scope="module", params=["trex", "deepseek_v4"])
def exported(request, tmp_path_factory):
    style = request.param
    root = tmp_path_factory.mktemp(style)
    train_tokenizer(TEXTS * 20, root / "tok", 400, 1, style=style)
    hub = write_hub_checkpoint(root / "hub", "flash", seed=3, tokenizer_dir=root / "tok")
    model = load_model(hub)
    export(model, root / "tok", root / "hf")
    export(model, root / "tok", root / "hubfp8", to="hub-fp8",
           scheme=__import__("trainer.hub.reader", fromlist=["FLASH"]).FLASH,
           source_config=json.loads((hub / "config.json").read_text()))
    return style, root, model


def test_auto_tokenizer_of_an_export_gives_the_training_ids(exported):
    from transformers import AutoTokenizer

    style, root, _ = exported
    for d in ("hf", "hubfp8"):
        hf = AutoTokenizer.from_pretrained(str(root / d))
        tok = ChatTokenizer(root / d)
        assert tok.chat_format == style
        for text in TEXTS + [""]:
            assert hf(text)["input_ids"] == tok.encode_text(text), (d, text)
            assert tok.encode_text(text)[0] == tok.bos_id
        for chat in CHATS:
            for gen in (False, True):
                msgs = chat if gen else chat[:3]
                want = tok.encode_chat(msgs, add_generation_prompt=gen)[0]
                got = hf.apply_chat_template(msgs, tokenize=True, add_generation_prompt=gen)
                got = got["input_ids"] if isinstance(got, dict) or hasattr(got, "keys") else got
                assert list(got) == want, (d, gen)


def test_transformers_scores_plain_text_as_trex_score_does(exported, tmp_path):
    """The regression: transformers' tokenizer left out BOS, so its first-token log-probs were -22.9 against
    trex score's -7.8 on the same weights."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, root, _ = exported
    (tmp_path / "s.jsonl").write_text(json.dumps({"text": TEXTS[0]}) + "\n")
    res = runner.invoke(app, ["score", "--model", str(root / "hf"), "--input", str(tmp_path / "s.jsonl"),
                              "--output", str(tmp_path / "out.jsonl")])
    assert res.exit_code == 0, res.output
    row = json.loads((tmp_path / "out.jsonl").read_text())
    hf_tok = AutoTokenizer.from_pretrained(str(root / "hf"))
    hf_model = AutoModelForCausalLM.from_pretrained(str(root / "hf"), dtype=torch.float32).eval()
    ids = hf_tok(TEXTS[0], return_tensors="pt")["input_ids"]
    with torch.no_grad():
        lp = torch.log_softmax(hf_model(ids).logits[0, :-1].float(), -1).gather(1, ids[0, 1:, None])[:, 0]
    assert row["token_ids"] == ids[0, 1:].tolist()
    assert torch.allclose(lp, torch.tensor(row["logprobs"]), atol=1e-4), (lp[:3], row["logprobs"][:3])


def _save_pretrained(hub: Path, out: Path) -> Path:
    """transformers' own layout of the same weights (its CPU load dequantises the published FP8 / MXFP4)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hub), dtype=torch.float32)
    model.save_pretrained(str(out))
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (hub / f).is_file():
            (out / f).write_bytes((hub / f).read_bytes())
    return out


def test_score_generate_and_the_native_backend_take_every_format(exported, tmp_path):
    from eval.backends import NativeBackend, SamplingParams
    from trainer.hub import detect_format

    _, root, _ = exported
    dirs = {"hub": root / "hub", "trex": root / "hf", "hf": _save_pretrained(root / "hub", tmp_path / "saved")}
    assert {k: detect_format(d) for k, d in dirs.items()} == {"hub": "hub", "trex": "trex", "hf": "hf"}
    (tmp_path / "s.jsonl").write_text(json.dumps({"text": TEXTS[1]}) + "\n")
    scores, completions = {}, {}
    for kind, d in dirs.items():
        out = tmp_path / f"{kind}.jsonl"
        res = runner.invoke(app, ["score", "--model", str(d), "--input", str(tmp_path / "s.jsonl"), "--output", str(out)])
        assert res.exit_code == 0, (kind, res.output)
        scores[kind] = torch.tensor(json.loads(out.read_text())["logprobs"])
        res = runner.invoke(app, ["generate", "--model", str(d), "--prompt", "min 3x", "--max-new-tokens", "5",
                                  "--output", str(tmp_path / f"gen-{kind}.jsonl")])
        assert res.exit_code == 0, (kind, res.output)
        completions[kind] = json.loads((tmp_path / f"gen-{kind}.jsonl").read_text())["completion"]
        native = NativeBackend(d, batch_size=1)
        (c,) = native.generate([[{"role": "user", "content": "min 3x"}]],
                               SamplingParams(max_new_tokens=5, temperature=0.0))
        assert c.finish_reason in ("stop", "length") and c.completion_tokens > 0, (kind, c)
    # the same weights in three layouts: the same scores and the same greedy completion
    assert torch.allclose(scores["hub"], scores["trex"], atol=1e-5) and torch.allclose(scores["hub"], scores["hf"], atol=1e-5)
    assert completions["hub"] == completions["trex"] == completions["hf"]
