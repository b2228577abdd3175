"""Byte-level BPE tokenizer (HF ``tokenizers``) with the T-Rex chat template.

Digits are split individually before BPE, so numbers — which OR programs copy from the
question — are spelt digit by digit. The saved directory loads with
``transformers.PreTrainedTokenizerFast.from_pretrained`` (its chat template included).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Iterator

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

BOS, EOS, PAD, END = "<|bos|>", "<|eos|>", "<|pad|>", "<|end|>"
ROLES = ("system", "user", "assistant")
ROLE_TOKENS = {r: f"<|{r}|>" for r in ROLES}
SPECIAL_TOKENS = [PAD, BOS, EOS, END, *ROLE_TOKENS.values()]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def train_tokenizer(texts: Iterable[str], out_dir: str | Path, vocab_size: int, min_frequency: int = 2) -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    save_tokenizer(tok, out_dir)
    return tok


def save_tokenizer(tok: Tokenizer, out_dir: str | Path) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS, "pad_token": PAD,
        "chat_template": CHAT_TEMPLATE, "model_max_length": 1 << 20,
    }, indent=2))
    (out / "special_tokens_map.json").write_text(json.dumps({"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}, indent=2))


class ChatTokenizer:
    """Thin wrapper: encode chats with an assistant-only loss mask; ids of the special tokens."""

    def __init__(self, path: str | Path):
        p = Path(path)
        f = p / "tokenizer.json" if p.is_dir() else p
        if not f.is_file():
            raise FileNotFoundError(f"{p}: no tokenizer.json")
        self.tok = Tokenizer.from_file(str(f))
        self.path = str(p)
        ids = {t: self.tok.token_to_id(t) for t in SPECIAL_TOKENS}
        missing = [t for t, i in ids.items() if i is None]
        if missing:
            raise ValueError(f"{f}: tokenizer lacks special tokens {missing}")
        self.pad_id, self.bos_id, self.eos_id, self.end_id = ids[PAD], ids[BOS], ids[EOS], ids[END]
        self.role_id = {r: ids[t] for r, t in ROLE_TOKENS.items()}
        self.newline = self.encode("\n")

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = False) -> tuple[list[int], list[int]]:
        """Token ids and a loss mask that is 1 exactly on assistant content and its ``<|end|>``."""
        ids: list[int] = [self.bos_id]
        mask: list[int] = [0]
        for m in messages:
            role = m["role"]
            if role not in self.role_id:
                raise ValueError(f"unknown chat role {role!r} (expected one of {ROLES})")
            head = [self.role_id[role], *self.newline]
            body = self.encode(m["content"]) + [self.end_id]
            learn = 1 if role == "assistant" else 0
            ids += head + body + self.newline
            mask += [0] * len(head) + [learn] * len(body) + [0] * len(self.newline)
        if add_generation_prompt:
            head = [self.role_id["assistant"], *self.newline]
            ids += head
            mask += [0] * len(head)
        return ids, mask


def iter_texts_from_rows(rows: Iterable[dict]) -> Iterator[str]:
    for r in rows:
        if "text" in r:
            yield r["text"]
        for m in r.get("messages") or []:
            yield m["content"]
