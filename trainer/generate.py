"""Batched, KV-cached incremental decoding (greedy or temperature / top-p sampling).

Prompts are left-padded; positions count only real tokens. Finished rows (an end token, or a
stop string in the decoded text) leave the batch, and the cache shrinks with them.
"""

from __future__ import annotations

from typing import Callable

import torch

from trainer.models.deepseek_v4.model import KVCache, Transformer


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


@torch.no_grad()
def generate(model: Transformer, prompts: list[list[int]], max_new_tokens: int, end_ids: set[int], pad_id: int,
             temperature: float = 0.0, top_p: float = 1.0, seed: int = 42,
             stop: Callable[[list[int]], bool] | None = None) -> list[list[int]]:
    """Return the generated continuation (without the prompt, ending at an end token) per prompt."""
    model.eval()
    b = len(prompts)
    lmax = max(len(p) for p in prompts)
    budget = min(max_new_tokens, model.cfg.max_seq_len - lmax)
    if budget <= 0:
        raise ValueError(f"prompt of {lmax} tokens leaves no room under max_seq_len {model.cfg.max_seq_len}")
    ids = torch.full((b, lmax), pad_id, dtype=torch.long)
    valid = torch.zeros((b, lmax), dtype=torch.bool)
    for i, p in enumerate(prompts):
        ids[i, lmax - len(p):] = torch.tensor(p)
        valid[i, lmax - len(p):] = True
    pos = (valid.long().cumsum(1) - 1).clamp_min(0)
    causal = torch.ones(lmax, lmax, dtype=torch.bool).tril()
    mask = (causal[None] & valid[:, None, :]) | torch.eye(lmax, dtype=torch.bool)[None]
    gen = torch.Generator().manual_seed(seed)

    cache = KVCache()
    logits = model(ids, pos, mask[:, None], cache)[:, -1]
    out: list[list[int]] = [[] for _ in range(b)]
    active = torch.arange(b)
    key_valid = valid
    last_pos = pos[:, -1]
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
        keep_t = torch.tensor(keep)
        if len(keep) < len(active):
            active, nxt, key_valid, last_pos = active[keep_t], nxt[keep_t], key_valid[keep_t], last_pos[keep_t]
            cache.reorder(keep_t)
        key_valid = torch.cat([key_valid, torch.ones(len(active), 1, dtype=torch.bool)], dim=1)
        last_pos = last_pos + 1
        logits = model(nxt[:, None], last_pos[:, None], key_valid[:, None, None, :], cache)[:, -1]
    return out
