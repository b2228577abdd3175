"""Tile sweep of the Triton grouped GEMM (forward + backward) on CUDA, against per-expert torch matmuls.

Prints the median milliseconds and TFLOP/s of each (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) for the
MoE shapes of ``bench/kernels_bench.py --device cuda`` and the one ``kernels.grouped_gemm.default_blocks``
picks. Run on a GPU: ``python bench/grouped_gemm_sweep.py [--tokens 16384 --experts 64 --topk 6 --hidden 2048
--inter 1024]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CONFIGS = [(64, 64, 32, 4, 2), (64, 128, 64, 4, 3), (128, 64, 64, 4, 3), (128, 128, 32, 4, 3),
           (128, 128, 64, 8, 3), (128, 128, 64, 4, 4), (128, 256, 64, 8, 3), (64, 256, 64, 8, 4)]


def main() -> None:
    import torch

    from kernels.grouped_gemm import default_blocks, grouped_mm_reference, grouped_mm_triton

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for key, val in dict(tokens=16384, experts=64, topk=6, hidden=2048, inter=1024, rounds=7).items():
        ap.add_argument(f"--{key}", type=int, default=val)
    a = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    m = a.tokens * a.topk
    idx = torch.randint(0, a.experts, (m,), generator=g)
    counts = torch.bincount(idx, minlength=a.experts).cuda()
    x = torch.randn(m, a.hidden, generator=g).cuda().bfloat16().requires_grad_()
    w = (torch.randn(a.experts, a.hidden, a.inter, generator=g) * a.hidden ** -0.5).cuda().bfloat16().requires_grad_()
    dy = torch.randn(m, a.inter, generator=g).cuda().bfloat16()
    flops = 3 * 2 * m * a.hidden * a.inter

    def timed(fn) -> float:
        for _ in range(2):
            torch.autograd.grad(fn(), [x, w], dy)
        ts = []
        for _ in range(a.rounds):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            torch.autograd.grad(fn(), [x, w], dy)
            end.record()
            torch.cuda.synchronize()
            ts.append(start.elapsed_time(end))
        return statistics.median(ts)

    ref = timed(lambda: grouped_mm_reference(x, w, counts))
    print(f"M={m} D={a.hidden} N={a.inter} E={a.experts} bf16; default {default_blocks(torch.bfloat16)}")
    print(f"{'per-expert torch':28s} {ref:7.2f} ms {flops / ref / 1e9:7.1f} TFLOP/s")
    for bm, bn, bk, nw, ns in CONFIGS:
        try:
            ms = timed(lambda: grouped_mm_triton(x, w, counts, blocks=(bm, bn, bk), warps=(nw, ns)))
        except Exception as e:  # noqa: BLE001 - e.g. out of shared memory for this tile
            print(f"{str((bm, bn, bk, nw, ns)):28s} failed: {type(e).__name__}: {str(e)[:80]}")
            continue
        print(f"{str((bm, bn, bk, nw, ns)):28s} {ms:7.2f} ms {flops / ms / 1e9:7.1f} TFLOP/s ({ref / ms:.2f}x)")


if __name__ == "__main__":
    main()
