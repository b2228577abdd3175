"""Hugging Face ``DeepseekV4ForCausalLM`` <-> native names and layouts, and the two configs.

Layout changes: routed experts are stored natively as ``w_gate``/``w_up`` ``[E, D, I]`` and ``w_down``
``[E, I, D]`` (``x @ W`` for grouped GEMMs) where HF packs ``gate_up_proj [E, 2I, D]`` and
``down_proj [E, D, I]``; the grouped output projection is ``wo_a [G, in, r]`` natively and
``o_a_proj.weight [G*r, in]`` in HF. Everything else is a rename. Both directions are exact (pure
reshapes/transposes), so HF -> native -> HF is bit-identical. MTP weights keep their native names under
``mtp.`` (``transformers`` ignores that prefix on load).
"""

from __future__ import annotations

import re

import torch

from trainer.models.deepseek_v4.args import ModelArgs, YarnConfig

_LAYER = {  # native suffix -> HF suffix inside a decoder layer
    "attn_hc.fn": "attn_hc.fn", "attn_hc.base": "attn_hc.base", "attn_hc.scale": "attn_hc.scale",
    "ffn_hc.fn": "ffn_hc.fn", "ffn_hc.base": "ffn_hc.base", "ffn_hc.scale": "ffn_hc.scale",
    "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn.wq_a.weight": "self_attn.q_a_proj.weight", "attn.q_norm.weight": "self_attn.q_a_norm.weight",
    "attn.wq_b.weight": "self_attn.q_b_proj.weight", "attn.wkv.weight": "self_attn.kv_proj.weight",
    "attn.kv_norm.weight": "self_attn.kv_norm.weight", "attn.wo_b.weight": "self_attn.o_b_proj.weight",
    "attn.sinks": "self_attn.sinks",
    "attn.compressor.wkv.weight": "self_attn.compressor.kv_proj.weight",
    "attn.compressor.wgate.weight": "self_attn.compressor.gate_proj.weight",
    "attn.compressor.ape": "self_attn.compressor.position_bias",
    "attn.compressor.norm.weight": "self_attn.compressor.kv_norm.weight",
    "attn.indexer.comp.wkv.weight": "self_attn.compressor.indexer.kv_proj.weight",
    "attn.indexer.comp.wgate.weight": "self_attn.compressor.indexer.gate_proj.weight",
    "attn.indexer.comp.ape": "self_attn.compressor.indexer.position_bias",
    "attn.indexer.comp.norm.weight": "self_attn.compressor.indexer.kv_norm.weight",
    "attn.indexer.wq_b.weight": "self_attn.compressor.indexer.q_b_proj.weight",
    "attn.indexer.weights_proj.weight": "self_attn.compressor.indexer.scorer.weights_proj.weight",
    "ffn.gate.weight": "mlp.gate.weight", "ffn.expert_bias": "mlp.gate.e_score_correction_bias",
    "ffn.tid2eid": "mlp.gate.tid2eid",
    "ffn.shared.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn.shared.w3.weight": "mlp.shared_experts.up_proj.weight",
    "ffn.shared.w2.weight": "mlp.shared_experts.down_proj.weight",
}
_TOP = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
        "hc_head.fn": "model.hc_head.hc_fn", "hc_head.base": "model.hc_head.hc_base",
        "hc_head.scale": "model.hc_head.hc_scale", "lm_head.weight": "lm_head.weight"}
_LAYER_INV = {v: k for k, v in _LAYER.items()}
_TOP_INV = {v: k for k, v in _TOP.items()}
_NATIVE_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def to_hf(state: dict[str, torch.Tensor], cfg: ModelArgs) -> dict[str, torch.Tensor]:
    """Native state dict -> HF ``DeepseekV4ForCausalLM`` state dict (buffers included)."""
    out: dict[str, torch.Tensor] = {}
    pending: dict[int, dict[str, torch.Tensor]] = {}
    for name, t in state.items():
        if name.startswith("mtp."):
            out[name] = t
            continue
        if name in _TOP:
            out[_TOP[name]] = t
            continue
        m = _NATIVE_LAYER.match(name)
        if not m:
            raise KeyError(f"native parameter {name!r} has no HF name")
        i, rest = int(m.group(1)), m.group(2)
        if rest == "ffn.expert_bias" and cfg.moe_types[i] == "hash_moe":
            continue  # hash routing has no selection bias (always zero natively)
        if rest in ("ffn.w_gate", "ffn.w_up"):
            pending.setdefault(i, {})[rest] = t
        elif rest == "ffn.w_down":
            out[f"model.layers.{i}.mlp.experts.down_proj"] = t.transpose(1, 2).contiguous()
        elif rest == "attn.wo_a":
            g, n_in, r = t.shape
            out[f"model.layers.{i}.self_attn.o_a_proj.weight"] = t.transpose(1, 2).reshape(g * r, n_in).contiguous()
        elif rest in _LAYER:
            out[f"model.layers.{i}.{_LAYER[rest]}"] = t
        else:
            raise KeyError(f"native parameter {name!r} has no HF name")
    for i, p in pending.items():
        gate_up = torch.cat([p["ffn.w_gate"].transpose(1, 2), p["ffn.w_up"].transpose(1, 2)], dim=1)
        out[f"model.layers.{i}.mlp.experts.gate_up_proj"] = gate_up.contiguous()
    if cfg.tie_embeddings:
        out.pop("lm_head.weight", None)
    return out


def from_hf(state: dict[str, torch.Tensor], cfg: ModelArgs) -> dict[str, torch.Tensor]:
    """HF state dict -> native state dict (the exact inverse of :func:`to_hf`)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if name.startswith("mtp."):
            out[name] = t
            continue
        if name in _TOP_INV:
            out[_TOP_INV[name]] = t
            continue
        m = _HF_LAYER.match(name)
        if not m:
            raise KeyError(f"HF parameter {name!r} is not part of a DeepSeek-V4 model")
        i, rest = int(m.group(1)), m.group(2)
        if rest == "mlp.experts.gate_up_proj":
            inter = t.shape[1] // 2
            out[f"layers.{i}.ffn.w_gate"] = t[:, :inter].transpose(1, 2).contiguous()
            out[f"layers.{i}.ffn.w_up"] = t[:, inter:].transpose(1, 2).contiguous()
        elif rest == "mlp.experts.down_proj":
            out[f"layers.{i}.ffn.w_down"] = t.transpose(1, 2).contiguous()
        elif rest == "self_attn.o_a_proj.weight":
            g = cfg.o_groups
            out[f"layers.{i}.attn.wo_a"] = t.view(g, t.shape[0] // g, t.shape[1]).transpose(1, 2).contiguous()
        elif rest in _LAYER_INV:
            out[f"layers.{i}.{_LAYER_INV[rest]}"] = t
        else:
            raise KeyError(f"HF parameter {name!r} has no native name")
    for i, kind in enumerate(cfg.moe_types):
        if kind == "hash_moe":
            out[f"layers.{i}.ffn.expert_bias"] = torch.zeros(cfg.n_routed_experts)
    if cfg.tie_embeddings:
        out["lm_head.weight"] = out["embed.weight"]
    return out


def hf_config(cfg: ModelArgs, vocab_size: int) -> dict:
    """``config.json`` fields of the equivalent ``DeepseekV4Config``."""
    compress = {"rope_type": "default"}
    if cfg.compress_yarn is not None:
        compress = {"rope_type": "yarn", "factor": cfg.compress_yarn.factor, "attention_factor": 1.0,
                    "original_max_position_embeddings": cfg.compress_yarn.original_max_position_embeddings,
                    "beta_fast": cfg.compress_yarn.beta_fast, "beta_slow": cfg.compress_yarn.beta_slow}
    factor = cfg.rope_head_dim / cfg.head_dim
    return {
        "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
        "vocab_size": vocab_size, "hidden_size": cfg.hidden_size, "moe_intermediate_size": cfg.moe_intermediate_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads, "num_key_value_heads": 1,
        "head_dim": cfg.head_dim, "q_lora_rank": cfg.q_lora_rank, "num_experts_per_tok": cfg.num_experts_per_tok,
        "n_routed_experts": cfg.n_routed_experts, "n_shared_experts": cfg.n_shared_experts,
        "scoring_func": cfg.scoring_func, "norm_topk_prob": True, "routed_scaling_factor": cfg.routed_scaling_factor,
        "max_position_embeddings": cfg.max_seq_len, "rope_theta": cfg.rope_theta,
        "layer_types": cfg.attention_types, "mlp_layer_types": cfg.moe_types,
        "compress_rates": {"compressed_sparse_attention": cfg.compress_rate_csa,
                           "heavily_compressed_attention": cfg.compress_rate_hca},
        "compress_rope_theta": cfg.compress_rope_theta, "hc_mult": cfg.hc_mult,
        "hc_sinkhorn_iters": cfg.hc_sinkhorn_iters, "hc_eps": cfg.hc_eps, "swiglu_limit": cfg.swiglu_limit,
        "sliding_window": cfg.sliding_window, "o_groups": cfg.o_groups, "o_lora_rank": cfg.o_lora_rank,
        "index_n_heads": cfg.index_n_heads, "index_head_dim": cfg.index_head_dim, "index_topk": cfg.index_topk,
        "num_nextn_predict_layers": cfg.mtp_layers, "partial_rotary_factor": factor,
        "rope_parameters": {"main": {"rope_type": "default", "rope_theta": cfg.rope_theta, "partial_rotary_factor": factor},
                            "compress": {**compress, "rope_theta": cfg.compress_rope_theta,
                                         "partial_rotary_factor": factor}},
        "rms_norm_eps": cfg.norm_eps, "initializer_range": cfg.init_std, "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0,
    }


_LEGACY_TYPES = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}


def model_config_from_hf(hf: dict, **overrides) -> tuple[ModelArgs, int]:
    """A native :class:`ModelArgs` (and the vocab size) from an HF ``config.json`` dict.

    Accepts both the current field names and the upstream checkpoints' legacy ones
    (``compress_ratios``, ``num_hash_layers``, ``qk_rope_head_dim``, ``rope_scaling``).
    """
    n = hf["num_hidden_layers"]
    layer_types = hf.get("layer_types")
    if layer_types is None and hf.get("compress_ratios") is not None:
        layer_types = [_LEGACY_TYPES[r] for r in hf["compress_ratios"][:n]]
    mlp_types = hf.get("mlp_layer_types")
    if mlp_types is None:
        n_hash = hf.get("num_hash_layers", 3)
        mlp_types = ["hash_moe"] * min(n, n_hash) + ["moe"] * max(0, n - n_hash)
    rates = hf.get("compress_rates") or {}
    rope_dim = hf.get("qk_rope_head_dim") or int(hf["head_dim"] * (hf.get("partial_rotary_factor") or 0.125))
    rp = hf.get("rope_parameters") or {}
    yarn_src = rp.get("compress") if isinstance(rp.get("compress"), dict) else (hf.get("rope_scaling") or {})
    yarn = None
    if yarn_src.get("rope_type", yarn_src.get("type")) == "yarn":
        yarn = YarnConfig(factor=yarn_src["factor"],
                          original_max_position_embeddings=yarn_src["original_max_position_embeddings"],
                          beta_fast=yarn_src.get("beta_fast") or 32, beta_slow=yarn_src.get("beta_slow") or 1)
    fields = dict(
        hidden_size=hf["hidden_size"], num_layers=n, num_heads=hf["num_attention_heads"], head_dim=hf["head_dim"],
        rope_head_dim=rope_dim, q_lora_rank=hf["q_lora_rank"], o_groups=hf["o_groups"],
        o_lora_rank=hf["o_lora_rank"], layer_types=layer_types, sliding_window=hf["sliding_window"],
        compress_rate_csa=rates.get("compressed_sparse_attention", 4),
        compress_rate_hca=rates.get("heavily_compressed_attention", 128),
        index_n_heads=hf["index_n_heads"], index_head_dim=hf["index_head_dim"], index_topk=hf["index_topk"],
        rope_theta=hf.get("rope_theta", 10000.0), compress_rope_theta=hf.get("compress_rope_theta", 160000.0),
        compress_yarn=yarn, hc_mult=hf["hc_mult"], hc_sinkhorn_iters=hf["hc_sinkhorn_iters"],
        hc_eps=hf["hc_eps"], mlp_layer_types=mlp_types, moe_intermediate_size=hf["moe_intermediate_size"],
        n_routed_experts=hf["n_routed_experts"], n_shared_experts=hf.get("n_shared_experts", 1),
        num_experts_per_tok=hf["num_experts_per_tok"], scoring_func=hf["scoring_func"],
        routed_scaling_factor=hf["routed_scaling_factor"], swiglu_limit=hf["swiglu_limit"],
        mtp_layers=min(1, hf.get("num_nextn_predict_layers", 0)), max_seq_len=hf["max_position_embeddings"],
        norm_eps=hf.get("rms_norm_eps", 1e-6), init_std=hf.get("initializer_range", 0.02),
        tie_embeddings=hf.get("tie_word_embeddings", False),
    )
    fields.update(overrides)
    return ModelArgs(**fields), hf["vocab_size"]
