"""Chat formats of given tokenizers: detection, the generic Jinja template format (sandboxed, prefix-stable
masks), clear errors for tokenizers lacking what their format needs, and adopting a tokenizer verbatim."""

import json
import shutil
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer

from trainer.tokenizer import (
    BOS,
    DS_END_THINK,
    END,
    SPECIAL_TOKENS,
    ChatTokenizer,
    TokenizerFormatError,
    save_tokenizer,
    train_tokenizer,
)

TEXTS = ["Maximise profit 30 x + 42 y subject to 2 x + 3 y <= 100.", "print('Optimal objective:', 1)"] * 40
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' }}{% generation %}{{ m['content'] }}"
          "{% endgeneration %}{{ '<|im_end|>\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
CHAT = [{"role": "system", "content": "sys"}, {"role": "user", "content": "q 12"},
        {"role": "assistant", "content": "a 34"}, {"role": "user", "content": "again"},
        {"role": "assistant", "content": " b\n5"}]


def _ids(out) -> list[int]:
    return list(out["input_ids"] if not isinstance(out, list) else out)


def _bpe(out: Path, special: list[str], config: dict | None = None) -> Tokenizer:
    """A byte-level BPE with ``special`` tokens; only tokenizer.json (+ ``config`` as tokenizer_config.json)."""
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(TEXTS, trainers.BpeTrainer(vocab_size=300, min_frequency=1, special_tokens=special,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                       show_progress=False))
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    if config is not None:
        (out / "tokenizer_config.json").write_text(json.dumps(config))
    return tok


def _chatml(out: Path, template: str = CHATML) -> Path:
    _bpe(out, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
         {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
          "chat_template": template})
    return out


@pytest.mark.parametrize("agp", [False, True])
def test_template_format_agrees_with_transformers_and_masks_assistant_turns(tmp_path, agp):
    d = _chatml(tmp_path)
    tok, hf = ChatTokenizer(d), AutoTokenizer.from_pretrained(str(d))
    assert tok.chat_format == "template" and tok.bos_id is None
    assert tok.end_id == tok.eos_id == hf.convert_tokens_to_ids("<|im_end|>")
    assert tok.pad_id == hf.convert_tokens_to_ids("<|endoftext|>")
    messages = CHAT if not agp else CHAT[:4]
    ids, mask = tok.encode_chat(messages, add_generation_prompt=agp)
    assert _ids(hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=agp)) == ids
    want = [t for m in messages if m["role"] == "assistant" for t in tok.encode(m["content"]) + [tok.end_id]]
    assert [i for i, m in zip(ids, mask) if m] == want  # content + <|im_end|>, not the "\n" after it
    assert _ids(hf("q 12")) == tok.encode_text("q 12") == tok.encode("q 12")  # no BOS in this tokenizer
    assert tok.agreement_problems() == []


def test_chat_template_jinja_wins_over_tokenizer_config(tmp_path):
    d = _chatml(tmp_path, template="{{ raise_exception('not this one') }}")
    (d / "chat_template.jinja").write_text(CHATML)
    tok, hf = ChatTokenizer(d), AutoTokenizer.from_pretrained(str(d))
    assert tok.template_file == d / "chat_template.jinja"
    assert _ids(hf.apply_chat_template(CHAT, tokenize=True)) == tok.encode_chat(CHAT)[0]


def test_template_that_is_not_prefix_stable_is_an_error_naming_the_file(tmp_path):
    # the generation prompt says "model" but an assistant turn is written as "assistant"
    d = _chatml(tmp_path, CHATML.replace("'<|im_start|>assistant\n'", "'<|im_start|>model\n'"))
    tok = ChatTokenizer(d)
    with pytest.raises(TokenizerFormatError, match=r"tokenizer_config\.json: the chat template is not prefix-stable "
                                                   r"at message 2"):
        tok.encode_chat(CHAT)
    assert tok.encode_chat(CHAT[:2], add_generation_prompt=True)[1] == [0] * len(tok.encode_chat(CHAT[:2], True)[0])


def test_template_runs_sandboxed(tmp_path):
    marker = tmp_path / "pwned"
    d = _chatml(tmp_path / "tok", "{{ cycler.__init__.__globals__.os.system('touch " + str(marker) + "') }}")
    with pytest.raises(TokenizerFormatError, match="chat template failed"):
        ChatTokenizer(d).encode_chat(CHAT)
    assert not marker.exists()


def test_detected_formats(tmp_path):
    train_tokenizer(TEXTS, tmp_path / "trex", 300, 1)
    train_tokenizer(TEXTS, tmp_path / "ds", 300, 1, style="deepseek_v4")
    assert ChatTokenizer(tmp_path / "trex").chat_format == "trex"
    assert ChatTokenizer(tmp_path / "ds").chat_format == "deepseek_v4"
    assert ChatTokenizer(tmp_path / "ds" / "tokenizer.json").chat_format == "deepseek_v4"
    assert ChatTokenizer(_chatml(tmp_path / "chatml")).chat_format == "template"
    # a T-Rex tokenizer may be driven by its chat template instead, which agrees with the native format
    forced, native = ChatTokenizer(tmp_path / "trex", chat_format="template"), ChatTokenizer(tmp_path / "trex")
    assert forced.encode_chat(CHAT) == native.encode_chat(CHAT)
    assert forced.encode_text("x 1") == native.encode_text("x 1")
    with pytest.raises(ValueError, match="unknown chat format"):
        ChatTokenizer(tmp_path / "trex", chat_format="llama")


def test_tokenizer_missing_special_tokens_is_a_clear_error(tmp_path):
    _bpe(tmp_path / "trex", [t for t in SPECIAL_TOKENS if t != END])
    with pytest.raises(TokenizerFormatError, match=r"trex/tokenizer\.json: tokenizer lacks special tokens "
                                                   r"\['<\|end\|>'\] that the trex chat format needs"):
        ChatTokenizer(tmp_path / "trex")
    _bpe(tmp_path / "ds", ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"])
    with pytest.raises(TokenizerFormatError, match=rf"ds/tokenizer\.json: .*\['{DS_END_THINK}'\] that the "
                                                   rf"deepseek_v4 chat format needs"):
        ChatTokenizer(tmp_path / "ds")
    _bpe(tmp_path / "none", ["<s>", "</s>"])
    with pytest.raises(TokenizerFormatError, match=r"none/tokenizer\.json: no chat format"):
        ChatTokenizer(tmp_path / "none")
    _chatml(tmp_path / "noeos")
    cfg = json.loads((tmp_path / "noeos" / "tokenizer_config.json").read_text())
    (tmp_path / "noeos" / "tokenizer_config.json").write_text(json.dumps({**cfg, "eos_token": None}))
    with pytest.raises(TokenizerFormatError, match=r"noeos/tokenizer_config\.json: names no eos_token"):
        ChatTokenizer(tmp_path / "noeos")
    (tmp_path / "noeos" / "tokenizer_config.json").write_text(json.dumps({**cfg, "eos_token": "</s>"}))
    with pytest.raises(TokenizerFormatError, match=r"noeos/tokenizer\.json: tokenizer lacks the eos_token '</s>'"):
        ChatTokenizer(tmp_path / "noeos")
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        ChatTokenizer(tmp_path / "absent")


def test_agreement_problems_name_what_transformers_would_do_differently(tmp_path):
    tok = train_tokenizer(TEXTS, tmp_path, 300, 1)
    tok.post_processor = None  # a tokenizer.json from before BOS was in its post-processor
    tok.save(str(tmp_path / "tokenizer.json"))
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": "{{ messages }}"}))
    old = ChatTokenizer(tmp_path)
    assert old.encode_text("x 1")[0] == old.bos_id  # training still sees BOS
    problems = old.agreement_problems()
    assert len(problems) == 2 and "post-processor" in problems[0] and "chat_template writes" in problems[1]
    save_tokenizer(old.tok, tmp_path)
    assert ChatTokenizer(tmp_path).agreement_problems() == []


def test_tokenizer_task_adopts_a_deepseek_tokenizer_verbatim(tmp_path):
    from tasks.common import StageContext
    from tasks.tokenizer import tokenizer_task
    from trex.core.config import TokenizerConfig
    from trex.core.refs import read_manifest, write_manifest

    src = tmp_path / "checkpoint"
    train_tokenizer(TEXTS, src, 300, 1, style="deepseek_v4")
    (src / "encoding").mkdir()
    marker = tmp_path / "executed"
    (src / "encoding" / "encoding_dsv4.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    (tmp_path / "data").mkdir()
    data_ref = write_manifest(tmp_path / "data", "data", {})
    ctx = StageContext(output_dir=str(tmp_path / "out"), tracking={"enabled": False, "uri": ""})
    res = tokenizer_task.fn(TokenizerConfig(path=str(src)), data_ref, ctx)
    out = Path(res["ref"]["path"])
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (out / name).read_bytes() == (src / name).read_bytes()
    assert not (out / "encoding").exists() and not marker.exists()
    manifest = read_manifest(out, "tokenizer")
    assert manifest["chat_format"] == "deepseek_v4" and manifest["hf_agreement"] == []
    assert res["summary"]["chat_format"] == "deepseek_v4"
    assert ChatTokenizer(out).encode_chat(CHAT) == ChatTokenizer(src).encode_chat(CHAT)

    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    (bad / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    with pytest.warns(RuntimeWarning, match="chat_template writes"):
        res = tokenizer_task.fn(TokenizerConfig(path=str(bad)), data_ref, ctx)
    assert read_manifest(res["ref"]["path"], "tokenizer")["hf_agreement"]


def test_bos_constant_is_the_trained_bos(tmp_path):
    train_tokenizer(TEXTS, tmp_path, 300, 1)
    assert ChatTokenizer(tmp_path).bos_id == AutoTokenizer.from_pretrained(str(tmp_path)).convert_tokens_to_ids(BOS)


def test_tokenizer_task_trains_a_trex_tokenizer_that_agrees(tmp_path):
    import datasets

    from tasks.common import StageContext
    from tasks.tokenizer import tokenizer_task
    from trex.core.config import TokenizerConfig
    from trex.core.refs import read_manifest, write_manifest

    datasets.Dataset.from_list([{"text": t} for t in TEXTS]).save_to_disk(str(tmp_path / "data" / "cpt"))
    datasets.Dataset.from_list([{"messages": CHAT}] * 3).save_to_disk(str(tmp_path / "data" / "sft"))
    data_ref = write_manifest(tmp_path / "data", "data", {})
    ctx = StageContext(output_dir=str(tmp_path / "out"), tracking={"enabled": False, "uri": ""})
    res = tokenizer_task.fn(TokenizerConfig(vocab_size=300, min_frequency=1), data_ref, ctx)
    manifest = read_manifest(res["ref"]["path"], "tokenizer")
    assert (manifest["source"], manifest["chat_format"], manifest["hf_agreement"]) == ("trained", "trex", [])
    hf = AutoTokenizer.from_pretrained(res["ref"]["path"])
    assert _ids(hf("x 1")) == ChatTokenizer(res["ref"]["path"]).encode_text("x 1")
