"""A pool of OpenAI-compatible endpoints for data work, with a persistent response cache and per-stage accounting.

- **Endpoints** (``data.llm.endpoints``): vLLM / vllm-ascend / SGLang servers, hosted APIs, ``trex serve``. Each
  request goes over ``httpx`` through :class:`eval.backends.OpenAIBackend` (retries on 429 / 5xx / connection
  errors with exponential back-off honouring ``Retry-After``, a per-request timeout); at most ``max_concurrency``
  requests are in flight per endpoint.
- **Routing**: weighted rendezvous hashing of the request (messages + sampling) over the endpoints, so an
  endpoint gets a ``weight`` share of the requests and the same request always prefers the same endpoint; when
  it fails (after its retries) the next endpoint in the request's order is tried.
- **Cache** (``<cache_dir>/responses.sqlite``): every answer is stored as it arrives, keyed by sha256 of
  (endpoint model, messages, sampling: temperature, top_p, max_tokens, seed, and the endpoint's ``extra_body``).
  Before anything is sent, the request's endpoints are looked up in its order; a hit costs no request. So a
  crashed or repeated run pays nothing twice. Failed requests are not stored.
- **Budgets** (per stage): ``max_requests`` (answers requested from endpoints; cache hits are free) is allotted
  in the order of the requests, ``max_completion_tokens`` is checked before each batch; a request over budget
  is not sent and its reply says so (``refused``).
- **Accounting** (:class:`Usage`): answers asked for = cache hits + answered + failed + refused, HTTP requests
  (retries included), tokens, per endpoint.
"""

from __future__ import annotations

import hashlib
import json
import math
import sqlite3
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from eval.backends import OpenAIBackend, SamplingParams
from trex.core.config import LLMBudget, LLMEndpoint

CACHE_FILE = "responses.sqlite"
CACHE_VERSION = 1  # part of every key: bumped if what a key means changes


@dataclass
class Ask:
    """One answer wanted: the conversation and its sampling (``seed`` fixed per request, so answers repeat)."""

    messages: list[dict]
    temperature: float
    top_p: float
    max_tokens: int
    seed: int

    def sampling(self) -> dict:
        return {"temperature": self.temperature, "top_p": self.top_p, "max_tokens": self.max_tokens, "seed": self.seed}


@dataclass
class Reply:
    """An answer, or why there is none (``error``: every endpoint failed; ``refused``: over the stage's budget)."""

    text: str = ""
    finish_reason: str = ""
    model: str | None = None
    endpoint: str | None = None
    cached: bool = False
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None
    refused: bool = False

    @property
    def ok(self) -> bool:
        return self.error is None and not self.refused


def request_seed(data_seed: int, row_id: str, purpose: str) -> int:
    """A request's seed: fixed by the data seed, the instance and the purpose, so answers repeat (and cache)."""
    return int.from_bytes(hashlib.sha256(f"{data_seed}/{row_id}/{purpose}".encode()).digest()[:4], "big") >> 1


def failure(reply: Reply) -> str:
    """The rejection reason of an item whose request got no answer."""
    return "llm_budget_exhausted" if reply.refused else "llm_error"


def cache_key(model: str, messages: list[dict], sampling: dict, extra_body: dict) -> str:
    payload = {"v": CACHE_VERSION, "model": model, "messages": messages, "sampling": sampling, "extra_body": extra_body}
    return hashlib.sha256(json.dumps(payload, sort_keys=True, ensure_ascii=False).encode()).hexdigest()


class ResponseCache:
    """Answers on disk (SQLite, one row per key), shared by threads and by concurrent runs."""

    def __init__(self, directory: str | Path):
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        self.path = path / CACHE_FILE
        self._db = sqlite3.connect(self.path, check_same_thread=False, timeout=60, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("CREATE TABLE IF NOT EXISTS responses (key TEXT PRIMARY KEY, model TEXT NOT NULL, "
                         "response TEXT NOT NULL, created REAL NOT NULL)")
        self._lock = threading.Lock()

    def get(self, key: str) -> dict | None:
        with self._lock:
            row = self._db.execute("SELECT response FROM responses WHERE key = ?", (key,)).fetchone()
        return json.loads(row[0]) if row else None

    def put(self, key: str, model: str, response: dict) -> None:
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO responses (key, model, response, created) VALUES (?, ?, ?, ?)",
                             (key, model, json.dumps(response, sort_keys=True), time.time()))

    def __len__(self) -> int:
        with self._lock:
            return self._db.execute("SELECT COUNT(*) FROM responses").fetchone()[0]

    def close(self) -> None:
        with self._lock:
            self._db.close()


COUNTERS = ("calls", "cache_hits", "answered", "failed", "refused_budget", "http_requests", "retries",
            "prompt_tokens", "completion_tokens", "cached_completion_tokens")
ENDPOINT_COUNTERS = ("requests", "retries", "errors", "cache_hits", "prompt_tokens", "completion_tokens")


@dataclass
class Usage:
    """One stage's use of the endpoints, under its budget."""

    budget: LLMBudget = field(default_factory=LLMBudget)
    counts: dict = field(default_factory=lambda: dict.fromkeys(COUNTERS, 0))
    endpoints: dict = field(default_factory=dict)
    seconds: float = 0.0

    def endpoint(self, ep: LLMEndpoint) -> dict:
        return self.endpoints.setdefault(ep.label, {"model": ep.model, **dict.fromkeys(ENDPOINT_COUNTERS, 0)})

    @property
    def sent(self) -> int:
        return self.counts["answered"] + self.counts["failed"]

    def to_dict(self) -> dict:
        c = self.counts
        return {**c, "sent": self.sent, "seconds": round(self.seconds, 3), "endpoints": self.endpoints,
                "budget": self.budget.model_dump(mode="json"),
                "balanced": c["calls"] == c["cache_hits"] + c["answered"] + c["failed"] + c["refused_budget"]}


class LLMClient:
    """The endpoint pool of one run (see the module docstring). Use as a context manager."""

    def __init__(self, endpoints: list[LLMEndpoint], cache_dir: str | Path):
        if not endpoints:
            raise ValueError("data.llm.endpoints: no endpoint configured")
        self.endpoints = list(endpoints)
        self.backends = [OpenAIBackend(e.model, e.base_url, api_key_env=e.api_key_env or "",
                                       max_concurrency=e.max_concurrency, timeout_s=e.timeout_s,
                                       max_retries=e.max_retries, backoff_s=e.backoff_s, max_backoff_s=e.max_backoff_s,
                                       extra_body=e.extra_body, reasoning_as_think=True) for e in self.endpoints]
        self.clients = [b.http_client() for b in self.backends]
        self.slots = [threading.Semaphore(e.max_concurrency) for e in self.endpoints]
        self.cache = ResponseCache(cache_dir)
        self._lock = threading.Lock()

    def __enter__(self) -> "LLMClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for c in self.clients:
            c.close()
        self.cache.close()

    def route(self, ask: Ask) -> list[int]:
        """The endpoints to try for ``ask``, best first (weighted rendezvous hashing: endpoint ``e`` comes first for
        a share ``weight_e / sum(weights)`` of the requests)."""
        digest = hashlib.sha256(json.dumps([ask.messages, ask.sampling()], sort_keys=True).encode()).hexdigest()

        def score(i: int) -> float:
            h = hashlib.sha256(f"{self.endpoints[i].label}\0{digest}".encode()).digest()
            u = (int.from_bytes(h[:8], "big") + 1) / (2 ** 64 + 2)  # uniform in (0, 1)
            return self.endpoints[i].weight / -math.log(u)

        return sorted(range(len(self.endpoints)), key=lambda i: (-score(i), i))

    def _key(self, i: int, ask: Ask) -> str:
        e = self.endpoints[i]
        return cache_key(e.model, ask.messages, ask.sampling(), e.extra_body)

    def ask(self, asks: list[Ask], usage: Usage) -> list[Reply]:
        """One reply per ask, in order: from the cache, from an endpoint, or why not (``error`` / ``refused``)."""
        replies: list[Reply | None] = [None] * len(asks)
        routes = [self.route(a) for a in asks]
        usage.counts["calls"] += len(asks)
        todo = []
        for n, (a, order) in enumerate(zip(asks, routes)):
            for i in order:
                hit = self.cache.get(self._key(i, a))
                if hit is not None:
                    replies[n] = Reply(hit["text"], hit["finish_reason"], self.endpoints[i].model,
                                       self.endpoints[i].label, True, hit["prompt_tokens"], hit["completion_tokens"])
                    usage.counts["cache_hits"] += 1
                    usage.counts["cached_completion_tokens"] += hit["completion_tokens"]
                    usage.endpoint(self.endpoints[i])["cache_hits"] += 1
                    break
            else:
                todo.append(n)
        b = usage.budget
        allowed = len(todo) if b.max_requests is None else max(0, b.max_requests - usage.sent)
        if b.max_completion_tokens is not None and usage.counts["completion_tokens"] >= b.max_completion_tokens:
            allowed = 0
        for n in todo[allowed:]:
            replies[n] = Reply(refused=True, error="over the stage's budget (data.llm.<stage>.max_requests / "
                                                   "max_completion_tokens)")
            usage.counts["refused_budget"] += 1
        todo = todo[:allowed]
        if todo:
            t0 = time.perf_counter()
            retries0 = [be.stats["retries"] for be in self.backends]
            workers = min(len(todo), sum(e.max_concurrency for e in self.endpoints))
            with ThreadPoolExecutor(max_workers=workers) as pool:
                for n, reply in zip(todo, pool.map(lambda n: self._send(asks[n], routes[n], usage), todo)):
                    replies[n] = reply
            for i, (be, r0) in enumerate(zip(self.backends, retries0)):
                usage.endpoint(self.endpoints[i])["retries"] += be.stats["retries"] - r0
                usage.counts["retries"] += be.stats["retries"] - r0
                usage.counts["http_requests"] += be.stats["retries"] - r0
            usage.seconds += time.perf_counter() - t0
        return replies  # type: ignore[return-value]

    def _send(self, ask: Ask, order: list[int], usage: Usage) -> Reply:
        params = SamplingParams(temperature=ask.temperature, top_p=ask.top_p, max_new_tokens=ask.max_tokens,
                                seed=ask.seed)
        problems = []
        for i in order:
            ep = self.endpoints[i]
            with self.slots[i]:
                comp = self.backends[i].request(self.clients[i], ask.messages, params)
            with self._lock:
                stats = usage.endpoint(ep)
                stats["requests"] += 1
                usage.counts["http_requests"] += 1
                if comp.finish_reason == "error":
                    stats["errors"] += 1
                else:
                    stats["prompt_tokens"] += comp.prompt_tokens
                    stats["completion_tokens"] += comp.completion_tokens
                    usage.counts["answered"] += 1
                    usage.counts["prompt_tokens"] += comp.prompt_tokens
                    usage.counts["completion_tokens"] += comp.completion_tokens
            if comp.finish_reason == "error":
                problems.append(f"{ep.label}: {comp.error}")
                continue
            self.cache.put(self._key(i, ask), ep.model, {"text": comp.text, "finish_reason": comp.finish_reason,
                                                         "prompt_tokens": comp.prompt_tokens,
                                                         "completion_tokens": comp.completion_tokens,
                                                         "endpoint": ep.label})
            return Reply(comp.text, comp.finish_reason, ep.model, ep.label, False, comp.prompt_tokens,
                         comp.completion_tokens)
        with self._lock:
            usage.counts["failed"] += 1
        return Reply(error="; ".join(problems)[-2000:])
