"""V4's attention core alone, forward + backward: ``kernels.sink_attention``'s reference (one masked SDPA call)
against its ``triton`` backend (FlexAttention with a block mask; CUDA), per layer type.

Masks as the model builds them for one document per row: causal sliding window (all layers); plus, for a CSA
layer, ``index_topk`` of the complete compressed entries per query (random here, as an untrained indexer picks);
for an HCA layer, every complete entry. Reports the median time of ``--rounds`` alternating rounds, the peak
memory (CUDA) and the largest difference of the output and of the q / kv / sink gradients to the SDPA path.

Run (CUDA): ``python bench/attention_bench.py [--batch 4 --seq 4096 --heads 8 --head-dim 128]``
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from kernels.sink_attention import sink_attention_reference, sink_attention_triton  # noqa: E402
from trainer.models.deepseek_v4.packing import local_mask, window_mask  # noqa: E402


def masks(kind: str, b: int, t: int, window: int, rate: int, topk: int, device: str) -> torch.Tensor:
    pos = torch.arange(t, device=device)[None].expand(b, t)
    m = local_mask(pos, t, window)
    if kind == "sliding":
        return m
    w = t // rate
    visible = window_mask(pos, w, rate)
    if kind == "csa":  # top-k of random scores among the visible entries
        scores = torch.rand(b, t, w, device=device).masked_fill(~visible, -1.0)
        top = scores.topk(min(topk, w), dim=-1)
        visible = torch.zeros_like(visible).scatter_(-1, top.indices, top.values >= 0)
    return torch.cat([m, visible], dim=-1)


def run(fn, q, kv, sinks, mask, dout):
    q, kv, sinks = (x.detach().requires_grad_() for x in (q, kv, sinks))
    out = fn(q, kv, sinks, mask)
    out.backward(dout)
    return out.detach(), q.grad, kv.grad, sinks.grad


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--topk", type=int, default=128)
    ap.add_argument("--rate-csa", type=int, default=4)
    ap.add_argument("--rate-hca", type=int, default=128)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--kinds", default="sliding,csa,hca")
    a = ap.parse_args(argv)
    dev, dt = "cuda", torch.bfloat16 if a.dtype == "bf16" else torch.float32
    if not torch.cuda.is_available():  # (FlexAttention trains on CUDA only)
        raise SystemExit("attention_bench: no CUDA device (the triton backend runs the reference elsewhere)")
    sync = torch.cuda.synchronize
    g = torch.Generator(device="cpu").manual_seed(0)
    print(f"attention core fwd+bwd, {dev} {a.dtype}, B {a.batch} H {a.heads} T {a.seq} C {a.head_dim}, window "
          f"{a.window}, CSA rate {a.rate_csa} top-{a.topk}, HCA rate {a.rate_hca}, median of {a.rounds} rounds")
    print(f"{'layer':8s} {'S':>6s} {'visible':>8s} {'sdpa ms':>9s} {'flex ms':>9s} {'ratio':>7s} {'sdpa MB':>9s} "
          f"{'flex MB':>9s} {'max|d out|':>11s} {'max|d grads|':>12s}")
    for kind in a.kinds.split(","):
        mask = masks(kind, a.batch, a.seq, a.window, {"csa": a.rate_csa, "hca": a.rate_hca}.get(kind, 1), a.topk,
                     dev)
        s = mask.shape[-1]
        q = torch.randn(a.batch, a.heads, a.seq, a.head_dim, generator=g).to(dev, dt)
        kv = torch.randn(a.batch, s, a.head_dim, generator=g).to(dev, dt)
        sinks = torch.randn(a.heads, generator=g).to(dev)
        dout = torch.randn(a.batch, a.heads, a.seq, a.head_dim, generator=g).to(dev, dt)
        fns = {"sdpa": sink_attention_reference, "flex": sink_attention_triton}
        res = {k: run(f, q, kv, sinks, mask, dout) for k, f in fns.items()}  # warm-up (and compile)
        diff_out = (res["sdpa"][0].float() - res["flex"][0].float()).abs().max().item()
        diff_g = max((x.float() - y.float()).abs().max().item() for x, y in zip(res["sdpa"][1:], res["flex"][1:]))
        times = {k: [] for k in fns}
        peak = {}
        for r in range(a.rounds):
            for k in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                sync()
                t0 = time.perf_counter()
                run(fns[k], q, kv, sinks, mask, dout)
                sync()
                times[k].append(time.perf_counter() - t0)
                peak[k] = (torch.cuda.max_memory_allocated() - base) / 2 ** 20
        ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        print(f"{kind:8s} {s:6d} {mask.float().mean().item():8.1%} {ms['sdpa']:9.2f} {ms['flex']:9.2f} "
              f"{ms['sdpa'] / ms['flex']:6.2f}x {peak['sdpa']:9.0f} {peak['flex']:9.0f} "
              f"{diff_out:11.2e} {diff_g:12.2e}", flush=True)


if __name__ == "__main__":
    main()
