"""Tokenizers: byte-level BPE training and :class:`ChatTokenizer`, which encodes plain text and chats exactly
as ``transformers`` (and vLLM) do with the same directory.

Digits are split individually before BPE, so numbers — which OR programs copy from the question — are spelt
digit by digit. ``ChatTokenizer`` detects the chat format of a tokenizer directory (``chat_format``):

- ``trex``: T-Rex's own special tokens (``<|bos|>``, ``<|system|>``/``<|user|>``/``<|assistant|>``, a turn ends
  with ``<|end|>``);
- ``deepseek_v4``: DeepSeek-V4's special tokens, in its non-thinking chat mode
  (``<｜begin▁of▁sentence｜>{system}<｜User｜>{user}<｜Assistant｜></think>{assistant}<｜end▁of▁sentence｜>…``),
  written here in Python: the encoding script a checkpoint ships is never executed;
- ``template``: any other tokenizer with a Jinja ``chat_template`` (``chat_template.jinja`` or
  ``tokenizer_config.json``), rendered in a sandboxed jinja2 environment.

Plain text as the model sees it is :meth:`ChatTokenizer.encode_text` (BOS + the text for the two native
formats). The files :func:`save_tokenizer` writes make ``transformers`` agree: the ``tokenizer.json``
post-processor adds BOS to plain text (``add_special_tokens=True``: ``tok(text)``, vLLM completions) and the
chat template writes BOS itself (tokenised with ``add_special_tokens=False``: ``apply_chat_template``, vLLM's
chat path), so there is never a second BOS. :meth:`ChatTokenizer.agreement_problems` says where a directory's
files would make ``transformers`` tokenize differently.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable, Iterator
from datetime import datetime
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

BOS, EOS, PAD, END = "<|bos|>", "<|eos|>", "<|pad|>", "<|end|>"
ROLES = ("system", "user", "assistant")
ROLE_TOKENS = {r: f"<|{r}|>" for r in ROLES}
SPECIAL_TOKENS = [PAD, BOS, EOS, END, *ROLE_TOKENS.values()]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

# DeepSeek-V4 (fullwidth bars U+FF5C, lower one-eighth blocks U+2581)
DS_BOS, DS_EOS, DS_PAD = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>"
DS_USER, DS_ASSISTANT, DS_THINK, DS_END_THINK = "<｜User｜>", "<｜Assistant｜>", "<think>", "</think>"
DS_SPECIAL_TOKENS = [DS_BOS, DS_EOS, DS_PAD, DS_USER, DS_ASSISTANT]
DS_REQUIRED = [DS_BOS, DS_EOS, DS_USER, DS_ASSISTANT, DS_END_THINK]
DS_GENERATION_PROMPT = DS_ASSISTANT + DS_END_THINK
DS_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ m['content'] }}"
    "{% elif m['role'] == 'user' %}{{ '" + DS_USER + "' + m['content'] }}"
    "{% elif m['role'] == 'assistant' %}{{ '" + DS_GENERATION_PROMPT + "' + m['content'] + eos_token }}"
    "{% else %}{{ raise_exception('unknown chat role ' + m['role']) }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '" + DS_GENERATION_PROMPT + "' }}{% endif %}"
)

STYLES = ("trex", "deepseek_v4")
CHAT_FORMATS = ("trex", "deepseek_v4", "template")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
# conversations on which a native format and a directory's chat template must render the same text
PROBES = [
    ([{"role": "user", "content": "Maximise 3 x + 4 y."}], True),
    ([{"role": "system", "content": "You are an OR expert."}, {"role": "user", "content": "q 12"},
      {"role": "assistant", "content": "a 34"}, {"role": "user", "content": " next\n"}], True),
    ([{"role": "system", "content": "s"}, {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], False),
]


class TokenizerFormatError(ValueError):
    """A tokenizer directory that does not have what its chat format needs (the message names file and token)."""


def train_tokenizer(texts: Iterable[str], out_dir: str | Path, vocab_size: int, min_frequency: int = 2,
                    style: str = "trex") -> Tokenizer:
    """Train a byte-level BPE with the special tokens of ``style`` and save it (:func:`save_tokenizer`).
    ``style="deepseek_v4"`` gives a small stand-in for a DeepSeek-V4 checkpoint's tokenizer: DeepSeek's special
    tokens and a ``tokenizer_config.json`` written as DeepSeek's hub repositories write it."""
    if style not in STYLES:
        raise ValueError(f"unknown tokenizer style {style!r} (expected one of {STYLES})")
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=min_frequency,
        special_tokens=SPECIAL_TOKENS if style == "trex" else DS_SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    if style == "deepseek_v4":  # added, not special, as in DeepSeek's vocabulary
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in (DS_THINK, DS_END_THINK)])
    save_tokenizer(tok, out_dir, style)
    return tok


def _added(content: str) -> dict:
    return {"__type": "AddedToken", "content": content, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": True}


def save_tokenizer(tok: Tokenizer, out_dir: str | Path, style: str = "trex") -> None:
    """``tokenizer.json`` (its post-processor adds BOS to plain text), ``tokenizer_config.json`` (special
    tokens, ``add_bos_token``, the chat template of ``style``) and ``special_tokens_map.json``."""
    if style not in STYLES:
        raise ValueError(f"unknown tokenizer style {style!r} (expected one of {STYLES})")
    bos, eos, pad = (BOS, EOS, PAD) if style == "trex" else (DS_BOS, DS_EOS, DS_PAD)
    bos_id = tok.token_to_id(bos)
    if bos_id is None:
        raise TokenizerFormatError(f"tokenizer lacks the special token {bos!r} that a {style} tokenizer needs")
    tok.post_processor = processors.TemplateProcessing(single=[bos, "$A"], pair=[bos, "$A", bos, "$B:1"],
                                                       special_tokens=[(bos, bos_id)])
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    if style == "trex":
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS,
                  "pad_token": PAD, "add_bos_token": True, "add_eos_token": False,
                  "chat_template": CHAT_TEMPLATE, "model_max_length": 1 << 20}
    else:  # the way deepseek-ai's hub repositories write it
        config = {"add_bos_token": True, "add_eos_token": False, "bos_token": _added(DS_BOS),
                  "clean_up_tokenization_spaces": False, "eos_token": _added(DS_EOS), "legacy": True,
                  "model_max_length": 1 << 20, "pad_token": _added(DS_PAD), "sp_model_kwargs": {},
                  "unk_token": None, "tokenizer_class": "LlamaTokenizerFast", "chat_template": DS_CHAT_TEMPLATE}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False), encoding="utf-8")
    (out / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": bos, "eos_token": eos, "pad_token": pad}, indent=2, ensure_ascii=False), encoding="utf-8")


def copy_tokenizer_files(src: str | Path, out_dir: str | Path) -> list[str]:
    """Copy the tokenizer files of ``src`` (a directory, or its ``tokenizer.json``) verbatim; their names."""
    p = Path(src)
    d = p if p.is_dir() else p.parent
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    copied = []
    for name in TOKENIZER_FILES:
        f = p if name == "tokenizer.json" and not p.is_dir() else d / name
        if f.is_file():
            shutil.copy2(f, out / name)
            copied.append(name)
    return copied


def _token_name(value) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


def _read_json(f: Path) -> dict:
    if not f.is_file():
        return {}
    try:
        data = json.loads(f.read_text(encoding="utf-8"))
    except ValueError as e:
        raise TokenizerFormatError(f"{f}: not valid JSON ({e})") from e
    return data if isinstance(data, dict) else {}


def _chat_template(d: Path, config: dict) -> tuple[str | None, Path]:
    """The default chat template (``chat_template.jinja`` wins over ``tokenizer_config.json``, as in
    transformers) and the file it comes from."""
    jinja = d / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8"), jinja
    t = config.get("chat_template")
    if isinstance(t, list):  # named templates
        t = next((x.get("template") for x in t if isinstance(x, dict) and x.get("name") == "default"), None)
    return (t if isinstance(t, str) and t else None), d / "tokenizer_config.json"


def _compile_template(source: str, where: Path):
    """A chat template compiled in a sandboxed, immutable jinja2 environment set up as transformers sets up
    its own (trim_blocks, lstrip_blocks, loop controls, ``tojson``, ``raise_exception``, ``{% generation %}``)."""
    import jinja2  # lazy: only the template chat format needs it
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):  # transformers' assistant-mask tag: here it renders its body
        tags = frozenset({"generation"})

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt))
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateError as e:
        raise TokenizerFormatError(f"{where}: the chat template does not compile ({e})") from e


class ChatTokenizer:
    """Encode plain text and chats (with an assistant-only loss mask) as the model is trained on them; the ids
    of the special tokens. ``chat_format`` is detected from the tokenizer (module docstring), or forced."""

    def __init__(self, path: str | Path, chat_format: str | None = None):
        p = Path(path)
        f = p / "tokenizer.json" if p.is_dir() else p
        if not f.is_file():
            raise FileNotFoundError(f"{p}: no tokenizer.json")
        if chat_format is not None and chat_format not in CHAT_FORMATS:
            raise ValueError(f"unknown chat format {chat_format!r} (expected one of {CHAT_FORMATS})")
        self.tok = Tokenizer.from_file(str(f))
        self.path, self.file = str(p), f
        d = f.parent
        self.config = _read_json(d / "tokenizer_config.json")
        self.chat_template, self.template_file = _chat_template(d, self.config)
        self._template = None
        self._special = {i for i, t in self.tok.get_added_tokens_decoder().items() if t.special}
        self.chat_format = chat_format or self._detect()
        self.role_id: dict[str, int] = {}
        if self.chat_format == "trex":
            ids = self._require(SPECIAL_TOKENS, "trex")
            self.pad_id, self.bos_id, self.eos_id, self.end_id = ids[PAD], ids[BOS], ids[EOS], ids[END]
            self.role_id = {r: ids[t] for r, t in ROLE_TOKENS.items()}
        elif self.chat_format == "deepseek_v4":
            ids = self._require(DS_REQUIRED, "deepseek_v4")
            self.bos_id, self.eos_id = ids[DS_BOS], ids[DS_EOS]
            self.end_id = self.eos_id  # a DeepSeek turn ends with end-of-sentence
            pad = self._config_token("pad_token") or DS_PAD
            self.pad_id = self.tok.token_to_id(pad) if self.tok.token_to_id(pad) is not None else self.eos_id
            self.role_id = {"user": ids[DS_USER], "assistant": ids[DS_ASSISTANT]}
        else:
            self._init_template()

    # ------------------------------------------------------------------------------------ detection

    def _detect(self) -> str:
        if self.tok.token_to_id(BOS) is not None:
            return "trex"
        if self.tok.token_to_id(DS_BOS) is not None:
            return "deepseek_v4"
        if self.chat_template:
            return "template"
        raise TokenizerFormatError(
            f"{self.file}: no chat format: it has neither T-Rex's special tokens ({BOS}, ...) nor DeepSeek-V4's "
            f"({DS_BOS}, ...), and there is no chat_template in {self.file.parent / 'tokenizer_config.json'} "
            f"or {self.file.parent / 'chat_template.jinja'}")

    def _require(self, tokens: list[str], fmt: str) -> dict[str, int]:
        ids = {t: self.tok.token_to_id(t) for t in tokens}
        missing = [t for t, i in ids.items() if i is None]
        if missing:
            hint = " (or pass chat_format='template' to use its chat_template)" if self.chat_template else ""
            raise TokenizerFormatError(f"{self.file}: tokenizer lacks special tokens {missing} that the {fmt} "
                                       f"chat format needs{hint}")
        return ids

    def _config_token(self, name: str) -> str | None:
        value = _token_name(self.config.get(name))
        if value is None:
            value = _token_name(_read_json(self.file.parent / "special_tokens_map.json").get(name))
        return value

    def _config_id(self, name: str, required: bool) -> int | None:
        token = self._config_token(name)
        cfg = self.file.parent / "tokenizer_config.json"
        if token is None:
            if required:
                raise TokenizerFormatError(f"{cfg}: names no {name} (the template chat format needs one)")
            return None
        i = self.tok.token_to_id(token)
        if i is None:
            raise TokenizerFormatError(f"{self.file}: tokenizer lacks the {name} {token!r} that {cfg} names")
        return i

    def _init_template(self) -> None:
        if not self.chat_template:
            raise TokenizerFormatError(f"{self.template_file}: no chat_template (the template chat format needs one)")
        self._template = _compile_template(self.chat_template, self.template_file)
        self.bos_id = self._config_id("bos_token", required=False)
        self.eos_id = self._config_id("eos_token", required=True)
        pad = self._config_id("pad_token", required=False)
        self.pad_id = pad if pad is not None else self.eos_id
        self.end_id = self.eos_id
        try:  # the end-of-turn token: the last special token of a probe assistant turn
            probe = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hi"}]
            ids, mask = self._template_chat(probe, False)
            learned = [i for i, m in zip(ids, mask) if m]
            if learned and learned[-1] in self._special:
                self.end_id = learned[-1]
        except TokenizerFormatError:
            pass  # a template that needs other conversations: encode_chat will say what is wrong

    # -------------------------------------------------------------------------------------- encoding

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        """The text's tokens, no special tokens added."""
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch(texts, add_special_tokens=False)]

    def encode_text(self, text: str) -> list[int]:
        """Plain text as the model sees it: BOS + the text's tokens for the trex and deepseek_v4 formats (for
        the template format: what the tokenizer's post-processor adds). This is what
        ``AutoTokenizer.from_pretrained(dir)(text)["input_ids"]`` and vLLM completions give."""
        return self.encode_text_batch([text])[0]

    def encode_text_batch(self, texts: list[str]) -> list[list[int]]:
        if self.chat_format == "template":
            return [e.ids for e in self.tok.encode_batch(texts, add_special_tokens=True)]
        return [[self.bos_id, *ids] for ids in self.encode_batch(texts)]

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = False) -> tuple[list[int], list[int]]:
        """Token ids (those of ``apply_chat_template(messages, tokenize=True)``) and a loss mask that is 1
        exactly on assistant content and the token that ends its turn -- but for an assistant turn marked
        ``"train": False`` (a repair dialogue's failed attempt: context, not a target)."""
        if self.chat_format == "template":
            return self._template_chat(messages, add_generation_prompt)
        pieces = self._native_pieces(messages, add_generation_prompt)
        text, spans, pos = "", [], 0
        for piece, learn in pieces:
            if learn:
                spans.append((pos, pos + len(piece)))
            text += piece
            pos += len(piece)
        enc = self.tok.encode(text, add_special_tokens=False)  # one string, as transformers tokenises it
        mask = [int(any(s <= start < e for s, e in spans)) for start, _ in enc.offsets]
        return list(enc.ids), mask

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        """The chat as text, as this tokenizer's chat format writes it."""
        if self.chat_format == "template":
            return self._render(messages, add_generation_prompt)
        return "".join(p for p, _ in self._native_pieces(messages, add_generation_prompt))

    def _native_pieces(self, messages: list[dict], add_generation_prompt: bool) -> list[tuple[str, bool]]:
        """(text, learned) pieces of a chat in the trex or deepseek_v4 format."""
        trex = self.chat_format == "trex"
        pieces = [(BOS if trex else DS_BOS, False)]
        for m in messages:
            role, content = m["role"], m["content"]
            if role not in ROLES:
                raise ValueError(f"unknown chat role {role!r} (expected one of {ROLES})")
            if not isinstance(content, str):
                raise TypeError(f"chat content must be a string, got {type(content).__name__}")
            learn = role == "assistant" and m.get("train") is not False  # an assistant turn marked train: False
            if trex:                                                        # (a repair dialogue's failed attempt)
                pieces += [(f"{ROLE_TOKENS[role]}\n", False), (content + END, learn), ("\n", False)]
            elif role == "assistant":
                pieces += [(DS_GENERATION_PROMPT, False), (content + DS_EOS, learn)]
            else:
                pieces.append((content if role == "system" else DS_USER + content, False))
        if add_generation_prompt:
            pieces.append((f"{ROLE_TOKENS['assistant']}\n" if trex else DS_GENERATION_PROMPT, False))
        return pieces

    # ------------------------------------------------------------------------------- template format

    def _render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        import jinja2  # lazy: only the template chat format needs it

        if self._template is None:
            self._template = _compile_template(self.chat_template or "", self.template_file)
        names = {n: self._config_token(n) for n in ("bos_token", "eos_token", "pad_token", "unk_token")}
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         tools=None, documents=None, **{k: v for k, v in names.items() if v})
        except jinja2.exceptions.TemplateError as e:
            raise TokenizerFormatError(f"{self.template_file}: the chat template failed: {e}") from e

    def _template_chat(self, messages: list[dict], add_generation_prompt: bool) -> tuple[list[int], list[int]]:
        """Ids of the rendered chat; the mask from rendering prefixes: assistant turn ``i`` is the tokens of
        ``messages[:i + 1]`` after those of ``messages[:i]`` with the generation prompt, up to its last
        special token (the end of the turn) — which requires the template to be prefix-stable."""
        ids = self.encode(self._render(messages, add_generation_prompt))
        mask = [0] * len(ids)
        for i, m in enumerate(messages):
            if m.get("role") != "assistant" or m.get("train") is False:
                continue
            head = self.encode(self._render(messages[:i], True))
            turn = self.encode(self._render(messages[:i + 1], False))
            if turn[:len(head)] != head or ids[:len(turn)] != turn:
                raise TokenizerFormatError(
                    f"{self.template_file}: the chat template is not prefix-stable at message {i} (the tokens of "
                    f"messages[:{i}] with add_generation_prompt=True are not a prefix of those of messages[:{i + 1}], "
                    f"or those not of the whole chat's): the assistant loss mask cannot be built")
            ends = [j for j in range(len(head), len(turn)) if turn[j] in self._special]
            for j in range(len(head), (ends[-1] + 1) if ends else len(turn)):
                mask[j] = 1
        return ids, mask

    # ---------------------------------------------------------------------------------- agreement

    def agreement_problems(self) -> list[str]:
        """Where ``transformers`` (and vLLM) loading this directory would tokenize differently from this
        tokenizer: plain text (the ``tokenizer.json`` post-processor) and chats (the chat template, on probe
        conversations). Empty when they agree; always empty for the template format, whose files are the rule."""
        if self.chat_format == "template":
            return []
        problems = []
        probe = "Maximise 3 x + 4 y"
        if self.tok.encode(probe, add_special_tokens=True).ids != self.encode_text(probe):
            problems.append(f"{self.file}: its post-processor does not put exactly BOS before plain text "
                            f"(add_special_tokens=True), which training does: transformers and vLLM completions "
                            f"would tokenize plain text differently")
        if not self.chat_template:
            problems.append(f"{self.file.parent}: no chat_template (tokenizer_config.json or chat_template.jinja): "
                            f"transformers cannot write chats in the {self.chat_format} format")
            return problems
        for messages, agp in PROBES:
            native = self.render_chat(messages, agp)
            try:
                rendered = self._render(messages, agp)
            except TokenizerFormatError as e:
                problems.append(str(e))
                break
            if rendered != native:
                problems.append(f"{self.template_file}: its chat_template writes {rendered!r} where the "
                                f"{self.chat_format} format is {native!r}")
                break
        return problems


def iter_texts_from_rows(rows: Iterable[dict]) -> Iterator[str]:
    for r in rows:
        if "text" in r:
            yield r["text"]
        for m in r.get("messages") or []:
            yield m["content"]
