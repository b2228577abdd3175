"""Where tokens sit: decoding caches, attention masks and packed-document layouts (DeepSeek-V4).

Single device and free of parameters; used by :mod:`trainer.models.deepseek_v4.model`.
Shapes: B batch, T query length, S key length, W compressed entries.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


# -------------------------------------------------------------------------------------------- caching
class DecodeCache:
    """Per-row buffers for incremental decoding: new tokens are written at their own positions.

    Rows are right-padded, so row ``b``'s token at position ``p`` sits in slot ``p``; attention and
    compressed windows only ever read slots ``<= p`` (later slots may hold padding). Rows leave
    (:meth:`keep`) and join (:meth:`extend`, with a cache prefilled for them) between decoding steps; each
    keeps its own positions, so a joining row's compressed windows start at its own first token.
    """

    def __init__(self, batch: int, max_len: int):
        self.batch, self.max_len = batch, max_len
        self.buffers: dict[str, torch.Tensor] = {}
        self.length = 0  # slots read by the next forward: set from its largest position

    def write(self, name: str, positions_bt: torch.Tensor, values_btc: torch.Tensor) -> torch.Tensor:
        buf = self.buffers.get(name)
        if buf is None:
            buf = values_btc.new_zeros((self.batch, self.max_len, values_btc.shape[-1]))
            self.buffers[name] = buf
        rows = torch.arange(self.batch, device=buf.device)[:, None].expand_as(positions_bt)
        buf[rows, positions_bt] = values_btc
        return buf[:, :self.length]

    def entries(self, name: str, rate: int, positions_bt: torch.Tensor, full: Callable[[], torch.Tensor],
                at: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """The compressed entries ``[B, W, C]`` over the slots read (W = ``length // rate``), kept between steps.

        A forward of several tokens (a prefill) computes them all (``full()``); a one-token step recomputes only
        the entry of the window it wrote into (``at(w_bj)``). A row's writes come in position order, so every
        other entry was last computed after the last write into the slots it reads (its own window and, with
        overlapping windows, the previous one): the result equals ``full()``, at one entry per row and step
        where ``full()`` made each step O(length)."""
        n = self.length // rate
        buf = self.buffers.get(name)
        if buf is None or positions_bt.shape[1] > 1:
            comp_bwc = full()
            if buf is None:
                buf = comp_bwc.new_zeros((self.batch, self.max_len, comp_bwc.shape[-1]))
                self.buffers[name] = buf
            buf[:, :n] = comp_bwc
            return comp_bwc
        w_bj = positions_bt // rate
        buf[torch.arange(self.batch, device=buf.device)[:, None], w_bj] = at(w_bj)
        return buf[:, :n]

    def keep(self, rows_b: torch.Tensor) -> None:
        """Keep rows ``rows_b`` (new row ``i`` = old row ``rows_b[i]``) and drop the others (the next forward reads
        only as far as the remaining rows' positions). In place: only the rows that change slot are copied, and
        the buffers become their first ``len(rows_b)`` rows (a decoding step that drops a finished row copies
        one row, not the whole cache)."""
        n = len(rows_b)
        moved = (rows_b != torch.arange(n, device=rows_b.device)).nonzero().squeeze(1)
        src = rows_b[moved]
        for k, v in self.buffers.items():
            if moved.numel():
                v[moved] = v[src]  # (the right side is gathered first: any order is safe)
            self.buffers[k] = v[:n]
        self.batch, self.length = n, 0

    def extend(self, other: "DecodeCache") -> None:
        """Append the rows of ``other`` (a cache of the same model prefilled for new rows) after this one's;
        the shorter buffers are padded to the longer ``max_len``."""
        if self.buffers.keys() != other.buffers.keys():
            raise ValueError("caches of different models (or an unused cache) cannot be joined")
        self.max_len = max(self.max_len, other.max_len)
        self.buffers = {k: torch.cat([F.pad(v, (0, 0, 0, self.max_len - v.shape[1])),
                                      F.pad(other.buffers[k], (0, 0, 0, self.max_len - other.buffers[k].shape[1]))])
                        for k, v in self.buffers.items()}
        self.batch, self.length = self.batch + other.batch, 0


def local_mask(q_pos_bt, s: int, window: int, q_doc_bt=None, k_doc_bs=None) -> torch.Tensor:
    """[B, T, S] bool: causal, inside the sliding window, same document."""
    k_pos = torch.arange(s, device=q_pos_bt.device)[None, None, :]
    q_pos = q_pos_bt[:, :, None]
    m = (k_pos <= q_pos) & (k_pos > q_pos - window)  # 0 <= q - k < window, without a [B, T, S] int64 difference
    if q_doc_bt is not None:
        m &= q_doc_bt[:, :, None] == k_doc_bs[:, None, :]
    return m


def window_mask(q_pos_bt, n_windows: int, rate: int) -> torch.Tensor:
    """[B, T, W] bool: compressed entry ``w`` is complete before the query (one document per row)."""
    w = torch.arange(n_windows, device=q_pos_bt.device)
    return w[None, None, :] < ((q_pos_bt + 1) // rate)[:, :, None]


def visibility_bias(mask: torch.Tensor) -> torch.Tensor:
    """A bool mask as float32 scores to add: 0 where True, -inf where False."""
    return torch.zeros(mask.shape, dtype=torch.float32, device=mask.device).masked_fill_(~mask, float("-inf"))


class Packing:
    """Where the documents of a packed batch sit, so that each is computed exactly as it would be alone.

    ``rel_bt`` is the position inside the document (RoPE uses it). For a compression rate ``R``,
    :meth:`layout` places every document at a multiple of ``R`` in an aligned copy of the row, so that
    compressed blocks start with the document (as at position 0 when it is alone) and never mix two.
    """

    def __init__(self, doc_bt: torch.Tensor, rates: tuple[int, ...] = ()):
        """``rates``: the compression rates whose layouts to build now, outside any compiled region (a layout's
        block count depends on the data)."""
        b, t = doc_bt.shape
        self.doc_bt = doc_bt
        start = torch.ones_like(doc_bt, dtype=torch.bool)
        start[:, 1:] = doc_bt[:, 1:] != doc_bt[:, :-1]
        self.seg_bt = start.long().cumsum(1) - 1  # ordinal of the token's document in its row
        idx = torch.arange(t, device=doc_bt.device).expand(b, t)
        first = torch.zeros_like(idx).scatter_reduce(1, self.seg_bt, idx, "amin", include_self=False)
        self.rel_bt = idx - first.gather(1, self.seg_bt)
        self._layouts: dict[int, tuple] = {}
        self._masks: dict[tuple, torch.Tensor] = {}
        for rate in rates:
            self.layout(rate)

    def _memo(self, key: tuple, build) -> torch.Tensor:
        """A mask every layer of the forward shares, built once, eagerly. Compiled code reads one built before
        (:meth:`build_masks`) and otherwise builds its own (a mutation of this object would be a side effect in
        the graph)."""
        if key not in self._masks:
            if torch.compiler.is_compiling():
                return build()
            self._masks[key] = build()
        return self._masks[key]

    def build_masks(self, pos_bt: torch.Tensor, window: int) -> None:
        """Build now, outside any compiled region, the masks the layers of a forward over ``pos_bt`` read: the
        sliding-window mask and each compression rate's window mask. Compiled CPU code writes bool tensors one
        element at a time: built inside every compiled block, these masks cost 3-5x what one eager build does."""
        self.local_mask(pos_bt, pos_bt.shape[1], window)
        for rate in self._layouts:
            self.window_mask(rate)
            self.window_bias(rate)

    def local_mask(self, pos_bt: torch.Tensor, s: int, window: int) -> torch.Tensor:
        """[B, T, S] bool: :func:`local_mask` inside the documents, for the forward's positions ``pos_bt`` (one
        per packing: the layers of a forward share it)."""
        return self._memo(("local", s, window), lambda: local_mask(pos_bt, s, window, self.doc_bt, self.doc_bt))

    def layout(self, rate: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``slot_bt`` (aligned slot of each token), ``block_doc_bw`` (document of each aligned block, -2 for
        none) and ``block_rel_bw`` (the block's index inside its document)."""
        if rate not in self._layouts:
            b, t = self.doc_bt.shape
            lens = torch.zeros_like(self.seg_bt).scatter_add_(1, self.seg_bt, torch.ones_like(self.seg_bt))
            padded = (lens + rate - 1) // rate * rate
            slot = (padded.cumsum(1) - padded).gather(1, self.seg_bt) + self.rel_bt
            n = int(padded.sum(1).max()) // rate
            block = slot // rate
            block_doc = self.doc_bt.new_full((b, n), -2).scatter_(1, block, self.doc_bt)
            block_rel = self.rel_bt.new_zeros((b, n)).scatter_(1, block, self.rel_bt // rate)
            self._layouts[rate] = (slot, block_doc, block_rel)
        return self._layouts[rate]

    def window_mask(self, rate: int) -> torch.Tensor:
        """[B, T, W] bool: aligned block ``w`` is in the query's document and complete before it."""
        def build() -> torch.Tensor:
            _, block_doc, block_rel = self.layout(rate)
            same = block_doc[:, None, :] == self.doc_bt[:, :, None]
            return same & (block_rel[:, None, :] < ((self.rel_bt + 1) // rate)[:, :, None])

        return self._memo(("window", rate), build)

    def window_bias(self, rate: int) -> torch.Tensor:
        """[B, T, W] float32: 0 where :meth:`window_mask` is True, -inf elsewhere (the CSA indexer adds it to its
        scores: compiled CPU code reads a bool mask one element at a time, and keeps it for the backward)."""
        return self._memo(("window_bias", rate), lambda: visibility_bias(self.window_mask(rate)))
