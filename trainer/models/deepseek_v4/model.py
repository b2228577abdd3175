"""DeepSeek-V4 decoder-only MoE language model (single device; parallelism lives in ``parallelize.py``).

Numerically the model of ``transformers``' ``DeepseekV4ForCausalLM`` (see ``tests/trainer/test_hf_parity.py``):

- attention per layer: sliding window (``sliding_attention``), + compressed sparse attention (CSA: every
  ``compress_rate_csa`` tokens pooled by a learned softmax gate over overlapping windows, a lightning indexer
  picking the top-k compressed entries per query) or + heavily compressed attention (HCA: non-overlapping
  windows of ``compress_rate_hca`` tokens, all visible); one shared K=V head, low-rank queries, partial
  interleaved RoPE on the trailing ``rope_head_dim`` channels (main theta for sliding layers, compress theta
  with optional YaRN for CSA/HCA layers), a learned per-head attention sink, the conjugate rotation on the
  output, and a grouped low-rank output projection;
- manifold-constrained hyper-connections (mHC): ``hc_mult`` residual streams mixed by Sinkhorn-projected
  doubly-stochastic matrices around every block;
- MoE per layer: hash-routed (``tid2eid`` token table) or top-k routed with ``sigmoid``/``softmax``/
  ``sqrtsoftplus`` scores, expert bias for aux-loss-free balancing, normalised top-k weights times
  ``routed_scaling_factor``, a shared expert, SwiGLU clamped at ``swiglu_limit``;
- an optional multi-token-prediction (MTP) head for training.

Training packs documents into rows: from ``doc_ids_bt``, :class:`Packing` keeps attention (sliding and
compressed) inside a document and computes each document exactly as it would be alone (positions from its
start, compressed blocks aligned to it). Decoding uses :class:`DecodeCache` (per-row positions, right-padded prompts).

Shapes: B batch, T query length, S key length, W compressed entries, D hidden, N hc streams, H heads,
C head dim, E experts, I expert width.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from kernels import apply_rope as _rope_op
from kernels import moe_experts, rms_norm, route, sinkhorn
from kernels import swiglu as _swiglu_op
from trainer.models.deepseek_v4.args import ModelArgs
from trainer.models.deepseek_v4.cpu_attention import sink_attention_cpu, use_cpu_path
from trainer.models.deepseek_v4.packing import DecodeCache, Packing, local_mask, window_mask  # noqa: F401


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def shard_of(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a parameter that ``parallelize.py`` turned into a DTensor (else the tensor itself):
    the model's math runs on shards; the parallel regions around it live in ``trainer/parallel``."""
    return t.to_local() if hasattr(t, "to_local") else t


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS normalisation without a weight (queries per head, mHC inputs): the ``rms_norm`` kernel."""
    return rms_norm(x, None, eps)


# ----------------------------------------------------------------------------------------------- RoPE
def rope_inv_freq(rope_dim: int, theta: float, yarn=None) -> torch.Tensor:
    """One inverse frequency per interleaved channel pair; YaRN blends interpolation and extrapolation."""
    pos_freqs = theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float) / rope_dim)
    inv = 1.0 / pos_freqs
    if yarn is None:
        return inv

    def corr_dim(rot: float) -> float:
        return rope_dim * math.log(yarn.original_max_position_embeddings / (rot * 2 * math.pi)) / (2 * math.log(theta))

    low, high = max(math.floor(corr_dim(yarn.beta_fast)), 0), min(math.ceil(corr_dim(yarn.beta_slow)), rope_dim - 1)
    high = high + 0.001 if low == high else high
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp
    return (inv / yarn.factor) * (1 - extrapolate) + inv * extrapolate  # attention factor fixed at 1 (V4)


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype):
    ang = positions[..., None].float() * inv_freq.to(positions.device)
    return ang.cos().to(dtype), ang.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate consecutive channel pairs of the trailing ``2*F`` channels of ``x [B, H, T, C]``.

    ``cos``/``sin`` are ``[B, T, F]`` (one angle per pair); leading channels pass through (the ``rope`` kernel).
    """
    return _rope_op(x, cos, sin)


# -------------------------------------------------------------------------------------- compression
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
        pooled = self.norm((kv * gate.softmax(dim=2, dtype=torch.float32).to(kv.dtype)).sum(dim=2))
        pos = block_rel * m
        cos, sin = rope_cos_sin(pos, inv_freq, pooled.dtype)
        return apply_rope(pooled[:, None], cos, sin)[:, 0]


class Indexer(nn.Module):
    """Lightning indexer: ``score(t, s) = sum_h w_{t,h} ReLU(q_{t,h} . K_s)``; keeps the top-k visible entries."""

    def __init__(self, cfg: ModelArgs):
        super().__init__()
        self.n_heads, self.head_dim, self.topk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
        self.comp = Compressor(cfg.hidden_size, cfg.index_head_dim, cfg.compress_rate_csa, True, cfg.norm_eps)
        self.wq_b = nn.Linear(cfg.q_lora_rank, cfg.index_n_heads * cfg.index_head_dim, bias=False)
        self.weights_proj = nn.Linear(cfg.hidden_size, cfg.index_n_heads, bias=False)

    def forward(self, x_btd, q_lora_btr, keys_bwc, q_cos, q_sin, visible_btw) -> tuple[torch.Tensor, torch.Tensor]:
        """Allowed compressed entries per query ([B, T, W] bool) and the masked index scores [B, T, W]."""
        b, t, _ = x_btd.shape
        q = self.wq_b(q_lora_btr).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        q = apply_rope(q, q_cos, q_sin).transpose(1, 2)  # [B, T, h, c]
        w_keys = keys_bwc.shape[1]  # one [T*h, c] x [c, W] GEMM per row (a broadcast matmul would run T tiny ones)
        scores = torch.bmm(q.float().reshape(b, t * self.n_heads, -1), keys_bwc.float().transpose(1, 2))
        scores = scores.view(b, t, self.n_heads, w_keys)  # [B, T, h, W]
        scores = F.relu(scores) * self.head_dim ** -0.5
        w = self.weights_proj(x_btd).float() * self.n_heads ** -0.5
        scores = (scores * w.unsqueeze(-1)).sum(dim=2).masked_fill(~visible_btw, float("-inf"))
        k = min(self.topk, scores.shape[-1])
        top = scores.topk(k, dim=-1)  # as transformers does; exact ties (all-zero ReLU scores) pick arbitrarily
        allowed = torch.zeros_like(visible_btw)
        return allowed.scatter_(-1, top.indices, top.values > float("-inf")), scores


def indexer_kl(scores_btw: torch.Tensor, attn_btw: torch.Tensor, allowed_btw: torch.Tensor) -> torch.Tensor:
    """Summed KL(attention || indexer) over the selected entries of every query that selected any
    (DeepSeek-V3.2-style indexer training: the target is the heads' mean attention over those entries)."""
    target = attn_btw.float().masked_fill(~allowed_btw, 0.0)
    rows = allowed_btw.any(-1) & (target.sum(-1) > 0)
    if not rows.any():
        return scores_btw.new_zeros(())
    target = target[rows] / target[rows].sum(-1, keepdim=True)
    logp = torch.log_softmax(scores_btw[rows].masked_fill(~allowed_btw[rows], float("-inf")), dim=-1)
    keep = target > 0
    return (target[keep] * (target[keep].log() - logp[keep])).sum()


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
        doc_bt = None if packing is None else packing.doc_bt
        cos, sin = rope_cos_sin(pos_bt if packing is None else packing.rel_bt, inv_freq, x_btd.dtype)
        q_lora = self.q_norm(self.wq_a(x_btd))
        q = unweighted_rms_norm(self.wq_b(q_lora).view(b, t, self.h, self.c).transpose(1, 2), self.cfg.norm_eps)
        q = apply_rope(q, cos, sin)  # [B, H, T, C]
        kv = apply_rope(self.kv_norm(self.wkv(x_btd))[:, None], cos, sin)[:, 0]  # [B, T, C]
        if cache is not None:  # decoding: one document per row
            kv = cache.write(f"{self.name}.kv", pos_bt, kv)
            doc_bt = packing = None
        mask = local_mask(pos_bt, kv.shape[1], self.window, doc_bt, doc_bt)
        if self.compressor is not None:
            rate = self.compressor.rate
            ckv, cgate = self.compressor.project(x_btd)
            if cache is not None:
                ckv = cache.write(f"{self.name}.ckv", pos_bt, ckv)
                cgate = cache.write(f"{self.name}.cgate", pos_bt, cgate)
            comp = self.compressor(ckv, cgate, rope["compress"], packing)  # [B, W, C]
            if packing is None:
                visible = window_mask(pos_bt, comp.shape[1], rate)
            else:
                visible = packing.window_mask(rate)
            if self.indexer is not None:  # trained by its own KL loss only: its inputs are detached
                ikv, igate = self.indexer.comp.project(x_btd.detach())
                if cache is not None:
                    ikv = cache.write(f"{self.name}.ikv", pos_bt, ikv)
                    igate = cache.write(f"{self.name}.igate", pos_bt, igate)
                keys = self.indexer.comp(ikv, igate, rope["compress"], packing)
                visible, index_scores = self.indexer(x_btd.detach(), q_lora.detach(), keys, cos, sin, visible)
            kv = torch.cat([kv, comp], dim=1)
            mask = torch.cat([mask, visible], dim=-1)
        out = self._attend(q, self.shared_kv(kv), mask)  # [B, H, T, C]
        self.indexer_loss = None
        if self.indexer is not None and self.training and torch.is_grad_enabled():
            with torch.no_grad():  # the heads' attention over the selected compressed entries
                logits = torch.matmul(q, comp[:, None].transpose(-1, -2)) * self.c ** -0.5  # [B, H, T, W]
                target = self.mean_over_heads(logits.masked_fill(~visible[:, None], float("-inf")).softmax(-1)
                                              .nan_to_num(0.0))
            self.indexer_loss = indexer_kl(index_scores, target, visible)
        out = apply_rope(out, cos, -sin).transpose(1, 2)  # undo the rotation V picked up (K = V)
        grouped = out.reshape(b, t, self.groups, -1)
        return self.wo_b(torch.einsum("btgi,gir->btgr", grouped, shard_of(self.wo_a).to(grouped.dtype)).flatten(2))

    # seams for tensor parallelism (``parallelize.py`` replaces them per instance): every head reads the one
    # shared K=V head, so with heads split over ranks its gradient is a sum over ranks; and the indexer's
    # target averages the attention of all heads
    def shared_kv(self, kv_bsc: torch.Tensor) -> torch.Tensor:
        return kv_bsc

    def mean_over_heads(self, p_bhtw: torch.Tensor) -> torch.Tensor:
        return p_bhtw.mean(1)

    def _attend(self, q_bhtc, kv_bsc, mask_bts) -> torch.Tensor:
        """Softmax attention of all heads over one shared K=V head plus a learned sink logit per head.

        Every head reads the same keys, so the heads are folded into the query rows (``[B, 1, H*T, C]``)
        and K/V are never copied per head. The sink is an extra key: it holds 1 in an extra channel where
        every real key holds 0, and each query holds ``sink_h / scale`` there, so the sink's logit is
        ``sink_h``; its value is zero. That keeps the whole computation in one fused
        ``scaled_dot_product_attention`` call, gradients to the sinks included. On CPU the same values come
        from ``cpu_attention.sink_attention_cpu`` (query blocks over visible columns, the sink in the mask).
        """
        if use_cpu_path(q_bhtc):  # (cpu_attention.CPU_PATH = False: the path below on CPU too)
            return sink_attention_cpu(q_bhtc, kv_bsc, shard_of(self.sinks), mask_bts)
        b, h, t, c = q_bhtc.shape
        s = kv_bsc.shape[1]
        scale = c ** -0.5
        sink_q = (shard_of(self.sinks).to(q_bhtc.dtype) / scale).view(1, h, 1, 1).expand(b, h, t, 1)
        q = torch.cat([q_bhtc, sink_q], dim=-1).reshape(b, 1, h * t, c + 1)
        rows = torch.cat([kv_bsc, kv_bsc.new_zeros(b, s, 1)], dim=-1)  # real keys: 0 in the sink channel
        sink_row = kv_bsc.new_zeros(b, 1, c + 1)
        k = torch.cat([rows, sink_row.index_fill(-1, torch.tensor([c], device=kv_bsc.device), 1.0)], dim=1)
        v = torch.cat([rows, sink_row], dim=1)  # (V = K; equal widths keep SDPA on its fused kernel)
        mask = torch.cat([mask_bts, mask_bts.new_ones(b, t, 1)], dim=-1)
        mask = mask[:, None].expand(b, h, t, s + 1).reshape(b, 1, h * t, s + 1)
        out = F.scaled_dot_product_attention(q, k[:, None], v[:, None], attn_mask=mask, scale=scale)
        return out[..., :c].view(b, h, t, c)


# ----------------------------------------------------------------------------------------- mHC
class HyperConnection(nn.Module):
    """mHC weights from the N streams: ``pre`` collapses them, ``post`` expands a block output, ``comb``
    (Sinkhorn-projected, doubly stochastic) mixes the residual streams."""

    def __init__(self, cfg: ModelArgs):
        super().__init__()
        n = self.n = cfg.hc_mult
        self.iters, self.eps, self.norm_eps = cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.norm_eps
        self.fn = nn.Parameter(torch.empty((2 + n) * n, n * cfg.hidden_size))
        self.base = nn.Parameter(torch.zeros((2 + n) * n))
        self.scale = nn.Parameter(torch.ones(3))

    def forward(self, x_btnd: torch.Tensor):
        b, t = x_btnd.shape[:2]
        n = self.n
        mixes = F.linear(unweighted_rms_norm(x_btnd.reshape(b, t, -1).float(), self.norm_eps), self.fn.float())
        pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.split([n, n, n * n])
        s_pre, s_post, s_comb = self.scale.unbind(0)
        pre = torch.sigmoid(pre_w * s_pre + pre_b) + self.eps
        post = 2 * torch.sigmoid(post_w * s_post + post_b)
        comb = sinkhorn(comb_w.view(b, t, n, n) * s_comb + comb_b.view(n, n), self.iters, self.eps)
        collapsed = (pre.unsqueeze(-1) * x_btnd).sum(dim=2).to(x_btnd.dtype)
        return post, comb, collapsed


class HyperHead(nn.Module):
    """Final collapse of the N streams into one hidden state."""

    def __init__(self, cfg: ModelArgs):
        super().__init__()
        self.eps, self.norm_eps = cfg.hc_eps, cfg.norm_eps
        self.fn = nn.Parameter(torch.empty(cfg.hc_mult, cfg.hc_mult * cfg.hidden_size))
        self.base = nn.Parameter(torch.zeros(cfg.hc_mult))
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, x_btnd: torch.Tensor) -> torch.Tensor:
        flat = unweighted_rms_norm(x_btnd.flatten(2).float(), self.norm_eps)
        pre = torch.sigmoid(F.linear(flat, self.fn.float()) * self.scale.float() + self.base.float()) + self.eps
        return (pre.unsqueeze(-1) * x_btnd).sum(dim=2).to(x_btnd.dtype)


# ------------------------------------------------------------------------------------------------ MoE
def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """``silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)`` (the ``swiglu`` kernel)."""
    return _swiglu_op(gate, up, limit)


class SharedExpert(nn.Module):
    def __init__(self, dim: int, hidden: int, limit: float):
        super().__init__()
        self.limit = limit
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.w2(swiglu(self.w1(x), self.w3(x), self.limit))


class MoE(nn.Module):
    """Routed experts (stacked ``[E, D, I]`` weights) plus a shared expert; hash or top-k routing."""

    def __init__(self, cfg: ModelArgs, kind: str, vocab_size: int):
        super().__init__()
        e, d, i = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.cfg, self.hash = cfg, kind == "hash_moe"
        self.gate = nn.Linear(d, e, bias=False)
        self.w_gate = nn.Parameter(torch.empty(e, d, i))
        self.w_up = nn.Parameter(torch.empty(e, d, i))
        self.w_down = nn.Parameter(torch.empty(e, i, d))
        self.register_buffer("expert_bias", torch.zeros(e), persistent=True)
        if self.hash:
            self.register_buffer("tid2eid", torch.zeros(vocab_size, cfg.num_experts_per_tok, dtype=torch.long))
        self.register_buffer("load_e", torch.zeros(e), persistent=False)
        self.shared = SharedExpert(d, i * cfg.n_shared_experts, cfg.swiglu_limit) if cfg.n_shared_experts else None

    def scores(self, x_nd: torch.Tensor) -> torch.Tensor:
        """Routing scores [N, E] (``scoring_func`` applied to the gate logits)."""
        from kernels.router import score

        return score(self.gate(x_nd), self.cfg.scoring_func)

    def route(self, x_nd: torch.Tensor, ids_n: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(expert index [N, k], combine weight [N, k]); the bias steers selection, weights use raw scores
        (the ``router`` kernel: scoring, expert bias, top-k or the hash table, renormalise, scale)."""
        cfg = self.cfg
        weights, idx, _ = route(self.gate(x_nd), None if self.hash else self.expert_bias, cfg.num_experts_per_tok,
                                cfg.scoring_func, cfg.routed_scaling_factor,
                                indices_nk=self.tid2eid[ids_n] if self.hash else None)
        return idx, weights

    def forward(self, x_btd: torch.Tensor, ids_bt: torch.Tensor | None) -> torch.Tensor:
        b, t, d = x_btd.shape
        x_nd = x_btd.reshape(-1, d)
        idx_nk, w_nk = self.route(x_nd, None if ids_bt is None else ids_bt.reshape(-1))
        if self.training:
            counts = torch.bincount(idx_nk.reshape(-1), minlength=self.w_gate.shape[0])
            self.load_e += counts.detach().to(self.load_e.dtype)
        return self.experts(x_nd, idx_nk, w_nk).view(b, -1, d)  # (a sequence-parallel dispatcher returns a slice)

    def experts(self, x_nd: torch.Tensor, idx_nk: torch.Tensor, w_nk: torch.Tensor) -> torch.Tensor:
        """Routed experts (permute by expert -> grouped GEMMs with SwiGLU -> weighted unpermute: the
        ``moe_experts`` kernel) plus the shared expert. Under expert/tensor parallelism ``parallelize.py``
        replaces this per instance by a token dispatcher (``trainer/parallel/expert_parallel.py``)."""
        y_nd = moe_experts(x_nd, idx_nk, w_nk, self.w_gate, self.w_up, self.w_down, self.cfg.swiglu_limit)
        if self.shared is not None:
            y_nd = y_nd + self.shared(x_nd)
        return y_nd

    @torch.no_grad()
    def update_bias(self, rate: float) -> dict[str, float]:
        """Aux-loss-free balancing (top-k layers): raise under-loaded experts' bias, lower over-loaded ones'."""
        load = self.load_e
        total = load.sum()
        stats = {"max_over_mean": 0.0, "entropy": 0.0}
        if total > 0:
            mean = load.mean()
            p = load / total
            stats = {"max_over_mean": float(load.max() / mean),
                     "entropy": float(-(p * p.clamp_min(1e-12).log()).sum() / math.log(max(2, len(load))))}
            if not self.hash:
                self.expert_bias += rate * torch.sign(mean - load)
        load.zero_()
        return stats


# --------------------------------------------------------------------------------------------- blocks
class Block(nn.Module):
    def __init__(self, cfg: ModelArgs, attn_kind: str, mlp_kind: str, vocab_size: int, name: str):
        super().__init__()
        self.attn_hc, self.ffn_hc = HyperConnection(cfg), HyperConnection(cfg)
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.attn = Attention(cfg, attn_kind, name)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.ffn = MoE(cfg, mlp_kind, vocab_size)

    def forward(self, x_btnd, pos_bt, rope, ids_bt, packing: Packing | None = None, cache=None):
        dtype = x_btnd.dtype
        post, comb, h = self.attn_hc(x_btnd)
        a = self.attn(self.attn_norm(h), pos_bt, rope, packing, cache)
        x_btnd = post.to(dtype).unsqueeze(-1) * a.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), x_btnd)
        post, comb, h = self.ffn_hc(x_btnd)
        f = self.ffn(self.ffn_norm(h), ids_bt)
        return post.to(dtype).unsqueeze(-1) * f.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), x_btnd)


class MTP(nn.Module):
    """Multi-token prediction: from hidden state ``h_t`` and the embedding of token ``t+1``, predict ``t+2``."""

    def __init__(self, cfg: ModelArgs, vocab_size: int):
        super().__init__()
        d = cfg.hidden_size
        self.enorm, self.hnorm = RMSNorm(d, cfg.norm_eps), RMSNorm(d, cfg.norm_eps)
        self.eh_proj = nn.Linear(2 * d, d, bias=False)
        self.block = Block(cfg, "sliding_attention", "moe", vocab_size, "mtp")
        self.hc_head = HyperHead(cfg)
        self.norm = RMSNorm(d, cfg.norm_eps)

    def forward(self, h_btd, next_emb_btd, pos_bt, rope, ids_bt, packing: Packing | None, n: int) -> torch.Tensor:
        x = self.eh_proj(torch.cat([self.enorm(next_emb_btd), self.hnorm(h_btd)], dim=-1))
        x = x.unsqueeze(2).expand(-1, -1, n, -1).contiguous()
        return self.norm(self.hc_head(self.block(x, pos_bt, rope, ids_bt, packing)))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelArgs, vocab_size: int):
        super().__init__()
        self.cfg, self.vocab_size = cfg, vocab_size
        self.embed = nn.Embedding(vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, a, m, vocab_size, f"L{i}")
                                    for i, (a, m) in enumerate(zip(cfg.attention_types, cfg.moe_types)))
        self.hc_head = HyperHead(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, vocab_size, bias=False)
        self.mtp = nn.ModuleList(MTP(cfg, vocab_size) for _ in range(cfg.mtp_layers))
        self.register_buffer("inv_freq_main", rope_inv_freq(cfg.rope_head_dim, cfg.rope_theta), persistent=False)
        self.register_buffer("inv_freq_compress", rope_inv_freq(cfg.rope_head_dim, cfg.compress_rope_theta,
                                                                cfg.compress_yarn), persistent=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Normal(0, init_std) matrices, unit norms, zero sinks/biases/position biases, random hash tables."""
        g = torch.Generator().manual_seed(seed)
        std = self.cfg.init_std
        for name, p in self.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif leaf in ("sinks", "base", "ape"):
                p.zero_()
            elif leaf == "scale":
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * std)
        for m in self.modules():  # the keys' scale: the attention-logit range at init
            if isinstance(m, Attention):
                m.kv_norm.weight.fill_(self.cfg.kv_norm_init)
                if m.compressor is not None:
                    m.compressor.norm.weight.fill_(self.cfg.kv_norm_init)
        e, k = self.cfg.n_routed_experts, self.cfg.num_experts_per_tok
        for m in self.modules():
            if isinstance(m, MoE):
                m.expert_bias.zero_()
                if m.hash:
                    m.tid2eid.copy_(torch.rand(self.vocab_size, e, generator=g).argsort(-1)[:, :k])

    def _rope(self) -> dict:
        return {"main": self.inv_freq_main, "compress": self.inv_freq_compress}

    def hidden(self, input_ids_bt, doc_bt=None, cache: DecodeCache | None = None, pos_bt=None) -> torch.Tensor:
        """Final hidden states [B, T, D] (before the LM head)."""
        b, t = input_ids_bt.shape
        if pos_bt is None:
            pos_bt = torch.arange(t, device=input_ids_bt.device).expand(b, t)
        if int(pos_bt.max()) >= self.cfg.max_seq_len:
            raise ValueError(f"position {int(pos_bt.max())} exceeds max_seq_len {self.cfg.max_seq_len}")
        if cache is not None:
            cache.length = max(cache.length, int(pos_bt.max()) + 1)
        packing = None if doc_bt is None or cache is not None else Packing(doc_bt)
        x = self.embed(input_ids_bt).unsqueeze(2).expand(-1, -1, self.cfg.hc_mult, -1).contiguous()
        for layer in self.layers:
            x = layer(x, pos_bt, self._rope(), input_ids_bt, packing, cache)
        return self.hc_head(x)

    def forward(self, input_ids_bt, doc_bt=None, cache: DecodeCache | None = None, pos_bt=None) -> torch.Tensor:
        """Logits [B, T, V]."""
        return self.lm_head(self.norm(self.hidden(input_ids_bt, doc_bt, cache, pos_bt)))

    def hidden_train(self, input_ids_bt, doc_bt=None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Final normed hidden states [B, T, D] and, per MTP depth, [B, T-1, D] (before the LM head): the
        trainer's loss applies the LM head chunk by chunk (``fused_linear_cross_entropy``)."""
        h = self.hidden(input_ids_bt, doc_bt)
        mtp_h = []
        if self.mtp:
            b, t = input_ids_bt.shape
            pos = torch.arange(t - 1, device=h.device).expand(b, -1)
            nxt = self.embed(input_ids_bt[:, 1:])
            packing = None if doc_bt is None else Packing(doc_bt[:, :-1])
            for m in self.mtp:
                mtp_h.append(m(h[:, :-1], nxt, pos, self._rope(), input_ids_bt[:, :-1], packing, self.cfg.hc_mult))
        return self.norm(h), mtp_h

    def forward_train(self, input_ids_bt, doc_bt=None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Main logits [B, T, V] and, per MTP depth, logits [B, T-1, V] predicting the token after next."""
        h, mtp_h = self.hidden_train(input_ids_bt, doc_bt)
        return self.lm_head(h), [self.lm_head(m) for m in mtp_h]

    def indexer_loss(self) -> torch.Tensor | None:
        """Sum of the CSA layers' indexer KL losses from the last training forward (None without CSA)."""
        losses = [layer.attn.indexer_loss for layer in self.layers if layer.attn.indexer_loss is not None]
        return torch.stack(losses).sum() if losses else None

    def moe_layers(self) -> list[MoE]:
        return [layer.ffn for layer in self.layers]

    def update_expert_bias(self) -> dict[str, float]:
        """Aux-loss-free bias update on every MoE layer; returns load statistics per layer."""
        stats = {}
        for i, m in enumerate(self.moe_layers()):
            for k, v in m.update_bias(self.cfg.bias_update_rate).items():
                stats[f"moe{i}_{k}"] = v
        for mtp in self.mtp:
            mtp.block.ffn.update_bias(self.cfg.bias_update_rate)
        return stats

    def num_params(self) -> dict[str, int]:
        """Total and activated (per token) parameters; MTP heads are counted separately, as V4 reports."""
        c = self.cfg
        mtp = sum(p.numel() for p in self.mtp.parameters())
        total = sum(p.numel() for p in self.parameters()) - mtp
        per_expert = 3 * c.hidden_size * c.moe_intermediate_size
        inactive = per_expert * (c.n_routed_experts - c.num_experts_per_tok) * c.num_layers
        return {"total": total, "active": total - inactive - self.embed.weight.numel(), "mtp": mtp}
