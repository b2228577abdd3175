"""T-Rex's tokenizer agrees with transformers (and vLLM's two paths) on the directories it writes, for the
T-Rex and the DeepSeek-V4 style: plain text (BOS + text), chats (one BOS), the assistant-only loss mask."""

import json

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from trainer.tokenizer import DS_BOS, DS_EOS, ChatTokenizer, train_tokenizer

TEXTS = ["Maximise profit 30 x + 42 y subject to 2 x + 3 y <= 100.", "```python\nimport highspy\n```",
         "Coût unitaire ≤ 3,5 €; 中文 ✓"] * 50
PLAIN = ["", "profit 1234", "x1 + 2.5e-3 * 1000000", "  leading spaces\n\n\ttab ", "héllo wörld ✓ 中文 🙂", "\n"]
SYS, USER, ASSISTANT = "You are an OR expert.", "Maximise 3 x + 4 y with x + y <= 10.", "```python\nprint(40)\n```"
CHATS = [
    [{"role": "user", "content": USER}],
    [{"role": "system", "content": SYS}, {"role": "user", "content": USER}, {"role": "assistant", "content": ASSISTANT}],
    [{"role": "system", "content": SYS}, {"role": "user", "content": "q 12"}, {"role": "assistant", "content": " a 34\n"},
     {"role": "user", "content": "  and 56?"}, {"role": "assistant", "content": "7 8 ✓"}],
    [{"role": "system", "content": "one"}, {"role": "system", "content": "two"}, {"role": "user", "content": ""},
     {"role": "assistant", "content": ""}],
]


def _ids(out) -> list[int]:
    return list(out["input_ids"] if not isinstance(out, list) else out)


@pytest.fixture(scope="module", params=["trex", "deepseek_v4"])
def trained(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    train_tokenizer(TEXTS, d, vocab_size=400, min_frequency=1, style=request.param)
    return request.param, d, ChatTokenizer(d), AutoTokenizer.from_pretrained(str(d))


def test_train_encode_chat_mask_and_hf_loadable(tmp_path):
    train_tokenizer(TEXTS, tmp_path, vocab_size=320, min_frequency=1)
    tok = ChatTokenizer(tmp_path)
    assert tok.chat_format == "trex"
    assert tok.decode(tok.encode("profit 1234")) == "profit 1234"
    assert len(tok.encode("1234")) == 4  # digits are split individually
    msgs = [{"role": "system", "content": "sys"}, {"role": "user", "content": "question 12"},
            {"role": "assistant", "content": "answer 34"}]
    ids, mask = tok.encode_chat(msgs)
    learned = [i for i, m in zip(ids, mask) if m]
    assert tok.decode(learned[:-1]) == "answer 34" and learned[-1] == tok.end_id
    hf = PreTrainedTokenizerFast.from_pretrained(str(tmp_path))
    rendered = hf.apply_chat_template(msgs, tokenize=False)
    assert rendered == "<|bos|><|system|>\nsys<|end|>\n<|user|>\nquestion 12<|end|>\n<|assistant|>\nanswer 34<|end|>\n"
    assert hf.encode(rendered, add_special_tokens=False) == ids  # the template writes BOS, as training does
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["add_bos_token"] is True


@pytest.mark.parametrize("text", PLAIN)
def test_plain_text_ids_agree_with_transformers(trained, text):
    _, _, tok, hf = trained
    ids = tok.encode_text(text)
    assert ids[0] == tok.bos_id and ids[1:] == tok.encode(text)  # BOS + text, as CPT trains on it
    assert _ids(hf(text)) == ids  # transformers' default call, vLLM completions (add_special_tokens=True)
    assert hf.encode(text) == ids
    assert tok.encode_text_batch([text, text]) == [ids, ids]
    assert hf.decode(ids, skip_special_tokens=True) == tok.decode(ids) == text


@pytest.mark.parametrize("agp", [False, True])
@pytest.mark.parametrize("chat", range(len(CHATS)))
def test_chat_ids_agree_with_transformers_and_vllm_chat_path(trained, chat, agp):
    _, _, tok, hf = trained
    messages = CHATS[chat]
    ids, mask = tok.encode_chat(messages, add_generation_prompt=agp)
    assert len(mask) == len(ids)
    assert _ids(hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=agp)) == ids
    text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=agp)
    assert text == tok.render_chat(messages, agp)
    assert _ids(hf(text, add_special_tokens=False)) == ids  # vLLM's chat path: render, then no specials
    assert ids.count(tok.bos_id) == 1 and ids[0] == tok.bos_id  # no double BOS


def test_loss_mask_is_exactly_assistant_content_and_end_token(trained):
    _, _, tok, _ = trained
    messages = CHATS[2]
    ids, mask = tok.encode_chat(messages)
    want = [t for m in messages if m["role"] == "assistant" for t in tok.encode(m["content"]) + [tok.end_id]]
    assert [i for i, m in zip(ids, mask) if m] == want
    assert sum(mask) == len(want)
    last = max(i for i, m in enumerate(mask) if m)
    assert ids[last] == tok.end_id and not any(mask[last + 1:])  # only the trex format's "\n" follows
    prompt, pmask = tok.encode_chat(messages[:-1], add_generation_prompt=True)
    assert ids[:len(prompt)] == prompt  # the last turn's prompt is a token prefix of the full chat
    assert mask[len(prompt):last + 1] == [1] * (last + 1 - len(prompt))
    assert sum(pmask) == len(tok.encode(messages[2]["content"])) + 1  # the earlier assistant turn only


@pytest.mark.parametrize("trained", ["deepseek_v4"], indirect=True)
def test_deepseek_v4_format_and_config(trained):
    _, d, tok, hf = trained
    assert tok.chat_format == "deepseek_v4" and tok.end_id == tok.eos_id
    messages = CHATS[2]
    assert tok.render_chat(messages, False) == (
        "<｜begin▁of▁sentence｜>You are an OR expert.<｜User｜>q 12<｜Assistant｜></think> a 34\n<｜end▁of▁sentence｜>"
        "<｜User｜>  and 56?<｜Assistant｜></think>7 8 ✓<｜end▁of▁sentence｜>")
    assert tok.render_chat(messages[:4], True).endswith("<｜User｜>  and 56?<｜Assistant｜></think>")
    config = json.loads((d / "tokenizer_config.json").read_text())
    assert (config["add_bos_token"], config["add_eos_token"]) == (True, False)
    assert config["bos_token"]["content"] == DS_BOS and config["eos_token"]["content"] == DS_EOS
    assert hf.bos_token == DS_BOS and hf.eos_token == DS_EOS and hf.pad_token_id == tok.pad_id
    assert tok.role_id["assistant"] == hf.convert_tokens_to_ids("<｜Assistant｜>")


def test_trained_directories_agree(trained):
    assert trained[2].agreement_problems() == []


def test_unknown_role_and_style_are_errors(trained, tmp_path):
    tok = trained[2]
    with pytest.raises(ValueError, match="unknown chat role 'tool'"):
        tok.encode_chat([{"role": "tool", "content": "x"}])
    with pytest.raises(ValueError, match="unknown tokenizer style"):
        train_tokenizer(TEXTS, tmp_path, 300, style="llama")
