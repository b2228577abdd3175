"""Tokenised training data: documents packed into fixed-length rows with their boundaries kept.

Each packed row carries ``doc_ids`` (for the block-diagonal causal attention mask) and
``position_ids`` that restart at every document, and ``labels`` that are -100 wherever no loss is
wanted (prompt tokens in SFT, padding, the last token of each document).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

IGNORE = -100


@dataclass
class Packed:
    input_ids: torch.Tensor  # [M, L] long
    labels: torch.Tensor  # [M, L] long, IGNORE where no loss
    doc_ids: torch.Tensor  # [M, L] long, -1 on padding
    position_ids: torch.Tensor  # [M, L] long
    stats: dict

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def batch(self, idx: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"input_ids": self.input_ids[idx], "labels": self.labels[idx],
                "doc_ids": self.doc_ids[idx], "position_ids": self.position_ids[idx]}


def cpt_documents(tok, texts: list[str], seq_len: int) -> list[tuple[list[int], list[int]]]:
    """Each document as the tokenizer encodes plain text (``<bos> text``: ``ChatTokenizer.encode_text``, as
    transformers and vLLM do) plus ``<eos>``, split into pieces of at most ``seq_len`` tokens."""
    docs = []
    for ids in tok.encode_text_batch(texts):
        ids = [*ids, tok.eos_id]
        for s in range(0, len(ids), seq_len):
            piece = ids[s:s + seq_len]
            if len(piece) > 1:
                docs.append((piece, [1] * len(piece)))
    return docs


def pack(docs: list[tuple[list[int], list[int]]], seq_len: int, pad_id: int) -> Packed:
    """Greedy in-order packing; a document longer than ``seq_len`` is truncated and counted."""
    rows: list[list[tuple[list[int], list[int]]]] = []
    cur: list = []
    used = 0
    truncated = 0
    for ids, mask in docs:
        if len(ids) > seq_len:
            ids, mask = ids[:seq_len], mask[:seq_len]
            truncated += 1
        if used + len(ids) > seq_len:
            rows.append(cur)
            cur, used = [], 0
        cur.append((ids, mask))
        used += len(ids)
    if cur:
        rows.append(cur)

    m = len(rows)
    input_ids = torch.full((m, seq_len), pad_id, dtype=torch.long)
    labels = torch.full((m, seq_len), IGNORE, dtype=torch.long)
    doc_ids = torch.full((m, seq_len), -1, dtype=torch.long)
    position_ids = torch.zeros((m, seq_len), dtype=torch.long)
    tokens = loss_tokens = 0
    for r, row in enumerate(rows):
        pos = 0
        for d, (ids, mask) in enumerate(row):
            n = len(ids)
            input_ids[r, pos:pos + n] = torch.tensor(ids)
            lab = torch.tensor(ids[1:] + [IGNORE])
            keep = torch.tensor(mask[1:] + [0], dtype=torch.bool)
            labels[r, pos:pos + n] = torch.where(keep, lab, torch.full_like(lab, IGNORE))
            doc_ids[r, pos:pos + n] = d
            position_ids[r, pos:pos + n] = torch.arange(n)
            pos += n
            tokens += n
            loss_tokens += int(keep.sum())
    stats = {"documents": len(docs), "sequences": m, "tokens": tokens, "loss_tokens": loss_tokens,
             "truncated": truncated, "fill": tokens / max(1, m * seq_len)}
    return Packed(input_ids, labels, doc_ids, position_ids, stats)


def trim_padding(batch: dict[str, torch.Tensor], multiple: int = 32) -> dict[str, torch.Tensor]:
    """The batch without the trailing columns that are padding in every row (``doc_ids`` -1), rounded up to a
    ``multiple`` of columns (a handful of shapes, for compiled code). Nothing a real token computes changes:
    padding is a document of its own that no real token attends to, with no loss; the MoE no longer routes
    (and counts in its expert load) padding that was only there to fill the row."""
    real = (batch["doc_ids"] >= 0).any(0).nonzero()
    length = batch["doc_ids"].shape[1]
    keep = min(length, -(-(int(real.max()) + 1 if real.numel() else 1) // multiple) * multiple)
    return batch if keep == length else {k: v[:, :keep] for k, v in batch.items()}


def batch_indices(n_rows: int, batch_size: int, step: int, seed: int) -> torch.Tensor:
    """Row indices of the batch at ``step``: a pure function of (step, seed), so resume is exact.

    Rows are visited in a fresh seeded permutation every epoch.
    """
    start = step * batch_size
    out = []
    while len(out) < batch_size:
        epoch, offset = divmod(start + len(out), n_rows)
        perm = torch.randperm(n_rows, generator=torch.Generator().manual_seed(seed * 100003 + epoch))
        take = min(batch_size - len(out), n_rows - offset)
        out.extend(perm[offset:offset + take].tolist())
    return torch.tensor(out)


def save_packed(data: Packed, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save({"input_ids": data.input_ids, "labels": data.labels, "doc_ids": data.doc_ids,
                "position_ids": data.position_ids, "stats": data.stats}, tmp)
    os.replace(tmp, path)
    return path


def load_packed(path: str | Path) -> Packed:
    d = torch.load(path, weights_only=False)
    return Packed(d["input_ids"], d["labels"], d["doc_ids"], d["position_ids"], d["stats"])
