import torch

from trainer.export import build_model
from trainer.models.deepseek_v4.args import ModelArgs
from trex.core.config import StageTrainConfig

# every attention type and both MoE routings, small enough for fast CPU tests
TINY = dict(hidden_size=32, num_layers=3, num_heads=4, head_dim=16, rope_head_dim=8, q_lora_rank=16, o_groups=2,
            o_lora_rank=8, sliding_window=16, layer_types=["sliding_attention", "compressed_sparse_attention",
                                                           "heavily_compressed_attention"],
            compress_rate_csa=4, compress_rate_hca=8, index_n_heads=2, index_head_dim=8, index_topk=4,
            mlp_layer_types=["hash_moe", "moe", "moe"], n_routed_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=16, hc_mult=2, max_seq_len=64)


# a published-layout (hub) checkpoint's config.json keys for trainer.hub.fixture: every attention type, a hash layer
HUB_SMALL = {"hidden_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4, "head_dim": 16,
             "qk_rope_head_dim": 8, "q_lora_rank": 16, "o_groups": 2, "o_lora_rank": 8, "index_n_heads": 2,
             "index_head_dim": 8, "index_topk": 4, "sliding_window": 16, "moe_intermediate_size": 32,
             "n_routed_experts": 4, "num_experts_per_tok": 2, "num_hash_layers": 1, "compress_ratios": [0, 4, 128, 0],
             "hc_mult": 2, "max_position_embeddings": 64}


def tiny_model(seed=0, vocab=97, **kw):
    return build_model(ModelArgs(**{**TINY, **kw}), vocab, seed)


def tiny_train_cfg(**kw):
    base = dict(steps=20, batch_size=4, seq_len=32, lr=3e-3, warmup_steps=2, log_every=5, ckpt_every=5, keep_last=2)
    base.update(kw)
    return StageTrainConfig(**base)


def random_docs(n=24, vocab=97, seed=0):
    g = torch.Generator().manual_seed(seed)
    docs = []
    for _ in range(n):
        length = int(torch.randint(4, 20, (1,), generator=g))
        ids = torch.randint(0, vocab, (length,), generator=g).tolist()
        mask = [0] * (length // 2) + [1] * (length - length // 2)
        docs.append((ids, mask))
    return docs
