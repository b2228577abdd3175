"""Batched, cached incremental decoding (greedy or temperature / top-p sampling) with stop conditions.

Prompts are right-padded: every row's token at position ``p`` sits in cache slot ``p``, so the
compressed-attention windows of each row start at its own first token. Each step feeds one token per
row at that row's next position. Finished rows (an end token, or ``stop`` returning True on the tokens so
far, e.g. a stop string in the decoded text) leave the batch and the cache shrinks with them.
"""

from __future__ import annotations

from typing import Callable

import torch

from trainer.models.deepseek_v4.model import DecodeCache, Transformer


def _sample(logits_bv: torch.Tensor, temperature: float, top_p: float, gen: torch.Generator) -> torch.Tensor:
    if temperature <= 0:
        return logits_bv.argmax(-1)
    probs = torch.softmax(logits_bv.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        cum = sorted_p.cumsum(-1)
        sorted_p[(cum - sorted_p) > top_p] = 0.0
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    return torch.multinomial(probs / probs.sum(-1, keepdim=True), 1, generator=gen).squeeze(-1)


def stop_strings(decode: Callable[[list[int]], str], strings: list[str]) -> Callable[[list[int]], bool] | None:
    """A ``stop`` callback that ends a row once its decoded text contains one of ``strings``."""
    if not strings:
        return None
    return lambda ids: any(s in decode(ids[-64:]) for s in strings)


@torch.no_grad()
def generate(model: Transformer, prompts: list[list[int]], max_new_tokens: int, end_ids: set[int], pad_id: int,
             temperature: float = 0.0, top_p: float = 1.0, seed: int = 42,
             stop: Callable[[list[int]], bool] | None = None) -> list[list[int]]:
    """Return the generated continuation (without the prompt, ending before an end token) per prompt."""
    model.eval()
    b = len(prompts)
    lens = torch.tensor([len(p) for p in prompts])
    lmax = int(lens.max())
    budget = min(max_new_tokens, model.cfg.max_seq_len - lmax)
    if budget <= 0:
        raise ValueError(f"prompt of {lmax} tokens leaves no room under max_seq_len {model.cfg.max_seq_len}")
    ids = torch.full((b, lmax), pad_id, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, :len(p)] = torch.tensor(p)
    gen = torch.Generator().manual_seed(seed)
    cache = DecodeCache(b, lmax + budget)
    logits = model(ids, cache=cache, pos_bt=torch.arange(lmax).expand(b, -1))
    logits = logits[torch.arange(b), lens - 1]
    out: list[list[int]] = [[] for _ in range(b)]
    active = torch.arange(b)
    pos = lens.clone()  # next position per active row
    for _ in range(budget):
        nxt = _sample(logits, temperature, top_p, gen)
        keep = []
        for j, row in enumerate(active.tolist()):
            tok = int(nxt[j])
            if tok in end_ids:
                continue
            out[row].append(tok)
            if stop is not None and stop(out[row]):
                continue
            keep.append(j)
        if not keep:
            break
        if len(keep) < len(active):
            keep_t = torch.tensor(keep)
            active, nxt, pos = active[keep_t], nxt[keep_t], pos[keep_t]
            cache.keep(keep_t)
        logits = model(nxt[:, None], cache=cache, pos_bt=pos[:, None])[:, -1]
        pos = pos + 1
    return out
