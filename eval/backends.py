"""Generation backends behind one interface: chat messages in, :class:`Completion` objects out.

``make_backend(kind, model, **opts)`` builds one of

* ``native`` — a T-Rex export directory, decoded by :mod:`trainer.generate` (cached, continuous batching);
* ``hf`` — any local ``transformers`` causal-LM directory (a T-Rex export included: it is a DeepSeek-V4 one);
* ``vllm`` — an offline ``vllm.LLM`` engine (CUDA, or Ascend NPUs through vllm-ascend), imported only here;
* ``openai`` — any OpenAI-compatible ``/v1/chat/completions`` endpoint (vLLM, SGLang, ``trex serve``, hosted).

Every backend takes the same :class:`SamplingParams`, returns completions in the order of the inputs,
and records what it did in :meth:`describe` (kind, model, sampling parameters, options, counters) for
reports. A request that fails (a prompt too long for the model, an HTTP error after retries) yields a
``Completion`` with ``finish_reason == "error"`` and the message in ``error``; the batch goes on.

Each backend imports its own dependencies when it is built (torch, transformers, vllm, httpx, the native
decoder): they are optional extras for the others (vllm is never installed on a CPU machine) and cost
seconds of start-up for commands that use another backend.
"""

from __future__ import annotations

import json
import os
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field

from trex.core.refs import MissingInputError

KINDS = ("native", "hf", "vllm", "openai")
# end-of-turn tokens that chat models emit instead of (or before) their tokenizer's eos token
END_OF_TURN = ("<|end|>", "<|im_end|>", "<|eot_id|>", "<|end_of_turn|>", "<end_of_turn>")
ACCELERATOR_HINT = "pip install 'trex-or[gpu]' (CUDA) or 'trex-or[npu]' (Ascend NPU, vllm-ascend)"

Messages = list[dict]


class SamplingParams(BaseModel):
    """Decoding parameters shared by every backend (``temperature == 0`` is greedy decoding)."""

    model_config = ConfigDict(extra="forbid")
    temperature: float = Field(0.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    max_new_tokens: int = Field(256, ge=1)
    seed: int = 42
    stop: list[str] = Field(default_factory=list, description="stop strings; the text ends before the first one")

    @classmethod
    def from_config(cls, cfg: Any, stop: list[str] | None = None) -> "SamplingParams":
        """From any object with ``temperature``, ``top_p``, ``max_new_tokens`` and ``seed`` (e.g. ``EvalConfig``)."""
        return cls(temperature=cfg.temperature, top_p=cfg.top_p, max_new_tokens=cfg.max_new_tokens, seed=cfg.seed,
                   stop=list(stop or []))


@dataclass
class Completion:
    """One generated answer. ``finish_reason`` is ``stop`` (end token or stop string), ``length`` or ``error``."""

    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str
    error: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)


@runtime_checkable
class Backend(Protocol):
    kind: str
    model: str

    def generate(self, messages_list: list[Messages], params: SamplingParams) -> list[Completion]:
        """One completion per conversation, in order."""
        ...

    def describe(self) -> dict:
        """``{"kind", "model", "params", "options", "stats"}`` for reports."""
        ...


class BackendUnavailableError(RuntimeError):
    """The selected backend needs a package that is not installed."""


def truncate_at_stop(text: str, stop: list[str]) -> tuple[str, bool]:
    """``text`` cut before the earliest stop string, and whether one was found."""
    cut = min((i for i in (text.find(s) for s in stop if s) if i >= 0), default=-1)
    return (text[:cut], True) if cut >= 0 else (text, False)


def resolve_model_dir(model: str | Path) -> Path:
    """A model directory, or a stage output directory holding ``export/`` (else :class:`MissingInputError`, a
    ``FileNotFoundError``, which the CLI turns into exit code 2)."""
    p = Path(model)
    if (p / "export" / "config.json").is_file():
        p = p / "export"
    if not (p / "config.json").is_file():
        raise MissingInputError(f"{model}: not a model directory (no config.json, no export/config.json)")
    return p


def error_completion(message: str, prompt_tokens: int = 0) -> Completion:
    return Completion("", prompt_tokens, 0, "error", message)


class _Base:
    kind = ""

    def __init__(self, model: str, options: dict):
        self.model = str(model)
        self.options = options
        self.params: SamplingParams | None = None
        self.stats = {"requests": 0, "errors": 0}
        self._stats_lock = threading.Lock()

    def _count(self, completions: list[Completion], params: SamplingParams) -> list[Completion]:
        with self._stats_lock:
            self.params = params
            self.stats["requests"] += len(completions)
            self.stats["errors"] += sum(c.finish_reason == "error" for c in completions)
        return completions

    def describe(self) -> dict:
        return {"kind": self.kind, "model": self.model,
                "params": None if self.params is None else self.params.model_dump(),
                "options": self.options, "stats": dict(self.stats)}


# ----------------------------------------------------------------------------------------------- native


class NativeBackend(_Base):
    """A T-Rex (or DeepSeek-V4 HF) export on the native model, decoded with a KV cache and continuous
    batching (:func:`trainer.generate.decode_rows`): prompts sorted by length, at most ``batch_size`` decoding
    at once, a waiting prompt joining as soon as another finishes. Request ``i`` samples with its own
    generator seeded ``params.seed + i`` (as the openai and vllm backends seed it), so its answer does not
    depend on the other requests nor on ``batch_size``."""

    kind = "native"

    def __init__(self, model: str | Path, batch_size: int = 16):
        from trainer.export import load_export
        from trainer.tokenizer import ChatTokenizer

        super().__init__(str(model), {"batch_size": batch_size})
        d = resolve_model_dir(model)
        self.net, self.tok = load_export(d), ChatTokenizer(d)
        self.batch_size = batch_size
        self.max_seq_len = self.net.cfg.max_seq_len
        self.end_ids = {self.tok.end_id, self.tok.eos_id}

    def encode(self, messages: Messages) -> list[int]:
        return self.tok.encode_chat(messages, add_generation_prompt=True)[0]

    def prompt(self, messages: Messages) -> tuple[list[int] | None, Completion | None]:
        """The prompt ids of ``messages``, or the error completion saying why there are none."""
        try:
            ids = self.encode(messages)
        except (KeyError, ValueError, TypeError) as e:
            return None, error_completion(f"bad messages: {e}")
        if len(ids) >= self.max_seq_len:
            return None, error_completion(f"prompt of {len(ids)} tokens leaves no room under max_seq_len "
                                          f"{self.max_seq_len}", len(ids))
        return ids, None

    def row(self, ids: list[int], params: SamplingParams, seed: int):
        """A decode row (:class:`trainer.generate.Row`) for prompt ``ids`` under ``params``, sampled with ``seed``."""
        from trainer.generate import Row, stop_strings

        return Row(ids, params.max_new_tokens, params.temperature, params.top_p, seed,
                   stop_strings(self.tok.decode, params.stop))

    def completion(self, row, stop: list[str]) -> Completion:
        """A finished row's completion: its text cut before the first of the ``stop`` strings."""
        text, stopped = truncate_at_stop(self.tok.decode(row.tokens), stop)
        return Completion(text, len(row.prompt), len(row.tokens), "stop" if stopped else row.finish_reason)

    def generate(self, messages_list: list[Messages], params: SamplingParams) -> list[Completion]:
        from trainer.generate import decode_rows

        out: list[Completion | None] = [None] * len(messages_list)
        rows = {}
        for i, m in enumerate(messages_list):
            ids, out[i] = self.prompt(m)
            if ids is not None:
                rows[i] = self.row(ids, params, params.seed + i)
        order = sorted(rows, key=lambda i: len(rows[i].prompt))
        decode_rows(self.net, [rows[i] for i in order], self.end_ids, self.tok.pad_id, self.batch_size)
        for i, r in rows.items():
            out[i] = self.completion(r, params.stop)
        return self._count([c for c in out if c is not None], params)


# ------------------------------------------------------------------------------------ shared HF prompting


def _hf_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def _is_trex_export(model_dir: Path) -> bool:
    try:
        return "trex_model_config" in json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return False


def _hf_encoder(tok, add_bos: bool):
    """Chat messages -> prompt ids with the tokenizer's chat template (plus BOS where the template omits it)."""
    bos = tok.bos_token_id

    def encode(messages: Messages) -> list[int]:
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = list(tok(text, add_special_tokens=False)["input_ids"])
        if add_bos and bos is not None and (not ids or ids[0] != bos):
            ids.insert(0, bos)
        return ids

    return encode


def _auto_add_bos(tok, model_dir: Path, add_bos: bool | None) -> bool:
    """T-Rex exports are trained with a BOS that their chat template does not write; so are tokenizers that
    declare ``add_bos_token``. Elsewhere the template is trusted as it is."""
    if add_bos is not None:
        return add_bos
    return _is_trex_export(model_dir) or bool(getattr(tok, "add_bos_token", False))


def _end_ids(tok, model=None) -> set[int]:
    ids: set[int] = set()
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for e in [tok.eos_token_id, *(gen_eos if isinstance(gen_eos, (list, tuple)) else [gen_eos])]:
        if e is not None:
            ids.add(int(e))
    vocab = tok.get_vocab()
    ids.update(vocab[t] for t in END_OF_TURN if t in vocab)
    return ids


# ------------------------------------------------------------------------------------------------ hf


class HFBackend(_Base):
    """Any local ``transformers`` causal LM: chat template, batched ``model.generate`` (greedy at temperature
    0, else temperature / top-p sampling seeded per batch), stop strings honoured by truncation.

    ``padding="left"`` batches prompts of different lengths with left padding; ``"none"`` batches only
    prompts of equal length. The default is ``"none"`` for DeepSeek-V4, whose transformers implementation
    lets left padding leak into its compressed / sliding attention (padded rows decode differently), and
    ``"left"`` otherwise.
    """

    kind = "hf"

    def __init__(self, model: str | Path, batch_size: int = 8, device: str | None = None, dtype: str = "auto",
                 padding: str | None = None, add_bos: bool | None = None, trust_remote_code: bool = False):
        import torch
        from transformers import AutoModelForCausalLM

        d = resolve_model_dir(model)
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.net = AutoModelForCausalLM.from_pretrained(str(d), dtype=dtype, trust_remote_code=trust_remote_code)
        self.net.to(self.device).eval()
        self.tok = _hf_tokenizer(d)
        if padding is None:
            padding = "none" if getattr(self.net.config, "model_type", "") == "deepseek_v4" else "left"
        if padding not in ("left", "none"):
            raise ValueError(f"padding must be 'left' or 'none', not {padding!r}")
        add_bos = _auto_add_bos(self.tok, d, add_bos)
        super().__init__(str(model), {"batch_size": batch_size, "device": self.device, "dtype": dtype,
                                      "padding": padding, "add_bos": add_bos})
        self.batch_size, self.padding = batch_size, padding
        self.encode = _hf_encoder(self.tok, add_bos)
        self.end_ids = _end_ids(self.tok, self.net)
        pad = self.tok.pad_token_id
        self.pad_id = int(pad) if pad is not None else min(self.end_ids, default=0)
        self.max_len = getattr(self.net.config, "max_position_embeddings", None)

    def _batches(self, prompts: dict[int, list[int]]) -> list[list[int]]:
        order = sorted(prompts, key=lambda i: len(prompts[i]))
        if self.padding == "left":
            return [order[s:s + self.batch_size] for s in range(0, len(order), self.batch_size)]
        batches: list[list[int]] = []
        for i in order:
            if batches and len(batches[-1]) < self.batch_size and len(prompts[batches[-1][0]]) == len(prompts[i]):
                batches[-1].append(i)
            else:
                batches.append([i])
        return batches

    def generate(self, messages_list: list[Messages], params: SamplingParams) -> list[Completion]:
        import torch
        from transformers import GenerationConfig, StoppingCriteriaList

        out: list[Completion | None] = [None] * len(messages_list)
        prompts: dict[int, list[int]] = {}
        for i, m in enumerate(messages_list):
            try:
                prompts[i] = self.encode(m)
            except Exception as e:  # a template error concerns this conversation only
                out[i] = error_completion(f"chat template failed: {e}")
                continue
            if self.max_len and len(prompts[i]) >= self.max_len:
                out[i] = error_completion(f"prompt of {len(prompts[i])} tokens leaves no room under "
                                          f"max_position_embeddings {self.max_len}", len(prompts.pop(i)))
        sample = params.temperature > 0
        # every knob set: unset ones would be filled from the model's generation_config.json (a checkpoint's
        # top_k or repetition_penalty must not change what the recorded parameters say was run)
        warpers = {"temperature": params.temperature, "top_p": params.top_p, "top_k": 0, "min_p": 0.0,
                   "typical_p": 1.0} if sample else {}
        gen_cfg = GenerationConfig(max_new_tokens=params.max_new_tokens, min_new_tokens=0, do_sample=sample,
                                   num_beams=1, repetition_penalty=1.0, no_repeat_ngram_size=0,
                                   eos_token_id=sorted(self.end_ids), pad_token_id=self.pad_id, **warpers)
        for b, chunk in enumerate(self._batches(prompts)):
            width = max(len(prompts[i]) for i in chunk)
            ids = torch.tensor([[self.pad_id] * (width - len(prompts[i])) + prompts[i] for i in chunk])
            mask = torch.tensor([[0] * (width - len(prompts[i])) + [1] * len(prompts[i]) for i in chunk])
            criteria = StoppingCriteriaList([_stop_on_text(self.tok, params.stop, width)] if params.stop else [])
            devices = [torch.device(self.device)] if torch.device(self.device).type == "cuda" else []
            with torch.no_grad(), torch.random.fork_rng(devices=devices):
                torch.manual_seed(params.seed + b)
                gen = self.net.generate(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                                        generation_config=gen_cfg, stopping_criteria=criteria)
            for i, row in zip(chunk, gen[:, width:].tolist()):
                out[i] = self._completion(row, len(prompts[i]), params)
        return self._count([c for c in out if c is not None], params)

    def _completion(self, row: list[int], n_prompt: int, params: SamplingParams) -> Completion:
        cut = next((k for k, t in enumerate(row) if t in self.end_ids), None)
        if cut is not None:
            row, reason = row[:cut], "stop"
        else:
            while row and row[-1] == self.pad_id:
                row = row[:-1]  # a row that stopped on a stop string, padded while others went on
            reason = "length" if len(row) >= params.max_new_tokens else "stop"
        text, stopped = truncate_at_stop(self.tok.decode(row, skip_special_tokens=True), params.stop)
        return Completion(text, n_prompt, len(row), "stop" if stopped else reason)


def _stop_on_text(tok, strings: list[str], prompt_width: int):
    """A ``StoppingCriteria``: a row is done once its generated text (last 64 tokens) contains a stop string."""
    import torch
    from transformers import StoppingCriteria

    wanted = [s for s in strings if s]

    class StopOnText(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            tails = tok.batch_decode(input_ids[:, prompt_width:][:, -64:], skip_special_tokens=True)
            return torch.tensor([any(s in t for s in wanted) for t in tails], device=input_ids.device)

    return StopOnText()


# ----------------------------------------------------------------------------------------------- vllm


class VLLMBackend(_Base):
    """An offline ``vllm.LLM`` engine. Prompts are built with the model's HF tokenizer (as in ``hf``, BOS
    included for T-Rex exports) and passed as token ids; request ``i`` samples with seed ``seed + i``."""

    kind = "vllm"

    def __init__(self, model: str | Path, tensor_parallel_size: int = 1, dtype: str = "auto",
                 max_model_len: int | None = None, gpu_memory_utilization: float = 0.9,
                 add_bos: bool | None = None, **engine_opts: Any):
        try:
            import vllm
        except ImportError as e:
            raise BackendUnavailableError(f"the vllm backend needs vLLM, which is not installed ({e}); "
                                          f"{ACCELERATOR_HINT}") from e
        d = resolve_model_dir(model)
        self.tok = _hf_tokenizer(d)
        add_bos = _auto_add_bos(self.tok, d, add_bos)
        super().__init__(str(model), {"tensor_parallel_size": tensor_parallel_size, "dtype": dtype,
                                      "max_model_len": max_model_len, "add_bos": add_bos,
                                      "gpu_memory_utilization": gpu_memory_utilization, **engine_opts})
        self.vllm = vllm
        self.llm = vllm.LLM(model=str(d), tokenizer=str(d), tensor_parallel_size=tensor_parallel_size, dtype=dtype,
                            max_model_len=max_model_len, gpu_memory_utilization=gpu_memory_utilization, **engine_opts)
        self.encode = _hf_encoder(self.tok, add_bos)
        self.end_ids = sorted(_end_ids(self.tok))
        self.max_len = self.llm.llm_engine.model_config.max_model_len

    def generate(self, messages_list: list[Messages], params: SamplingParams) -> list[Completion]:
        out: list[Completion | None] = [None] * len(messages_list)
        idx, prompts, sps = [], [], []
        for i, m in enumerate(messages_list):
            try:
                ids = self.encode(m)
            except Exception as e:
                out[i] = error_completion(f"chat template failed: {e}")
                continue
            if len(ids) >= self.max_len:
                out[i] = error_completion(f"prompt of {len(ids)} tokens leaves no room under max_model_len "
                                          f"{self.max_len}", len(ids))
                continue
            idx.append(i)
            prompts.append({"prompt_token_ids": ids})
            sps.append(self.vllm.SamplingParams(n=1, temperature=params.temperature, top_p=params.top_p,
                                                max_tokens=params.max_new_tokens, seed=params.seed + i,
                                                stop=params.stop or None, stop_token_ids=self.end_ids,
                                                skip_special_tokens=True))
        results = self.llm.generate(prompts, sampling_params=sps, use_tqdm=False) if prompts else []
        for i, r in zip(idx, results):
            o = r.outputs[0]
            text, stopped = truncate_at_stop(o.text, params.stop)
            reason = "stop" if stopped else (o.finish_reason if o.finish_reason in ("stop", "length") else "stop")
            out[i] = Completion(text, len(r.prompt_token_ids or []), len(o.token_ids), reason)
        return self._count([c for c in out if c is not None], params)


# --------------------------------------------------------------------------------------------- openai


class OpenAIBackend(_Base):
    """An OpenAI-compatible ``POST {base_url}/chat/completions`` endpoint over ``httpx``.

    ``model`` is the served model name. Up to ``max_concurrency`` requests are in flight; a request is
    retried on HTTP 429 / 5xx and connection errors / timeouts with exponential backoff (``backoff_s *
    2**attempt``, capped, honouring ``Retry-After``); after ``max_retries`` it becomes an error completion.
    The API key is read from the environment variable ``api_key_env`` (none sent when it is unset).
    Request ``i`` carries seed ``seed + i`` (as the native backend seeds it; ``trex serve`` batches such
    concurrent requests, each with its own seed, and answers each as the native backend does). ``extra_body``
    is merged into every request (e.g. vLLM's ``top_k`` or ``chat_template_kwargs``). With ``reasoning_as_think``,
    a reasoning server's separate ``reasoning_content`` (vLLM / SGLang reasoning parsers) is put back in front of
    the answer as ``<think>...</think>`` (the data engine's self-distillation keeps the reasoning).

    :meth:`request` (one conversation, on a client from :meth:`http_client`) is the building block of
    :meth:`generate` and of the data engine's endpoint pool (``ordata/llm/client.py``).
    """

    kind = "openai"

    def __init__(self, model: str, base_url: str | None = None, api_key_env: str = "OPENAI_API_KEY",
                 max_concurrency: int = 8, timeout_s: float = 600.0, max_retries: int = 4, backoff_s: float = 1.0,
                 max_backoff_s: float = 60.0, extra_body: dict | None = None, max_tokens_field: str = "max_tokens",
                 reasoning_as_think: bool = False):
        base_url = (base_url or os.environ.get("OPENAI_BASE_URL") or "http://127.0.0.1:8000/v1").rstrip("/")
        super().__init__(model, {"base_url": base_url, "api_key_env": api_key_env, "max_concurrency": max_concurrency,
                                 "timeout_s": timeout_s, "max_retries": max_retries, "backoff_s": backoff_s,
                                 "extra_body": extra_body or {}, "max_tokens_field": max_tokens_field})
        self.url = f"{base_url}/chat/completions"
        self.api_key_env = api_key_env
        self.max_concurrency, self.timeout_s, self.max_retries = max_concurrency, timeout_s, max_retries
        self.backoff_s, self.max_backoff_s = backoff_s, max_backoff_s
        self.extra_body, self.max_tokens_field = extra_body or {}, max_tokens_field
        self.reasoning_as_think = reasoning_as_think
        if reasoning_as_think:
            self.options["reasoning_as_think"] = True
        self.stats["retries"] = 0

    def _payload(self, messages: Messages, params: SamplingParams, i: int) -> dict:
        body = {"model": self.model, "messages": messages, "temperature": params.temperature, "top_p": params.top_p,
                self.max_tokens_field: params.max_new_tokens, "seed": params.seed + i, "n": 1}
        if params.stop:
            body["stop"] = params.stop
        return {**body, **self.extra_body}

    def _delay(self, attempt: int, retry_after: str | None) -> float:
        delay = min(self.max_backoff_s, self.backoff_s * 2 ** attempt) * (1 + 0.1 * random.random())
        try:
            return min(self.max_backoff_s, max(delay, float(retry_after))) if retry_after else delay
        except ValueError:  # an HTTP date: keep our own delay
            return delay

    def http_client(self):
        """An ``httpx.Client`` for :meth:`request`: the API key header, the timeout, ``max_concurrency`` connections."""
        import httpx

        key = os.environ.get(self.api_key_env) if self.api_key_env else None
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        limits = httpx.Limits(max_connections=self.max_concurrency, max_keepalive_connections=self.max_concurrency)
        return httpx.Client(headers=headers, timeout=self.timeout_s, limits=limits)

    def request(self, client, messages: Messages, params: SamplingParams, i: int = 0) -> Completion:
        """One conversation (seed ``params.seed + i``), retried as the class docstring says; never raises for HTTP
        or connection problems (they become an error completion)."""
        import httpx

        payload = self._payload(messages, params, i)
        for attempt in range(self.max_retries + 1):
            retry_after = None
            try:
                r = client.post(self.url, json=payload)
            except httpx.TransportError as e:  # connection refused / reset, timeouts
                problem = f"{type(e).__name__}: {e}"
            else:
                if r.status_code == 200:
                    return self._parse(r, params)
                problem = f"HTTP {r.status_code}: {r.text[:500]}"
                if r.status_code != 429 and r.status_code < 500:
                    return error_completion(problem)  # a client error: retrying cannot help
                retry_after = r.headers.get("retry-after")
            if attempt == self.max_retries:
                return error_completion(f"{problem} (after {attempt + 1} attempts)")
            with self._stats_lock:
                self.stats["retries"] += 1
            time.sleep(self._delay(attempt, retry_after))
        raise AssertionError("unreachable")

    def _parse(self, r, params: SamplingParams) -> Completion:
        try:
            data = r.json()
            choice = data["choices"][0]
            message = choice.get("message") or {}
            content = message.get("content") or ""
            usage = data.get("usage") or {}
            reasoning = message.get("reasoning_content") or message.get("reasoning")
            if self.reasoning_as_think and isinstance(reasoning, str) and reasoning and "<think>" not in content:
                content = f"<think>\n{reasoning.strip()}\n</think>\n{content}"
        except (ValueError, KeyError, IndexError, TypeError, AttributeError) as e:
            return error_completion(f"malformed response ({type(e).__name__}: {e}): {r.text[:300]}")
        text, stopped = truncate_at_stop(content, params.stop)
        reason = choice.get("finish_reason") or "stop"
        return Completion(text, int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0),
                          "stop" if stopped or reason not in ("length", "error") else reason)

    def generate(self, messages_list: list[Messages], params: SamplingParams) -> list[Completion]:
        with self.http_client() as client, ThreadPoolExecutor(max_workers=self.max_concurrency) as pool:
            futures = [pool.submit(self.request, client, m, params, i) for i, m in enumerate(messages_list)]
            return self._count([f.result() for f in futures], params)


# ---------------------------------------------------------------------------------------------- factory

_FACTORIES = {"native": NativeBackend, "hf": HFBackend, "vllm": VLLMBackend, "openai": OpenAIBackend}


def make_backend(kind: str, model: str, **opts: Any) -> Backend:
    """Build a backend: ``kind`` in native | hf | vllm | openai; ``model`` a directory (``openai``: the
    served model name); ``opts`` the backend's keyword options."""
    if kind not in _FACTORIES:
        raise ValueError(f"unknown backend {kind!r}; valid kinds: {', '.join(KINDS)}")
    return _FACTORIES[kind](model, **opts)
