"""Corpus hygiene: quality filters, exact and near-duplicate removal, benchmark decontamination.

Each filter returns ``(kept, rejected)`` where every rejected item carries a ``reason`` — callers add
them to the curation rejections, so the accounting ``in = kept + rejected`` holds per filter.
"""

from __future__ import annotations

import hashlib
import re
from typing import Iterable

_WORD = re.compile(r"[a-z0-9]+")


def words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def quality(docs: list[dict], min_chars: int = 160, max_chars: int = 4000, min_numbers: int = 1) -> tuple[list[dict], list[dict]]:
    """Keep documents of a sensible length that state numbers (OR documents without data are noise)."""
    kept, rejected = [], []
    for d in docs:
        n = len(d["text"])
        reason = None
        if n < min_chars:
            reason = "too_short"
        elif n > max_chars:
            reason = "too_long"
        elif len(re.findall(r"\d+(?:\.\d+)?", d["text"])) < min_numbers:
            reason = "no_numbers"
        (rejected if reason else kept).append({**d, "reason": reason} if reason else d)
    return kept, rejected


def exact_dedup(docs: list[dict], key: str = "text") -> tuple[list[dict], list[dict]]:
    """Drop later copies of a document whose normalised words are identical to an earlier one."""
    seen: set[str] = set()
    kept, rejected = [], []
    for d in docs:
        h = hashlib.sha256(" ".join(words(d[key])).encode()).hexdigest()
        if h in seen:
            rejected.append({**d, "reason": "exact_duplicate"})
        else:
            seen.add(h)
            kept.append(d)
    return kept, rejected


def _minhash(text: str, num_perm: int, shingle: int):
    from datasketch import MinHash

    toks = words(text)
    grams = {" ".join(toks[i:i + shingle]) for i in range(max(1, len(toks) - shingle + 1))}
    m = MinHash(num_perm=num_perm, seed=1)
    m.update_batch([g.encode() for g in grams])
    return m


def near_dedup(docs: list[dict], threshold: float = 0.85, key: str = "text", num_perm: int = 128,
               shingle: int = 5) -> tuple[list[dict], list[dict]]:
    """MinHash-LSH near-duplicate removal: keep the first of every group with Jaccard >= ``threshold``."""
    from datasketch import MinHashLSH

    lsh = MinHashLSH(threshold=threshold, num_perm=num_perm)
    kept, rejected = [], []
    for i, d in enumerate(docs):
        m = _minhash(d[key], num_perm, shingle)
        dup = lsh.query(m)
        if dup:
            rejected.append({**d, "reason": "near_duplicate", "duplicate_of": dup[0]})
        else:
            lsh.insert(str(d.get("id", i)), m)
            kept.append(d)
    return kept, rejected


class Decontaminator:
    """Flags text sharing any ``n``-gram of words (default 13) with a benchmark question."""

    def __init__(self, questions: Iterable[str], n: int = 13):
        self.n = n
        self.grams: set[int] = set()
        for q in questions:
            self.grams.update(self._grams(q))

    def _grams(self, text: str) -> set[int]:
        toks = words(text)
        return {hash(" ".join(toks[i:i + self.n])) for i in range(len(toks) - self.n + 1)}

    def contaminated(self, text: str) -> bool:
        return not self.grams.isdisjoint(self._grams(text))

    def filter(self, docs: list[dict], key: str = "text") -> tuple[list[dict], list[dict]]:
        kept, rejected = [], []
        for d in docs:
            if self.contaminated(d[key]):
                rejected.append({**d, "reason": "contaminated"})
            else:
                kept.append(d)
        return kept, rejected
