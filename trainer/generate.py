"""Cached incremental decoding with continuous batching: greedy or temperature / top-p sampling per row.

A :class:`DecodeBatch` holds the rows being decoded. Rows join between steps: new prompts are prefilled
together (right-padded, one forward) and their cache rows appended to the running cache
(:meth:`DecodeCache.extend`). Rows leave when they finish: an end token, ``stop`` returning True on their
tokens so far (e.g. a stop string in the decoded text), their token budget, or a cancellation; the last running
rows then move into the slots they freed (:func:`compact_order`, the cache copying only those). Each row
keeps its own positions: its token at position ``p`` sits in its cache slot ``p``, so its compressed-attention
windows start at its own first token whatever else is in the batch and whenever it joined. Each row has its
own sampling parameters and, when it samples, its own ``torch.Generator`` seeded with its ``seed``; the rows
sample together (:func:`sample_tokens`), each with one draw from its own generator.

So a row decodes as it would alone: the same tokens whatever else is in the batch. The logits agree with
decoding alone to fp32 rounding (a one-row matrix product runs as a GEMV whose sums round differently from a
GEMM's, ~1e-7), which changes a token only at a near-exact tie; and the CSA indexer's top-k, where scores tie
exactly (ReLU scores at zero), is broken by ``torch.topk`` depending on how many entries the batch holds (the
decode tests use an ``index_topk`` above the entry count, as ``tests/trainer/test_hf_parity.py`` explains).

:func:`generate` decodes a list of prompts this way (prompt ``i`` sampled with seed ``seed + i``), and
:func:`decode_rows` decodes rows with at most ``max_batch`` of them running at once, a waiting row joining as
soon as another finishes.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import torch

from trainer.models.deepseek_v4.model import DecodeCache, Transformer


def sample_tokens(logits_bv: torch.Tensor, temperature_b: list[float], top_p_b: list[float],
                  generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row ``[B]``: the argmax where the row's temperature is 0, else a draw from
    ``softmax(logits / temperature)`` cut to its top-p nucleus. A sampled row takes one uniform number from its own
    generator and inverts the distribution's CDF with it, so its token depends on its logits and its generator
    only, whatever else is in the batch; the softmax, the nucleus and the CDF are batched over the rows."""
    tokens = logits_bv.argmax(-1)
    idx = [j for j, t in enumerate(temperature_b) if t > 0]
    if not idx:
        return tokens
    at = torch.tensor(idx)
    temps = torch.tensor([temperature_b[j] for j in idx], dtype=torch.float32)
    probs = torch.softmax(logits_bv[at].float() / temps[:, None], dim=-1)
    top_p = torch.tensor([top_p_b[j] for j in idx], dtype=torch.float32)
    if bool((top_p < 1.0).any()):  # the nucleus: the most likely tokens whose mass before them is <= top_p
        sorted_p, order = probs.sort(dim=-1, descending=True)
        outside = ((sorted_p.cumsum(-1) - sorted_p) > top_p[:, None]) & (top_p < 1.0)[:, None]
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p.masked_fill(outside, 0.0))
    cdf = probs.double().cumsum(-1)
    u = torch.cat([torch.rand(1, dtype=torch.float64, generator=generators[j]) for j in idx])
    pick = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).squeeze(1).clamp(max=probs.shape[-1] - 1)
    # (u * total rounding up to the total would land past the last token with mass: take the row's mode there)
    empty = probs.gather(1, pick[:, None]).squeeze(1) == 0
    tokens[at] = torch.where(empty, probs.argmax(-1), pick)
    return tokens


def stop_strings(decode: Callable[[list[int]], str], strings: list[str]) -> Callable[[list[int]], bool] | None:
    """A ``stop`` callback that ends a row once its decoded text contains one of ``strings``."""
    if not strings:
        return None
    return lambda ids: any(s in decode(ids[-64:]) for s in strings)


@dataclass(eq=False)
class Row:
    """One sequence to decode: its prompt, its sampling parameters and, as it goes, its generated tokens.

    ``finish_reason`` is set when it leaves the batch: ``stop`` (an end token, which ``tokens`` does not
    hold, or ``stop`` returned True), ``length`` (``max_new_tokens`` or the model's ``max_seq_len``) or
    ``cancelled`` (``cancelled`` was set, from any thread; the row leaves at the next step boundary).
    """

    prompt: list[int]
    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 42
    stop: Callable[[list[int]], bool] | None = None
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    cancelled: bool = False
    logprobs: list[float] | None = None  # a list: the log-probability of every sampled token (and of the end token)
    temperature_logprobs: bool = True  # ... under the tempered distribution it was sampled from (else the raw one)
    end_token: int | None = None  # the end token that finished it, if one did (``tokens`` does not hold it)
    routes: list[torch.Tensor] | None = None  # a list: the expert choices [positions, MoE layers, k] of every token
    # it fed through the model (prompt, then its tokens), chunk by chunk (router replay, trainer/rollout.py)
    budget: int = field(default=0, init=False)
    generator: torch.Generator | None = field(default=None, init=False, repr=False)


class DecodeBatch:
    """The running rows of one model: :meth:`add` prefills new rows and appends them, :meth:`step` decodes
    one token for every running row; finished rows leave. ``forward_passes`` counts model forwards."""

    def __init__(self, model: Transformer, end_ids: set[int], pad_id: int):
        self.model, self.end_ids, self.pad_id = model, set(end_ids), pad_id
        self.rows: list[Row] = []  # running rows, in cache order
        self.cache: DecodeCache | None = None
        self.next_ids = torch.zeros(0, dtype=torch.long)  # per running row: the token to feed next ...
        self.pos = torch.zeros(0, dtype=torch.long)  # ... and its position
        self.forward_passes = 0

    def _logits(self, ids_bt: torch.Tensor, cache: DecodeCache, pos_bt: torch.Tensor, last_b: torch.Tensor,
                rows: list[Row] | None = None, lens: list[int] | None = None):
        """Logits [B, V] at each row's position ``last_b`` (the LM head runs on those positions only). Rows that
        keep ``routes`` get the expert choices of their first ``lens[j]`` positions (all, without ``lens``)."""
        self.forward_passes += 1
        record = rows is not None and any(r.routes is not None for r in rows)
        moes = self.model.moe_layers() if record else []
        for m in moes:
            m.record = True
        try:
            h = self.model.hidden(ids_bt, cache=cache, pos_bt=pos_bt)
        finally:
            for m in moes:
                m.record = False
        if record:
            choices = torch.stack([m.recorded for m in moes], dim=2)  # [B, T, layers, k]
            for j, r in enumerate(rows):
                if r.routes is not None:
                    r.routes.append(choices[j, :lens[j]] if lens is not None else choices[j])
        return self.model.lm_head(self.model.norm(h[torch.arange(len(last_b)), last_b]))

    def _advance(self, rows: list[Row], logits_bv: torch.Tensor) -> list[tuple[int, int]]:
        """Sample one token per row (each from its own generator); ``(index, token)`` of the rows that go on."""
        tokens = sample_tokens(logits_bv, [r.temperature for r in rows], [r.top_p for r in rows],
                               [r.generator for r in rows]).tolist()
        scored = [j for j, r in enumerate(rows) if r.logprobs is not None]
        if scored:  # (RL rollouts: the behaviour policy's log-probability of the token)
            at = torch.tensor(scored)
            scale = torch.tensor([rows[j].temperature if rows[j].temperature_logprobs and rows[j].temperature > 0
                                  else 1.0 for j in scored])
            logp = torch.log_softmax(logits_bv[at].float() / scale[:, None], -1)
            picked = logp.gather(1, torch.tensor([tokens[j] for j in scored])[:, None]).squeeze(1).tolist()
            for j, lp in zip(scored, picked):
                rows[j].logprobs.append(lp)
        return self._take(rows, tokens)

    def _take(self, rows: list[Row], tokens: list[int]) -> list[tuple[int, int]]:
        """Give each row its new token: an end token or ``stop`` finishes it, as does its budget; ``(index, token)``
        of the rows that go on."""
        going = []
        for j, (row, tok) in enumerate(zip(rows, tokens)):
            if tok in self.end_ids:
                row.finish_reason, row.end_token = "stop", tok
                continue
            row.tokens.append(tok)
            if row.stop is not None and row.stop(row.tokens):
                row.finish_reason = "stop"
            elif len(row.tokens) >= row.budget:
                row.finish_reason = "length"
            else:
                going.append((j, tok))
        return going

    @torch.no_grad()
    def add(self, rows: list[Row]) -> None:
        """Prefill ``rows`` in one forward and sample their first tokens; the rows that go on join the batch."""
        max_len = self.model.cfg.max_seq_len
        for row in rows:
            if not row.prompt:
                raise ValueError("an empty prompt cannot be decoded")
            if len(row.prompt) >= max_len:
                raise ValueError(f"prompt of {len(row.prompt)} tokens leaves no room under max_seq_len {max_len}")
        rows = [r for r in rows if not self._cancel(r)]
        if not rows:
            return
        self.model.eval()
        for row in rows:
            row.budget = min(row.max_new_tokens, max_len - len(row.prompt))
            row.generator = torch.Generator().manual_seed(row.seed) if row.temperature > 0 else None
        b, lens = len(rows), torch.tensor([len(r.prompt) for r in rows])
        lmax = int(lens.max())
        ids = torch.full((b, lmax), self.pad_id, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, :len(r.prompt)] = torch.tensor(r.prompt)
        cache = DecodeCache(b, max(len(r.prompt) + r.budget for r in rows))
        going = self._advance(rows, self._logits(ids, cache, torch.arange(lmax).expand(b, -1), lens - 1, rows,
                                                 lens.tolist()))
        if not going:
            return
        keep = torch.tensor([j for j, _ in going])
        if len(going) < b:
            cache.keep(keep)  # (ascending: the rows join in their order)
        if self.cache is None:
            self.cache = cache
        else:
            self.cache.extend(cache)
        self.rows += [rows[j] for j, _ in going]
        self.next_ids = torch.cat([self.next_ids, torch.tensor([t for _, t in going])])
        self.pos = torch.cat([self.pos, lens[keep]])

    @torch.no_grad()
    def step(self) -> list[Row]:
        """Decode one token for every running row; returns those rows (each has a new token or has finished)."""
        self._retain([(j, int(self.next_ids[j])) for j, r in enumerate(self.rows) if not self._cancel(r)])
        rows = list(self.rows)
        if not rows:
            return []
        last = torch.zeros(len(rows), dtype=torch.long)
        logits = self._logits(self.next_ids[:, None], self.cache, self.pos[:, None], last, rows)
        self.pos = self.pos + 1
        self._retain(self._advance(rows, logits))
        return rows

    @staticmethod
    def _cancel(row: Row) -> bool:
        if row.cancelled and row.finish_reason is None:
            row.finish_reason = "cancelled"
        return row.cancelled

    def _retain(self, going: list[tuple[int, int]]) -> None:
        """Keep the rows ``going`` lists (index, next token); the cache drops the others. The rows that stay keep
        their slots, except that the last ones move into the slots of the rows that left
        (:func:`compact_order`): the cache copies those rows only."""
        if not going:
            self.rows, self.cache = [], None
            self.next_ids, self.pos = self.next_ids[:0], self.pos[:0]
            return
        order = compact_order([j for j, _ in going])
        if len(going) < len(self.rows):
            self.cache.keep(torch.tensor(order))
            self.rows = [self.rows[j] for j in order]
            self.pos = self.pos[order]
        token = dict(going)
        self.next_ids = torch.tensor([token[j] for j in order])


def compact_order(kept: list[int]) -> list[int]:
    """The new order of rows ``kept`` (ascending old indices) packed into the first ``len(kept)`` slots with the
    fewest moves: a kept row in those slots stays, the kept rows past them fill the freed slots in turn."""
    n = len(kept)
    stay = {j for j in kept if j < n}
    movers = iter(j for j in kept if j >= n)
    return [j if j in stay else next(movers) for j in range(n)]


def decode_rows(model: Transformer, rows: list[Row], end_ids: set[int], pad_id: int,
                max_batch: int | None = None) -> DecodeBatch:
    """Decode ``rows`` to their end, at most ``max_batch`` at once (default: all); a waiting row joins the
    batch as soon as a running one finishes. Returns the batch (its ``forward_passes``)."""
    batch = DecodeBatch(model, end_ids, pad_id)
    waiting, cap = deque(rows), max(1, max_batch or len(rows))
    while waiting or batch.rows:
        if waiting and len(batch.rows) < cap:
            batch.add([waiting.popleft() for _ in range(min(cap - len(batch.rows), len(waiting)))])
        batch.step()
    return batch


def generate(model: Transformer, prompts: list[list[int]], max_new_tokens: int, end_ids: set[int], pad_id: int,
             temperature: float = 0.0, top_p: float = 1.0, seed: int = 42,
             stop: Callable[[list[int]], bool] | None = None) -> list[list[int]]:
    """The generated continuation (without the prompt, ending before an end token) of every prompt, all
    decoded in one batch; prompt ``i`` samples with seed ``seed + i`` (its tokens equal ``generate`` of that
    prompt alone with that seed)."""
    rows = [Row(p, max_new_tokens, temperature, top_p, seed + i, stop) for i, p in enumerate(prompts)]
    decode_rows(model, rows, end_ids, pad_id)
    return [r.tokens for r in rows]
