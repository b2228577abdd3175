"""DeepSeek-V4 attention (single device): sliding window over one shared K=V head, plus the compressed branches --
CSA (:class:`Compressor` with overlapping windows and the lightning :class:`Indexer` choosing top-k entries) and HCA
(non-overlapping windows, all visible) -- with low-rank queries, partial RoPE, a per-head sink and the grouped
low-rank output projection. ``model.py`` composes it into blocks.

Shapes as in ``model.py``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels import sink_attention
from trainer.models.deepseek_v4.args import ModelArgs
from trainer.models.deepseek_v4.cpu_attention import mask_parts, sink_attention_cpu, use_cpu_path
from trainer.models.deepseek_v4.layers import RMSNorm, apply_rope, rope_cos_sin, shard_of, unweighted_rms_norm
from trainer.models.deepseek_v4.packing import DecodeCache, Packing, local_mask, visibility_bias, window_mask


class Compressor(nn.Module):
    """Pool every ``rate`` source tokens into one entry: ``sum_j softmax(Z_j + B) * C_j``, then RMSNorm + RoPE.

    ``overlap`` (CSA): each token emits two series; entry ``w`` pools window ``w-1``'s first series with
    window ``w``'s second (width ``2*rate``, stride ``rate``).
    """

    def __init__(self, dim: int, head_dim: int, rate: int, overlap: bool, eps: float):
        super().__init__()
        k = 2 if overlap else 1
        self.rate, self.head_dim, self.overlap = rate, head_dim, overlap
        self.wkv = nn.Linear(dim, k * head_dim, bias=False)
        self.wgate = nn.Linear(dim, k * head_dim, bias=False)
        self.ape = nn.Parameter(torch.zeros(rate, k * head_dim))
        self.norm = RMSNorm(head_dim, eps)

    def project(self, x_bsd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.wkv(x_bsd), self.wgate(x_bsd)

    def forward(self, kv_bsc: torch.Tensor, gate_bsc: torch.Tensor, inv_freq: torch.Tensor,
                packing: Packing | None = None) -> torch.Tensor:
        """Compressed entries ``[B, W, C]`` from the projected source tokens: W = S // rate, or with
        ``packing`` the blocks of its document-aligned layout (padding slots get no weight)."""
        b, s, k = kv_bsc.shape
        m, c = self.rate, self.head_dim
        if packing is not None:
            slot, _, block_rel = packing.layout(m)
            n = block_rel.shape[1]
            idx = slot[..., None].expand(-1, -1, k)
            kv_bsc = kv_bsc.new_zeros((b, n * m, k)).scatter(1, idx, kv_bsc)
            gate_bsc = gate_bsc.new_full((b, n * m, k), -1e9).scatter(1, idx, gate_bsc)
            first_bw = block_rel == 0
        else:
            n = s // m
            block_rel = torch.arange(n, device=kv_bsc.device)[None].expand(b, -1)
            first_bw = block_rel == 0
        if n == 0:
            return kv_bsc.new_zeros((b, 0, c))
        kv = kv_bsc[:, :n * m].view(b, n, m, -1)
        gate = gate_bsc[:, :n * m].view(b, n, m, -1) + self.ape
        if self.overlap:  # a document's first block has no previous window
            prev_kv = torch.cat([kv.new_zeros((b, 1, m, c)), kv[:, :-1, :, :c]], dim=1)
            prev_gate = torch.cat([gate.new_zeros((b, 1, m, c)), gate[:, :-1, :, :c]], dim=1)
            prev_gate = prev_gate.masked_fill(first_bw[:, :, None, None], float("-inf"))
            kv = torch.cat([prev_kv, kv[..., c:]], dim=2)
            gate = torch.cat([prev_gate, gate[..., c:]], dim=2)
        return self._pool(kv, gate, block_rel * m, inv_freq)

    def _pool(self, kv_bnmk, gate_bnmk, pos_bn, inv_freq) -> torch.Tensor:
        pooled = self.norm((kv_bnmk * gate_bnmk.softmax(dim=2, dtype=torch.float32).to(kv_bnmk.dtype)).sum(dim=2))
        cos, sin = rope_cos_sin(pos_bn, inv_freq, pooled.dtype)
        return apply_rope(pooled[:, None], cos, sin)[:, 0]

    def entries_at(self, kv_bsc: torch.Tensor, gate_bsc: torch.Tensor, w_bj: torch.Tensor,
                   inv_freq: torch.Tensor) -> torch.Tensor:
        """The entries ``[B, J, C]`` of windows ``w_bj`` of each row (one document per row, as :meth:`forward`
        without packing computes them): what a decoding step recomputes after writing into them."""
        b, j = w_bj.shape
        m, c = self.rate, self.head_dim
        offsets = torch.arange(m, device=w_bj.device)

        def windows(src_bsk: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # [B, J, m, k]
            # slots past the source (the rest of a window being written) read its last slot: such an entry is
            # not read before the write that completes its window recomputes it
            idx = (w.clamp(min=0)[..., None] * m + offsets).clamp(max=src_bsk.shape[1] - 1)
            return src_bsk.gather(1, idx.view(b, j * m, 1).expand(-1, -1, src_bsk.shape[-1])).view(b, j, m, -1)

        kv, gate = windows(kv_bsc, w_bj), windows(gate_bsc, w_bj) + self.ape
        if self.overlap:  # the previous window's first series; a row's first window has none
            first = (w_bj == 0)[..., None, None]
            prev_kv = windows(kv_bsc, w_bj - 1)[..., :c].masked_fill(first, 0.0)
            prev_gate = (windows(gate_bsc, w_bj - 1) + self.ape)[..., :c].masked_fill(first, float("-inf"))
            kv = torch.cat([prev_kv, kv[..., c:]], dim=2)
            gate = torch.cat([prev_gate, gate[..., c:]], dim=2)
        return self._pool(kv, gate, w_bj * m, inv_freq)


class Indexer(nn.Module):
    """Lightning indexer: ``score(t, s) = sum_h w_{t,h} ReLU(q_{t,h} . K_s)``; keeps the top-k visible entries."""

    def __init__(self, cfg: ModelArgs):
        super().__init__()
        self.n_heads, self.head_dim, self.topk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
        self.comp = Compressor(cfg.hidden_size, cfg.index_head_dim, cfg.compress_rate_csa, True, cfg.norm_eps)
        self.wq_b = nn.Linear(cfg.q_lora_rank, cfg.index_n_heads * cfg.index_head_dim, bias=False)
        self.weights_proj = nn.Linear(cfg.hidden_size, cfg.index_n_heads, bias=False)

    def forward(self, x_btd, q_lora_btr, keys_bwc, q_cos, q_sin, hidden_btw) -> tuple[torch.Tensor, torch.Tensor]:
        """The compressed entries each query selects, ``[B, T, W]`` 0/1 in float32 (not bool: see
        :func:`indexer_kl`), and the masked index scores ``[B, T, W]``. ``hidden_btw``: float32, 0 where the
        query may see the entry, -inf where not (``packing.visibility_bias``), added to the scores (the same values
        as a masked fill, with no mask for the backward to keep)."""
        b, t, _ = x_btd.shape
        q = self.wq_b(q_lora_btr).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        q = apply_rope(q, q_cos, q_sin).transpose(1, 2)  # [B, T, h, c]
        w_keys = keys_bwc.shape[1]  # one [T*h, c] x [c, W] GEMM per row (a broadcast matmul would run T tiny ones)
        scores = torch.bmm(q.float().reshape(b, t * self.n_heads, -1), keys_bwc.float().transpose(1, 2))
        scores = scores.view(b, t, self.n_heads, w_keys)  # [B, T, h, W]
        scores = F.relu(scores) * self.head_dim ** -0.5
        w = self.weights_proj(x_btd).float() * self.n_heads ** -0.5
        scores = (scores * w.unsqueeze(-1)).sum(dim=2) + hidden_btw
        k = min(self.topk, scores.shape[-1])
        top = scores.topk(k, dim=-1, sorted=False)  # the set only (the order is not used: half the CPU time);
        # as transformers does, exact ties (all-zero ReLU scores) pick arbitrarily
        chosen = torch.zeros(scores.shape, dtype=torch.float32, device=scores.device)
        return chosen.scatter_(-1, top.indices, (top.values > float("-inf")).float()), scores


def indexer_kl(scores_btw: torch.Tensor, attn_btw: torch.Tensor, chosen_btw: torch.Tensor) -> torch.Tensor:
    """Summed KL(attention || indexer) over the selected entries of every query that selected any
    (DeepSeek-V3.2-style indexer training: the target is the heads' mean attention over those entries).
    ``chosen_btw``: 1 where the query selected the entry, else 0 (float32, or bool).

    Static shapes throughout (no boolean indexing, for torch.compile): a query that selected nothing, or whose
    heads put no weight on what it selected, has an all-zero target and adds nothing. The selection enters as
    float arithmetic, not as a boolean mask: compiled CPU code reads and writes bool tensors one element at a
    time, and a mask ``where`` needs in its backward is kept as one (this loss and its target at bench_20m's
    size: 10x slower over a bool mask). An entry not selected gets a finite score ``<= -1e30``: its
    probability is exactly 0 as with ``-inf``, and ``target * logp`` there is ``0 * -1e30 = -0`` instead of
    NaN, so neither the values nor the gradients differ from masking with ``-inf`` and zeroing ``logp``."""
    chosen = chosen_btw.float()
    target = attn_btw.float() * chosen
    total = target.sum(-1, keepdim=True)
    target = target / torch.where(total == 0, 1.0, total)
    hidden = (chosen - 1.0) * _NOT_CHOSEN  # 0 where selected, -1e30 elsewhere
    # (an entry the query cannot see scores -inf: finite first, or 0 * -inf would make NaN)
    logp = torch.log_softmax(scores_btw.float().clamp_min(-_NOT_CHOSEN) + hidden, dim=-1)
    return (torch.xlogy(target, target) - target * logp).sum()


_NOT_CHOSEN = 1e30  # the score of an entry a query did not select (exp underflows to exactly 0)


def softmax_over(logits_bhtw: torch.Tensor, chosen_btw: torch.Tensor) -> torch.Tensor:
    """Every head's softmax over the entries its query selected (``chosen_btw`` 1, float32), 0 elsewhere and
    over a query that selected nothing; fp32 ``[B, H, T, W]``."""
    chosen = chosen_btw[:, None].float()
    return torch.softmax(logits_bhtw.float() + (chosen - 1.0) * _NOT_CHOSEN, dim=-1) * chosen


def grouped_out_proj(x_btgi: torch.Tensor, w_gir: torch.Tensor) -> torch.Tensor:
    """The grouped output projection's first half, ``[B, T, G, in] x [G, in, r] -> [B, T, G*r]``. A product
    batched over G (``einsum``), except for 16-bit tensors on the CPU: there oneDNN's batched product makes the
    weight gradient materialise the activations transposed, ``[G, in, B*T]`` (15 ms a layer at bench_20m's
    size), and one ``mm`` per group on a strided view of the rows is faster forward and backward (bf16, fwd +
    bwd: 14.6 vs 23.0 ms at bench_20m's shape, 4.3 vs 10.0 at the tiny one; fp32 the other way round, 19.0 vs
    13.5; the whole bf16 bench_20m step 1.05x, ``trex bench step-ab --patch``), with :class:`_GroupMMs`'s
    backward."""
    dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else x_btgi.dtype
    if not x_btgi.is_cpu or dtype == torch.float32:
        return torch.einsum("btgi,gir->btgr", x_btgi, w_gir.to(x_btgi.dtype)).flatten(2)
    b, t, g, _ = x_btgi.shape  # both cast here: the Function's backward runs without autocast
    return _GroupMMs.apply(x_btgi.reshape(b * t, g, -1).to(dtype), w_gir.to(dtype)).view(b, t, -1)


class _GroupMMs(torch.autograd.Function):
    """``[N, G, in] x [G, in, r] -> [N, G*r]`` as one ``mm`` per group, and a backward that writes the input's
    gradient as one ``cat`` of the groups' products ``[N, G*in]``: autograd's own backward of the per-group
    selections summed G ``select_backward`` scatters, which inductor compiled into one scalar loop over the
    heads' gradient with G loads and G selects an element (7.2 ms a call at bench_20m's ``[8, 512, 4, 256]``,
    fused with the RoPE backward and the transpose after it). Compiled, the rotation, this projection and
    ``wo_b``, bf16 forward + backward at that shape: 40.6 -> 34.7 ms a layer (eager 33.7 -> 32.0); values and
    gradients bit for bit the same."""

    @staticmethod
    def forward(ctx, x_ngi: torch.Tensor, w_gir: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x_ngi, w_gir)
        return torch.cat([x_ngi[:, k] @ w_gir[k] for k in range(w_gir.shape[0])], dim=-1)

    @staticmethod
    def backward(ctx, dy_ngr: torch.Tensor):
        x_ngi, w_gir = ctx.saved_tensors
        g, r = w_gir.shape[0], w_gir.shape[2]
        dy = [dy_ngr[:, k * r:(k + 1) * r] for k in range(g)]
        dx_ngi = torch.cat([dy[k] @ w_gir[k].t() for k in range(g)], dim=-1).view(x_ngi.shape)
        dw_gir = torch.stack([x_ngi[:, k].t() @ dy[k] for k in range(g)])
        return dx_ngi, dw_gir


# -------------------------------------------------------------------------------------------- attention
class Attention(nn.Module):
    def __init__(self, cfg: ModelArgs, kind: str, name: str):
        super().__init__()
        self.cfg, self.kind, self.name = cfg, kind, name
        # heads and output groups held by this module (parallelize.py lowers them to a tp rank's share)
        self.h, self.c, self.window, self.groups = cfg.num_heads, cfg.head_dim, cfg.sliding_window, cfg.o_groups
        self.rope_kind = "main" if kind == "sliding_attention" else "compress"
        d = cfg.hidden_size
        self.wq_a = nn.Linear(d, cfg.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.norm_eps)
        self.wq_b = nn.Linear(cfg.q_lora_rank, self.h * self.c, bias=False)
        self.wkv = nn.Linear(d, self.c, bias=False)
        self.kv_norm = RMSNorm(self.c, cfg.norm_eps)
        g = cfg.o_groups
        self.wo_a = nn.Parameter(torch.empty(g, self.h * self.c // g, cfg.o_lora_rank))  # [G, in, r]
        self.wo_b = nn.Linear(g * cfg.o_lora_rank, d, bias=False)
        self.sinks = nn.Parameter(torch.zeros(self.h))
        self.compressor = self.indexer = None
        self.indexer_loss: torch.Tensor | None = None
        if kind == "compressed_sparse_attention":
            self.compressor = Compressor(d, self.c, cfg.compress_rate_csa, True, cfg.norm_eps)
            self.indexer = Indexer(cfg)
        elif kind == "heavily_compressed_attention":
            self.compressor = Compressor(d, self.c, cfg.compress_rate_hca, False, cfg.norm_eps)

    def forward(self, x_btd, pos_bt, rope: dict, packing: Packing | None = None,
                cache: DecodeCache | None = None) -> torch.Tensor:
        b, t, _ = x_btd.shape
        inv_freq = rope[self.rope_kind]
        cos, sin = rope_cos_sin(pos_bt if packing is None else packing.rel_bt, inv_freq, x_btd.dtype)
        q_lora = self.q_norm(self.wq_a(x_btd))
        q = unweighted_rms_norm(self.wq_b(q_lora).view(b, t, self.h, self.c).transpose(1, 2), self.cfg.norm_eps)
        q = apply_rope(q, cos, sin)  # [B, H, T, C]
        kv = apply_rope(self.kv_norm(self.wkv(x_btd))[:, None], cos, sin)[:, 0]  # [B, T, C]
        if cache is not None:  # decoding: one document per row
            kv = cache.write(f"{self.name}.kv", pos_bt, kv)
            packing = None
        mask = (local_mask(pos_bt, kv.shape[1], self.window) if packing is None
                else packing.local_mask(pos_bt, kv.shape[1], self.window))
        if self.compressor is not None:
            rate = self.compressor.rate
            ckv, cgate = self.compressor.project(x_btd)
            if cache is not None:
                ckv = cache.write(f"{self.name}.ckv", pos_bt, ckv)
                cgate = cache.write(f"{self.name}.cgate", pos_bt, cgate)
            comp = self._entries(cache, "comp", self.compressor, ckv, cgate, pos_bt, rope["compress"], packing)
            if packing is None:
                visible = window_mask(pos_bt, comp.shape[1], rate)
            else:
                visible = packing.window_mask(rate)
            if self.indexer is not None:  # trained by its own KL loss only: its inputs are detached
                ikv, igate = self.indexer.comp.project(x_btd.detach())
                if cache is not None:
                    ikv = cache.write(f"{self.name}.ikv", pos_bt, ikv)
                    igate = cache.write(f"{self.name}.igate", pos_bt, igate)
                keys = self._entries(cache, "icomp", self.indexer.comp, ikv, igate, pos_bt, rope["compress"], packing)
                hidden = visibility_bias(visible) if packing is None else packing.window_bias(rate)
                chosen, index_scores = self.indexer(x_btd.detach(), q_lora.detach(), keys, cos, sin, hidden)
                visible = chosen  # 0/1 floats: a bool written by compiled CPU code costs one element at a time
            # decoding on the CPU: the parts stay apart (joining them would copy the whole cache every step)
            kv = (kv, comp) if cache is not None and use_cpu_path(q) else torch.cat([kv, comp], dim=1)
            mask = (mask, visible)  # joined by _attend (on the CPU: eagerly)
        # the core takes token-major queries: contiguous on the CPU path (its query blocks are views), written so
        # here, inside the compiled graph (a transpose in ``_attend`` would be a graph of its own: a copy, and
        # the head-major tangent another); elsewhere a view
        q_bthc = q.transpose(1, 2).contiguous() if use_cpu_path(q) else q.transpose(1, 2)
        kv = tuple(map(self.shared_kv, kv)) if isinstance(kv, tuple) else self.shared_kv(kv)
        out = self._attend(q_bthc, kv, mask)  # [B, H, T, C]
        self.indexer_loss = None
        if self.indexer is not None and self.training and torch.is_grad_enabled():
            with torch.no_grad():  # the heads' attention over the selected compressed entries
                logits = torch.matmul(q, comp[:, None].transpose(-1, -2)) * self.c ** -0.5  # [B, H, T, W]
                target = self.mean_over_heads(softmax_over(logits, chosen))
            if packing is not None:  # padding (doc -1) is not data: it does not train the indexer
                chosen = chosen * (packing.doc_bt >= 0)[..., None]
            self.indexer_loss = indexer_kl(index_scores, target, chosen)
        out = apply_rope(out, cos, -sin).transpose(1, 2)  # undo the rotation V picked up (K = V)
        return self.wo_b(grouped_out_proj(out.reshape(b, t, self.groups, -1), shard_of(self.wo_a)))

    def _entries(self, cache: DecodeCache | None, what: str, comp: Compressor, kv_bsc, gate_bsc, pos_bt, inv_freq,
                 packing: Packing | None) -> torch.Tensor:
        """``comp``'s entries [B, W, C]; when decoding, those the cache keeps (``DecodeCache.entries``)."""
        if cache is None:
            return comp(kv_bsc, gate_bsc, inv_freq, packing)
        return cache.entries(f"{self.name}.{what}", comp.rate, pos_bt,
                             full=lambda: comp(kv_bsc, gate_bsc, inv_freq),
                             at=lambda w_bj: comp.entries_at(kv_bsc, gate_bsc, w_bj, inv_freq))

    # seams for tensor parallelism (``parallelize.py`` replaces them per instance): every head reads the one
    # shared K=V head, so with heads split over ranks its gradient is a sum over ranks; and the indexer's
    # target averages the attention of all heads
    def shared_kv(self, kv_bsc: torch.Tensor) -> torch.Tensor:
        return kv_bsc

    def mean_over_heads(self, p_bhtw: torch.Tensor) -> torch.Tensor:
        return p_bhtw.mean(1)

    def _attend(self, q_bthc, kv_bsc: torch.Tensor | tuple[torch.Tensor, ...], mask_bts) -> torch.Tensor:
        """``[B, H, T, C]``: softmax attention of all heads (token-major queries ``[B, T, H, C]``) over one shared
        K=V head plus a learned sink logit per head (``kernels.sink_attention``: masked SDPA, or FlexAttention
        with a block mask on CUDA while training). On CPU the same values come from
        ``cpu_attention.sink_attention_cpu`` (query blocks over visible columns, the sink in the mask; its output
        stays token-major in memory). ``mask_bts``: the mask, or its parts along the keys (a tuple; a float part:
        True where > 0); on the CPU ``kv_bsc`` may come in the same parts (a tuple: decoding, see ``forward``)."""
        if use_cpu_path(q_bthc):  # (cpu_attention.CPU_PATH = False: the kernel op on CPU too)
            return sink_attention_cpu(q_bthc, kv_bsc, shard_of(self.sinks), mask_bts).transpose(1, 2)
        if not isinstance(mask_bts, torch.Tensor):
            mask_bts = torch.cat(mask_parts(mask_bts), dim=-1)
        return sink_attention(q_bthc.transpose(1, 2), kv_bsc, shard_of(self.sinks), mask_bts)
