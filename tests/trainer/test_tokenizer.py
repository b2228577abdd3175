from transformers import PreTrainedTokenizerFast

from trainer.tokenizer import ChatTokenizer, train_tokenizer

TEXTS = ["Maximise profit 30 x + 42 y subject to 2 x + 3 y <= 100.", "```python\nimport highspy\n```"] * 50


def test_train_encode_chat_mask_and_hf_loadable(tmp_path):
    train_tokenizer(TEXTS, tmp_path, vocab_size=320, min_frequency=1)
    tok = ChatTokenizer(tmp_path)
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
