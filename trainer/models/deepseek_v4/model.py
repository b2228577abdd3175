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

Files: ``layers.py`` (RMSNorm, RoPE), ``attention.py`` (sliding / CSA / HCA attention with the compressor and
the indexer), this file (mHC, MoE, blocks, MTP, the model).

Shapes: B batch, T query length, S key length, W compressed entries, D hidden, N hc streams, H heads,
C head dim, E experts, I expert width.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from kernels import hc_expand, hc_head, hc_pre, moe_experts, moe_experts_lora, route
from kernels import swiglu as _swiglu_op
from trainer.models.deepseek_v4.args import ModelArgs
from trainer.models.deepseek_v4.attention import Attention
from trainer.models.deepseek_v4.layers import RMSNorm, rope_inv_freq
from trainer.models.deepseek_v4.packing import DecodeCache, Packing, local_mask, window_mask  # noqa: F401


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
        return hc_pre(x_btnd, self.fn, self.base, self.scale, self.iters, self.eps, self.norm_eps)


def expand_streams(h_btd: torch.Tensor, n: int, fp32: bool = False) -> torch.Tensor:
    """The ``n`` mHC residual streams ``[B, T, N, D]`` that start from hidden state ``h``, in the streams' dtype:
    under autocast the autocast dtype -- DeepSeek-V4's own bf16 code keeps its streams in bf16, and every mHC op
    then moves half the bytes of fp32 streams (bench_20m's bf16 step 1.057x, peak memory -7 %) -- or fp32 with
    ``fp32`` (``ModelArgs.hc_streams_fp32``); without autocast ``h``'s dtype."""
    device = h_btd.device.type
    if torch.is_autocast_enabled(device):
        h_btd = h_btd.to(torch.float32 if fp32 else torch.get_autocast_dtype(device))
    return h_btd.unsqueeze(2).expand(-1, -1, n, -1).contiguous()


class HyperHead(nn.Module):
    """Final collapse of the N streams into one hidden state."""

    def __init__(self, cfg: ModelArgs):
        super().__init__()
        self.eps, self.norm_eps = cfg.hc_eps, cfg.norm_eps
        self.fn = nn.Parameter(torch.empty(cfg.hc_mult, cfg.hc_mult * cfg.hidden_size))
        self.base = nn.Parameter(torch.zeros(cfg.hc_mult))
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, x_btnd: torch.Tensor) -> torch.Tensor:
        return hc_head(x_btnd, self.fn, self.base, self.scale, self.eps, self.norm_eps)


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
        # router replay (the RL stage): expert choices [N, k] to use instead of the router's (a row of -1: the
        # router's own); with ``record`` on, the last forward's choices are kept in ``recorded`` [B, T, k]
        self.replay_nk: torch.Tensor | None = None
        self.record = False
        self.recorded: torch.Tensor | None = None
        self.lora: nn.Module | None = None  # per-expert low-rank adapters (trainer/lora.py: ExpertLoRA)
        self.frozen_experts: nn.Module | None = None  # a quantised frozen base instead of w_* (trainer/qbase.py)

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

    def replayed(self, x_nd: torch.Tensor, idx_nk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The replayed choices (where ``replay_nk`` has them) with combine weights recomputed from the live router
        at those experts, so the router still learns (R3: only the indices are replayed)."""
        cfg, rep = self.cfg, self.replay_nk.to(idx_nk.device)
        idx = torch.where((rep >= 0).all(-1, keepdim=True), rep, idx_nk)
        weights, _, _ = route(self.gate(x_nd), None, cfg.num_experts_per_tok, cfg.scoring_func,
                              cfg.routed_scaling_factor, indices_nk=idx)
        return idx, weights

    def forward(self, x_btd: torch.Tensor, ids_bt: torch.Tensor | None) -> torch.Tensor:
        b, t, d = x_btd.shape
        x_nd = x_btd.reshape(-1, d)
        idx_nk, w_nk = self.route(x_nd, None if ids_bt is None else ids_bt.reshape(-1))
        if self.replay_nk is not None and not self.hash:  # (a hash layer's choice is the token's: nothing to replay)
            idx_nk, w_nk = self.replayed(x_nd, idx_nk)
        if self.record:
            self.recorded = idx_nk.view(b, t, -1).detach()
        if self.training:  # tokens per expert (index_add: a static shape, unlike bincount, for torch.compile)
            flat = idx_nk.reshape(-1)
            self.load_e.index_add_(0, flat, torch.ones(flat.shape, dtype=self.load_e.dtype, device=flat.device))
        return self.experts(x_nd, idx_nk, w_nk).view(b, -1, d)  # (a sequence-parallel dispatcher returns a slice)

    def experts(self, x_nd: torch.Tensor, idx_nk: torch.Tensor, w_nk: torch.Tensor) -> torch.Tensor:
        """Routed experts (permute by expert -> grouped GEMMs with SwiGLU -> weighted unpermute: the
        ``moe_experts`` kernel) plus the shared expert. Under expert/tensor parallelism ``parallelize.py``
        replaces this per instance by a token dispatcher (``trainer/parallel/expert_parallel.py``)."""
        y_nd = self.routed(x_nd, idx_nk, w_nk, *self.expert_weights())
        if self.shared is not None:
            y_nd = y_nd + self.shared(x_nd)
        return y_nd

    def expert_weights(self) -> tuple[torch.Tensor | None, ...]:
        """``(w_gate, w_up, w_down)``; ``None`` each where a quantised frozen base holds the experts instead and the
        placeholders were dropped (``trainer.hub.frozen_base.drop_expert_placeholders``: QLoRA under parallel.*)."""
        return tuple(self._parameters.get(n) for n in ("w_gate", "w_up", "w_down"))

    def routed(self, x_nd, idx_nk, w_nk, w_gate, w_up, w_down) -> torch.Tensor:
        """The routed experts on (local) expert weights: the ``moe_experts`` kernel, or with adapters attached
        the per-expert LoRA composition (``ExpertLoRA``); a quantised frozen base gives its weights as
        callables that dequantise on demand (``kernels.moe_experts_lora``)."""
        base = (w_gate, w_up, w_down)
        if self.frozen_experts is not None:
            dev = x_nd.device.type
            base = self.frozen_experts.weights(torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev)
                                               else x_nd.dtype)
        if self.lora is not None:
            return self.lora(x_nd, idx_nk, w_nk, base, self.cfg.swiglu_limit)
        if self.frozen_experts is not None:
            return moe_experts_lora(x_nd, idx_nk, w_nk, base, {}, 1.0, self.cfg.swiglu_limit)
        return moe_experts(x_nd, idx_nk, w_nk, w_gate, w_up, w_down, self.cfg.swiglu_limit)

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
        post, comb, h = self.attn_hc(x_btnd)
        a = self.attn(self.attn_norm(h), pos_bt, rope, packing, cache)
        x_btnd = hc_expand(post, comb, a, x_btnd)  # post ⊗ a + comb^T x, in the streams' dtype
        post, comb, h = self.ffn_hc(x_btnd)
        f = self.ffn(self.ffn_norm(h), ids_bt)
        return hc_expand(post, comb, f, x_btnd)


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
        self.streams_fp32 = cfg.hc_streams_fp32

    def forward(self, h_btd, next_emb_btd, pos_bt, rope, ids_bt, packing: Packing | None, n: int) -> torch.Tensor:
        x = expand_streams(self.mix(h_btd, next_emb_btd), n, self.streams_fp32)
        return self.norm(self.hc_head(self.block(x, pos_bt, rope, ids_bt, packing)))

    def mix(self, h_btd: torch.Tensor, next_emb_btd: torch.Tensor) -> torch.Tensor:
        """``[B, T, D]``: the projection of the next tokens' normalised embeddings beside the normalised trunk
        output (a method of its own so that training compiles it as one region: ``training.apply_compile``)."""
        return self.eh_proj(torch.cat([self.enorm(next_emb_btd), self.hnorm(h_btd)], dim=-1))


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
        self.balance_experts = True  # aux-loss-free bias updates (off on a frozen base: trainer/lora.py)

    @torch.no_grad()
    def init_buffers(self) -> None:
        """Recompute the non-persistent buffers (RoPE frequencies, MoE load counters) in place: a model built
        on the meta device and allocated with ``to_empty`` has garbage there."""
        cfg = self.cfg
        self.inv_freq_main.copy_(rope_inv_freq(cfg.rope_head_dim, cfg.rope_theta))
        self.inv_freq_compress.copy_(rope_inv_freq(cfg.rope_head_dim, cfg.compress_rope_theta, cfg.compress_yarn))
        for m in self.modules():
            if isinstance(m, MoE):
                m.load_e.zero_()

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

    def compress_rates(self) -> tuple[int, ...]:
        """The compression rates of this model's CSA / HCA layers (their packed layouts are built up front)."""
        kinds = set(self.cfg.attention_types)
        rates = [rate for kind, rate in (("compressed_sparse_attention", self.cfg.compress_rate_csa),
                                         ("heavily_compressed_attention", self.cfg.compress_rate_hca)) if kind in kinds]
        return tuple(dict.fromkeys(rates))

    def _packing(self, doc_bt: torch.Tensor, pos_bt: torch.Tensor) -> Packing:
        """The documents' layouts and the masks every layer of a forward over ``pos_bt`` shares."""
        packing = Packing(doc_bt, self.compress_rates())
        packing.build_masks(pos_bt, self.cfg.sliding_window)
        return packing

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
        packing = None if doc_bt is None or cache is not None else self._packing(doc_bt, pos_bt)
        x = expand_streams(self.embed(input_ids_bt), self.cfg.hc_mult, self.cfg.hc_streams_fp32)
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
            packing = None if doc_bt is None else self._packing(doc_bt[:, :-1], pos)
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
        stats, rate = {}, self.cfg.bias_update_rate if self.balance_experts else 0.0
        for i, m in enumerate(self.moe_layers()):
            for k, v in m.update_bias(rate).items():
                stats[f"moe{i}_{k}"] = v
        for mtp in self.mtp:
            mtp.block.ffn.update_bias(rate)
        return stats

    def num_params(self) -> dict[str, int]:
        """Total and activated (per token) parameters; MTP heads are counted separately, as V4 reports."""
        c = self.cfg
        mtp = sum(p.numel() for p in self.mtp.parameters())
        total = sum(p.numel() for p in self.parameters()) - mtp
        per_expert = 3 * c.hidden_size * c.moe_intermediate_size
        inactive = per_expert * (c.n_routed_experts - c.num_experts_per_tok) * c.num_layers
        return {"total": total, "active": total - inactive - self.embed.weight.numel(), "mtp": mtp}
