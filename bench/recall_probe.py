"""Associative-recall probe: does a model configuration learn key -> value lookup in a few hundred steps?

The lifecycle's SFT must copy a problem's numbers into its program (a content-addressed lookup). This probe
isolates that skill in minutes instead of a 25-minute ``make run``: each row holds ``--pairs`` random
(key, value) token pairs, then ``--queries`` of the keys again; the model must answer each with its value.
Accuracy on the answers is printed every 100 steps (chance: 1 / ``--values``).

``--engine v4`` trains the native DeepSeek-V4 built from ``--config`` plus ``--set`` overrides;
``--engine plain`` a standard pre-norm transformer of the same width and depth (``torch.nn``: separate
Q/K/V with biases, dense FFN, learned absolute positions) as the reference point.

Run: ``python bench/recall_probe.py [--engine v4|plain] [--steps 800] [--set model.init_std=0.08]``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def make_batch(rows: int, pairs: int, queries: int, n_keys: int, n_values: int, g):
    """(ids [rows, T], labels [rows, T]): ``k1 v1 ; k2 v2 ; ... ? kq vq ...``, labels only on the answers."""
    import torch

    sep, ask, key0 = n_values + n_keys, n_values + n_keys + 1, n_values
    ids, labels = [], []
    for _ in range(rows):
        keys = torch.randperm(n_keys, generator=g)[:pairs]
        vals = torch.randint(0, n_values, (pairs,), generator=g)
        seq = [tok for k, v in zip(keys.tolist(), vals.tolist()) for tok in (key0 + k, v, sep)] + [ask]
        lab = [-100] * len(seq)
        for j in torch.randperm(pairs, generator=g)[:queries].tolist():
            seq += [key0 + int(keys[j]), int(vals[j])]
            lab += [-100, int(vals[j])]
        ids.append(seq)
        labels.append(lab)
    return torch.tensor(ids), torch.tensor(labels)


def plain_model(vocab: int, d: int, layers: int, heads: int, max_len: int):
    import torch

    class Plain(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.pos = torch.nn.Embedding(vocab, d), torch.nn.Embedding(max_len, d)
            layer = torch.nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True, norm_first=True)
            self.enc = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
            self.out = torch.nn.Linear(d, vocab)

        def forward(self, ids):
            t = ids.shape[1]
            mask = torch.nn.Transformer.generate_square_subsequent_mask(t)
            return self.out(self.enc(self.emb(ids) + self.pos(torch.arange(t)), mask=mask, is_causal=True))

    return Plain()


def rope_model(vocab: int, d: int, layers: int, heads: int):
    """The plain transformer with RoPE on every head channel instead of absolute positions, no biases."""
    import torch
    import torch.nn.functional as F

    hd = d // heads

    def rotate(x_bhtc):
        t = x_bhtc.shape[2]
        inv = 10000.0 ** (-torch.arange(0, hd, 2, dtype=torch.float32) / hd)
        ang = torch.arange(t, dtype=torch.float32)[:, None] * inv[None]
        cos, sin = ang.cos(), ang.sin()
        x1, x2 = x_bhtc[..., 0::2], x_bhtc[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), -1).flatten(-2)

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.n1, self.n2 = torch.nn.RMSNorm(d), torch.nn.RMSNorm(d)
            self.qkv, self.o = torch.nn.Linear(d, 3 * d, bias=False), torch.nn.Linear(d, d, bias=False)
            self.up, self.down = torch.nn.Linear(d, 4 * d, bias=False), torch.nn.Linear(4 * d, d, bias=False)

        def forward(self, x_btd):
            b, t, _ = x_btd.shape
            q, k, v = self.qkv(self.n1(x_btd)).view(b, t, 3, heads, hd).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(rotate(q), rotate(k), v, is_causal=True)
            x_btd = x_btd + self.o(a.transpose(1, 2).reshape(b, t, d))
            return x_btd + self.down(F.gelu(self.up(self.n2(x_btd))))

    class Rope(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.blocks = torch.nn.Embedding(vocab, d), torch.nn.ModuleList(Block() for _ in range(layers))
            self.norm, self.out = torch.nn.RMSNorm(d), torch.nn.Linear(d, vocab, bias=False)

        def forward(self, ids):
            x = self.emb(ids)
            for blk in self.blocks:
                x = blk(x)
            return self.out(self.norm(x))

    return Rope()


def main(argv: list[str] | None = None) -> dict:
    import torch
    import torch.nn.functional as F

    from trainer.export import build_model
    from trex.core.config import load_config

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", choices=["v4", "plain", "plain-rope"], default="v4")
    ap.add_argument("--config", default="configs/tiny.yaml")
    ap.add_argument("--set", dest="overrides", action="append", default=[], help="config override a.b=c")
    ap.add_argument("--steps", type=int, default=800)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--pairs", type=int, default=12)
    ap.add_argument("--queries", type=int, default=4)
    ap.add_argument("--keys", type=int, default=40)
    ap.add_argument("--values", type=int, default=100)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--optimizer", choices=["adamw", "muon"], default="adamw",
                    help="muon: the trainer's Muon on hidden matrices + AdamW on the rest (v4 engine)")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    vocab = a.values + a.keys + 2
    cfg = load_config(a.config, a.overrides).model
    if a.engine == "v4":
        model = build_model(cfg, vocab, seed=0)
    elif a.engine == "plain-rope":
        model = rope_model(vocab, cfg.hidden_size, cfg.num_layers, cfg.num_heads)
    else:
        model = plain_model(vocab, cfg.hidden_size, cfg.num_layers, cfg.num_heads, 3 * a.pairs + 2 * a.queries + 1)
    if a.optimizer == "muon" and a.engine == "v4":
        from trainer.optim import build_optimizers
        from trex.core.config import StageTrainConfig

        opts = build_optimizers(model, StageTrainConfig(steps=a.steps, lr=a.lr, optimizer="muon", weight_decay=0.1))
    else:
        opts = [torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.1)]
    g = torch.Generator().manual_seed(1)
    held_out = make_batch(256, a.pairs, a.queries, a.keys, a.values, torch.Generator().manual_seed(99))
    t0, history = time.perf_counter(), []
    for step in range(1, a.steps + 1):
        ids, labels = make_batch(a.batch, a.pairs, a.queries, a.keys, a.values, g)
        loss = F.cross_entropy(model(ids)[:, :-1].reshape(-1, vocab), labels[:, 1:].reshape(-1), ignore_index=-100)
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for opt in opts:
            opt.step()
        if step % 100 == 0 or step == a.steps:
            with torch.no_grad():
                ids, labels = held_out
                pred, target = model(ids)[:, :-1].argmax(-1), labels[:, 1:]
                acc = float((pred[target != -100] == target[target != -100]).float().mean())
            history.append({"step": step, "loss": float(loss.detach()), "accuracy": acc})
            print(f"{a.engine} {' '.join(a.overrides)} step {step:5d} loss {float(loss.detach()):.3f} "
                  f"recall accuracy {acc:.3f} (chance {1 / a.values:.3f}; {time.perf_counter() - t0:.0f} s)",
                  flush=True)
    return {"engine": a.engine, "overrides": a.overrides, "history": history}


if __name__ == "__main__":
    main()
