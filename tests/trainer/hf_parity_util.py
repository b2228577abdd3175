"""Build the same random DeepSeek-V4 weights in the native model and in transformers' implementation."""

from __future__ import annotations

import torch

from trainer.models.deepseek_v4.args import ModelArgs
from trainer.models.deepseek_v4.model import Transformer
from trainer.models.deepseek_v4.state_dict_adapter import from_hf, hf_config, to_hf

VOCAB = 97

CONFIGS = {
    # every attention type, hash + top-k MoE, sqrtsoftplus, MTP, YaRN on the compressed branches
    "mixed_sqrtsoftplus_mtp": dict(hidden_size=32, num_layers=4, num_heads=4, head_dim=16, rope_head_dim=8,
                                   q_lora_rank=24, o_groups=2, o_lora_rank=12, sliding_window=8,
                                   layer_types=["sliding_attention", "compressed_sparse_attention",
                                                "heavily_compressed_attention", "compressed_sparse_attention"],
                                   compress_rate_csa=4, compress_rate_hca=8, index_n_heads=2, index_head_dim=8,
                                   index_topk=3, mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
                                   moe_intermediate_size=16, n_routed_experts=5, num_experts_per_tok=2,
                                   scoring_func="sqrtsoftplus", routed_scaling_factor=1.5, hc_mult=4,
                                   compress_yarn={"factor": 4.0, "original_max_position_embeddings": 16},
                                   mtp_layers=1, max_seq_len=64),
    "csa_sigmoid": dict(hidden_size=24, num_layers=2, num_heads=2, head_dim=12, rope_head_dim=4, q_lora_rank=16,
                        o_groups=1, o_lora_rank=8, sliding_window=5,
                        layer_types=["compressed_sparse_attention", "compressed_sparse_attention"],
                        compress_rate_csa=2, index_n_heads=3, index_head_dim=6, index_topk=4,
                        mlp_layer_types=["moe", "moe"], moe_intermediate_size=12, n_routed_experts=4,
                        num_experts_per_tok=3, scoring_func="sigmoid", routed_scaling_factor=2.5, hc_mult=2,
                        swiglu_limit=0.5, max_seq_len=64),
    "hca_softmax_hash": dict(hidden_size=16, num_layers=3, num_heads=4, head_dim=8, rope_head_dim=8, q_lora_rank=8,
                             o_groups=4, o_lora_rank=4, sliding_window=16,
                             layer_types=["heavily_compressed_attention", "sliding_attention",
                                          "heavily_compressed_attention"],
                             compress_rate_hca=4, index_n_heads=1, index_head_dim=8, index_topk=2,
                             mlp_layer_types=["hash_moe", "hash_moe", "moe"], moe_intermediate_size=8,
                             n_routed_experts=6, num_experts_per_tok=1, scoring_func="softmax",
                             routed_scaling_factor=1.0, hc_mult=3, hc_sinkhorn_iters=5, max_seq_len=64),
}


def random_pair(name: str, seed: int = 0, **overrides):
    """(native model, HF model, ModelArgs) holding the same random weights (fp32, eval mode).

    ``overrides`` change fields of ``CONFIGS[name]`` for this pair only (``CONFIGS`` is shared: never mutated)."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
    from transformers.activations import ACT2FN

    # transformers 5.x names "softmax" as a V4 scoring function but has no activation of that name:
    # plug the obvious one in, so the softmax router is compared too
    ACT2FN.setdefault("softmax", (torch.nn.Softmax, {"dim": -1}))

    cfg = ModelArgs(**{**CONFIGS[name], **overrides})
    native = Transformer(cfg, VOCAB)
    native.init_weights(seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # perturb the zero/one-initialised parameters too, so every one of them matters
        for n, p in native.named_parameters():
            p.add_(torch.randn(p.shape, generator=g) * (0.1 if p.dim() < 2 else 0.02))
        for m in native.moe_layers():
            if not m.hash:  # hash routing selects by token id: no selection bias
                m.expert_bias.copy_(torch.randn(m.expert_bias.shape, generator=g) * 0.05)
    hf = DeepseekV4ForCausalLM(DeepseekV4Config(**hf_config(cfg, VOCAB))).float()
    missing, unexpected = hf.load_state_dict({k: v for k, v in to_hf(native.state_dict(), cfg).items()
                                              if not k.startswith("mtp.")}, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    return native.eval(), hf.eval(), cfg


__all__ = ["CONFIGS", "VOCAB", "random_pair", "from_hf", "to_hf"]
