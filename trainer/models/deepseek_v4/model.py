"""DeepSeek-V4-family decoder-only MoE language model (single device, no parallel code).

This is the family's trunk: RMSNorm, rotary attention with grouped KV heads,
dense SwiGLU layers for the first ``first_k_dense`` blocks, then DeepSeek-style MoE blocks with
``sigmoid``/``softmax``/``sqrtsoftplus`` scoring, aux-loss-free expert bias, normalised top-k,
``routed_scaling_factor`` and shared experts. Parallelism lives in ``parallelize.py``.

Shapes: B batch, T query length, S key length, D hidden, H heads, K kv heads, E experts, N tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from kernels import rms_norm
from trex.config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x_btd: torch.Tensor) -> torch.Tensor:
        return rms_norm(x_btd, self.weight, self.eps)


def rope_tables(head_dim: int, max_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    ang_tf = torch.outer(torch.arange(max_len, dtype=torch.float64), inv_freq)
    return ang_tf.cos().float(), ang_tf.sin().float()


def apply_rope(x_bhtd: torch.Tensor, cos_btf: torch.Tensor, sin_btf: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved-half pairs (x1, x2) of the last dim by the position angle."""
    x1, x2 = x_bhtd.float().chunk(2, dim=-1)
    cos, sin = cos_btf[:, None], sin_btf[:, None]
    out = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return out.to(x_bhtd.dtype)


@dataclass
class KVCache:
    """Per-layer keys/values for incremental decoding: lists of [B, K, S, Dh]."""

    keys: list[torch.Tensor | None] = field(default_factory=list)
    values: list[torch.Tensor | None] = field(default_factory=list)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        while len(self.keys) <= layer:
            self.keys.append(None)
            self.values.append(None)
        if self.keys[layer] is not None:
            k = torch.cat([self.keys[layer], k], dim=2)
            v = torch.cat([self.values[layer], v], dim=2)
        self.keys[layer], self.values[layer] = k, v
        return k, v

    def reorder(self, keep_b: torch.Tensor) -> None:
        self.keys = [None if k is None else k[keep_b] for k in self.keys]
        self.values = [None if v is None else v[keep_b] for v in self.values]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.h, self.k, self.dh = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.h * self.dh, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.k * self.dh, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.k * self.dh, bias=False)
        self.o_proj = nn.Linear(self.h * self.dh, cfg.hidden_size, bias=False)

    def forward(self, x_btd, cos_btf, sin_btf, mask_b1ts, cache: KVCache | None):
        b, t, _ = x_btd.shape
        q = self.q_proj(x_btd).view(b, t, self.h, self.dh).transpose(1, 2)
        k = self.k_proj(x_btd).view(b, t, self.k, self.dh).transpose(1, 2)
        v = self.v_proj(x_btd).view(b, t, self.k, self.dh).transpose(1, 2)
        q, k = apply_rope(q, cos_btf, sin_btf), apply_rope(k, cos_btf, sin_btf)
        if cache is not None:
            k, v = cache.update(self.layer, k, v)
        if mask_b1ts is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.h != self.k)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask_b1ts, enable_gqa=self.h != self.k)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.h * self.dh))


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoE(nn.Module):
    """Top-k routed experts (stacked weights) plus always-on shared experts."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        e, d, i = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.cfg = cfg
        self.gate = nn.Linear(d, e, bias=False)
        self.w1_eid = nn.Parameter(torch.empty(e, i, d))
        self.w3_eid = nn.Parameter(torch.empty(e, i, d))
        self.w2_edi = nn.Parameter(torch.empty(e, d, i))
        self.register_buffer("expert_bias", torch.zeros(e), persistent=True)
        self.register_buffer("load_e", torch.zeros(e), persistent=False)
        self.shared = SwiGLU(d, i * cfg.n_shared_experts) if cfg.n_shared_experts else None

    def route(self, x_nd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Return (expert index [N, k], combine weight [N, k])."""
        logits_ne = self.gate(x_nd).float()
        fn = self.cfg.scoring_func
        if fn == "sigmoid":
            scores = logits_ne.sigmoid()
        elif fn == "softmax":
            scores = logits_ne.softmax(dim=-1)
        else:
            scores = F.softplus(logits_ne).sqrt()
        # the bias only steers selection (aux-loss-free balancing); weights use the raw scores
        idx_nk = torch.topk(scores + self.expert_bias, self.cfg.num_experts_per_tok, dim=-1).indices
        w_nk = scores.gather(1, idx_nk)
        if self.cfg.norm_topk_prob:
            w_nk = w_nk / (w_nk.sum(-1, keepdim=True) + 1e-20)
        return idx_nk, w_nk * self.cfg.routed_scaling_factor

    def forward(self, x_btd: torch.Tensor) -> torch.Tensor:
        b, t, d = x_btd.shape
        x_nd = x_btd.reshape(-1, d)
        idx_nk, w_nk = self.route(x_nd)
        k = idx_nk.shape[1]
        flat_e = idx_nk.reshape(-1)
        order = torch.argsort(flat_e, stable=True)
        counts = torch.bincount(flat_e, minlength=self.w1_eid.shape[0])
        if self.training:
            self.load_e += counts.detach().to(self.load_e.dtype)
        token_of = order // k
        x_sorted = x_nd[token_of]
        out_sorted = torch.empty_like(x_sorted)
        start = 0
        for e, n in enumerate(counts.tolist()):
            if n == 0:
                continue
            xe = x_sorted[start:start + n]
            h = F.silu(xe @ self.w1_eid[e].t()) * (xe @ self.w3_eid[e].t())
            out_sorted[start:start + n] = h @ self.w2_edi[e].t()
            start += n
        weighted = out_sorted * w_nk.reshape(-1)[order, None].to(out_sorted.dtype)
        y_nd = torch.zeros_like(x_nd).index_add_(0, token_of, weighted)
        if self.shared is not None:
            y_nd = y_nd + self.shared(x_nd)
        return y_nd.view(b, t, d)

    @torch.no_grad()
    def update_bias(self, rate: float) -> dict[str, float]:
        """Aux-loss-free balancing: raise the bias of under-loaded experts, lower over-loaded ones."""
        load = self.load_e
        total = load.sum()
        stats = {"max_over_mean": 0.0, "entropy": 0.0}
        if total > 0:
            mean = load.mean()
            p = load / total
            stats = {"max_over_mean": float(load.max() / mean),
                     "entropy": float(-(p * p.clamp_min(1e-12).log()).sum() / math.log(len(load)))}
            self.expert_bias += rate * torch.sign(mean - load)
        load.zero_()
        return stats


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.attn = Attention(cfg, layer)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.ffn = SwiGLU(cfg.hidden_size, cfg.dense_intermediate_size) if layer < cfg.first_k_dense else MoE(cfg)

    def forward(self, x, cos, sin, mask, cache):
        x = x + self.attn(self.attn_norm(x), cos, sin, mask, cache)
        return x + self.ffn(self.ffn_norm(x))


def document_mask(doc_ids_bt: torch.Tensor) -> torch.Tensor:
    """Causal mask that also stops attention across packed-document boundaries: [B, 1, T, T] bool."""
    t = doc_ids_bt.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool, device=doc_ids_bt.device).tril()
    same_doc = doc_ids_bt[:, :, None] == doc_ids_bt[:, None, :]
    return (causal & same_doc)[:, None]


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, vocab_size: int):
        super().__init__()
        self.cfg, self.vocab_size = cfg, vocab_size
        self.embed = nn.Embedding(vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, vocab_size, bias=False)
        cos, sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        std = self.cfg.init_std
        out_std = std / math.sqrt(2 * self.cfg.num_layers)
        for name, p in self.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0)  # norm weights
            else:
                s = out_std if name.endswith(("o_proj.weight", "w2.weight", "w2_edi")) else std
                p.copy_(torch.randn(p.shape, generator=g) * s)
        for m in self.modules():
            if isinstance(m, MoE):
                m.expert_bias.zero_()

    def forward(self, input_ids_bt: torch.Tensor, position_ids_bt: torch.Tensor | None = None,
                mask_b1ts: torch.Tensor | None = None, cache: KVCache | None = None) -> torch.Tensor:
        """Logits [B, T, V]. Without a mask the attention is plainly causal."""
        b, t = input_ids_bt.shape
        if position_ids_bt is None:
            position_ids_bt = torch.arange(t, device=input_ids_bt.device).expand(b, t)
        if int(position_ids_bt.max()) >= self.cfg.max_seq_len:
            raise ValueError(f"position {int(position_ids_bt.max())} exceeds max_seq_len {self.cfg.max_seq_len}")
        cos, sin = self.rope_cos[position_ids_bt], self.rope_sin[position_ids_bt]
        x = self.embed(input_ids_bt)
        for layer in self.layers:
            x = layer(x, cos, sin, mask_b1ts, cache)
        return self.lm_head(self.norm(x))

    def moe_layers(self) -> list[MoE]:
        return [m for m in self.modules() if isinstance(m, MoE)]

    def update_expert_bias(self) -> dict[str, float]:
        """Apply the aux-loss-free bias update on every MoE layer; return load stats per layer."""
        stats = {}
        for i, m in enumerate(self.moe_layers()):
            for k, v in m.update_bias(self.cfg.bias_update_rate).items():
                stats[f"moe{i}_{k}"] = v
        return stats

    def num_params(self) -> dict[str, int]:
        total = sum(p.numel() for p in self.parameters())
        c = self.cfg
        inactive = 0
        for m in self.moe_layers():
            per_expert = m.w1_eid[0].numel() + m.w3_eid[0].numel() + m.w2_edi[0].numel()
            inactive += per_expert * (c.n_routed_experts - c.num_experts_per_tok)
        return {"total": total, "active": total - inactive}
