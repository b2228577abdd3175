import torch

from trainer.export import build_model
from trex.config import ModelConfig, StageTrainConfig

TINY = dict(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, first_k_dense=1,
            dense_intermediate_size=48, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
            max_seq_len=64)


def tiny_model(seed=0, vocab=97, **kw):
    return build_model(ModelConfig(**{**TINY, **kw}), vocab, seed)


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
