"""Kernel benchmarks: per op and device, the baseline against the optimised implementations.

Ops (each timed forward + backward, gradients by ``torch.autograd.grad`` so nothing accumulates):

* ``rms_norm``    -- weighted RMSNorm over ``[rows, width]``: reference vs Triton (CUDA) and Liger-Kernel;
* ``swiglu``      -- limited SwiGLU times the routing probability: reference vs Triton and Liger-Kernel's
  ``silu(a) * b`` followed by the probability multiply (Liger has no limit: that row skips the clamp);
* ``rope``        -- V4's partial interleaved RoPE on ``[1, width/128, rows, 128]`` (64 rotated channels):
  reference vs Triton (Liger's RoPE is the non-interleaved rotate-half layout: not the same op);
* ``sinkhorn``    -- the mHC Sinkhorn normalisation of ``[1, rows, 4, 4]`` logits, 20 iterations;
* ``router``      -- scores, biased top-k, weights (``kernels.router``): reference vs Triton (CUDA) and the NPU
  fused op where there is one;
* ``permute``     -- permute + weighted unpermute (``kernels.moe_permute``): reference vs Triton (CUDA);
* ``grouped_mm``  -- per-expert slices through autograd vs the grouped-GEMM ``autograd.Function`` (CPU
  loop with preallocated outputs) and Triton (CUDA);
* ``moe``         -- the routed-expert MoE layer: the model's per-expert Python loop vs ``moe_experts``'s
  fused per-expert CPU path and the permute -> grouped GEMM -> SwiGLU -> grouped GEMM -> unpermute
  composition (reference ops; Triton ops on CUDA);
* ``flce``        -- naive ``F.cross_entropy(h @ W.T)`` vs the chunked fused linear cross-entropy (and, on
  CUDA, the Triton grad-in-forward one and Liger-Kernel's when installed); prints the gradients' max abs
  difference.

Method: inputs are built once per op from a fixed seed; every implementation runs once to warm up, then
``--rounds`` rounds alternate the order (A B, B A, ...) and the table shows the median. Peak memory is the
extra memory the forward + backward needs on top of its inputs: on CUDA ``torch.cuda.max_memory_allocated``
minus the allocation before the call; on CPU the resident-set high-water mark of a fresh spawned process
(``VmHWM`` after resetting it through ``/proc/self/clear_refs``) minus its RSS just before the call, with
``MALLOC_MMAP_THRESHOLD_=65536`` so glibc maps and unmaps every large buffer and RSS follows the live
tensors instead of a malloc cache (this counts every allocation, torch's or not; after one warm-up run).
CPU threads default to 1: on a shared, loaded machine intra-op thread barriers add tens of ms to every
small op and would dominate what is measured (``--threads`` to change).

Run: ``python bench/kernels_bench.py [--ops moe,flce] [--rounds 3] [--quick] [--device cuda]``.
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

OPS = ("rms_norm", "swiglu", "rope", "sinkhorn", "hc_expand", "router", "permute", "grouped_mm", "moe", "flce")
SIZES = dict(tokens=4096, experts=64, topk=6, hidden=256, inter=128, ce_tokens=8192, vocab=32768, ce_hidden=256,
             rows=8192, width=1024)
QUICK = dict(tokens=1024, experts=16, topk=4, hidden=128, inter=64, ce_tokens=2048, vocab=8192, ce_hidden=128,
             rows=1024, width=256)

Run = Callable[[], list]  # one forward + backward; returns [output, *gradients] (for the accuracy column)


# ------------------------------------------------------------------------------------------------ cases
def _grads(out, inputs: list, seed_out) -> list:
    import torch

    grads = torch.autograd.grad(out, inputs, seed_out, allow_unused=True)
    return [out.detach(), *(g for g in grads if g is not None)]


def _routing(sz: dict, device, dtype, g):
    """Realistic top-k routing of ``tokens`` tokens (sqrtsoftplus scores of random gate logits)."""
    import torch

    from kernels.router import route_reference

    logits = torch.randn(sz["tokens"], sz["experts"], generator=g).to(device)
    w, idx, _ = route_reference(logits, None, sz["topk"], "sqrtsoftplus", 1.5)
    return w.to(device), idx.to(device)


def build_case(op: str, sz: dict, device: str, dtype_name: str) -> tuple[str, dict[str, Run]]:
    """(baseline name, {implementation: run}) for ``op``; the baseline is the first entry."""
    import torch

    from kernels.fused_linear_cross_entropy import (fused_linear_cross_entropy_chunked,
                                                    fused_linear_cross_entropy_triton, linear_cross_entropy_naive)
    from kernels.grouped_gemm import (grouped_mm_reference, grouped_mm_triton, moe_experts_composed,
                                      moe_experts_loop, moe_experts_reference, moe_experts_triton)
    from kernels.moe_permute import permute_reference, permute_triton, unpermute_reference, unpermute_triton
    from kernels.router import route_npu, route_reference, route_triton

    dtype = getattr(torch, dtype_name)
    g = torch.Generator().manual_seed(0)
    t, e, k, d, i = sz["tokens"], sz["experts"], sz["topk"], sz["hidden"], sz["inter"]

    def rand(*shape, scale=1.0, grad=True):
        x = (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)
        return x.requires_grad_(grad)

    impls: dict[str, Run] = {}
    rows, width = sz["rows"], sz["width"]
    if op in ("rms_norm", "swiglu", "rope", "sinkhorn", "hc_expand"):
        return _elementwise_case(op, rows, width, device, rand, g)
    if op == "router":
        logits = torch.randn(t, e, generator=g).to(device).requires_grad_()
        bias = (torch.randn(e, generator=g) * 0.1).to(device)
        gw = torch.randn(t, e, generator=g).to(device)  # per (token, expert): backends list experts in any order
        fns = {"reference": route_reference}
        if device == "cuda":
            fns["triton"] = route_triton
        if device == "npu":
            fns["torch_npu"] = route_npu

        def dense(w_nk, i_nk):  # the weights as a [tokens, experts] matrix: independent of the listing order
            return torch.zeros(t, e, device=w_nk.device, dtype=w_nk.dtype).scatter(1, i_nk, w_nk)

        for name, fn in fns.items():
            impls[name] = lambda fn=fn: _grads(dense(*fn(logits, bias, k, "sqrtsoftplus", 1.5)[:2]), [logits], gw)
        return "reference", impls

    if op == "permute":
        w, idx = _routing(sz, device, dtype, g)
        w.requires_grad_()
        x, gy = rand(t, d), rand(t, d, grad=False)
        pairs = {"reference": (permute_reference, unpermute_reference)}
        if device == "cuda":
            pairs["triton"] = (permute_triton, unpermute_triton)
        for name, (p, u) in pairs.items():
            def run(p=p, u=u):
                xs, _, order = p(x, idx, e)
                return _grads(u(xs, order, w, t), [x, w], gy)
            impls[name] = run
        return "reference", impls

    if op == "grouped_mm":
        _, idx = _routing(sz, device, dtype, g)
        counts = torch.bincount(idx.reshape(-1), minlength=e)
        x, w, gy = rand(t * k, d), rand(e, d, i, scale=d ** -0.5), rand(t * k, i, grad=False)
        sizes = counts.tolist()

        def slices():
            outs, start = [], 0
            for j, n in enumerate(sizes):
                if n:
                    outs.append(x[start:start + n] @ w[j])
                    start += n
            return _grads(torch.cat(outs), [x, w], gy)
        impls["autograd slices"] = slices
        impls["grouped (reference)"] = lambda: _grads(grouped_mm_reference(x, w, counts), [x, w], gy)
        if device == "cuda":
            impls["grouped (triton)"] = lambda: _grads(grouped_mm_triton(x, w, counts), [x, w], gy)
        return "autograd slices", impls

    if op == "moe":
        w, idx = _routing(sz, device, dtype, g)
        w.requires_grad_()
        x, gy = rand(t, d), rand(t, d, grad=False)
        wg, wu, wd = rand(e, d, i, scale=d ** -0.5), rand(e, d, i, scale=d ** -0.5), rand(e, i, d, scale=i ** -0.5)
        leaves = [x, w, wg, wu, wd]
        def composed_reference(*args):  # the reference permute / grouped GEMM / unpermute on any device
            return moe_experts_composed(*args, permute_fn=permute_reference, grouped_mm_fn=grouped_mm_reference,
                                        unpermute_fn=unpermute_reference)
        fns = {"per-expert loop": moe_experts_loop, "fused (reference)": moe_experts_reference,
               "composed (reference ops)": composed_reference}
        if device == "cuda":
            fns["composed (triton)"] = moe_experts_triton
        for name, fn in fns.items():
            impls[name] = lambda fn=fn: _grads(fn(x, idx, w, wg, wu, wd, 10.0), leaves, gy)
        return "per-expert loop", impls

    if op == "flce":
        n, v, dh = sz["ce_tokens"], sz["vocab"], sz["ce_hidden"]
        h, wv = rand(n, dh), rand(v, dh, scale=dh ** -0.5)
        labels = torch.randint(0, v, (n,), generator=g).to(device)
        labels[torch.rand(n, generator=g).to(device) < sz.get("ignore_frac", 0.0)] = -100
        one = torch.ones((), device=device)
        impls["naive"] = lambda: _grads(linear_cross_entropy_naive(h, wv, labels), [h, wv], one)
        impls["chunked"] = lambda: _grads(fused_linear_cross_entropy_chunked(h, wv, labels), [h, wv], one)
        if device == "cuda":
            impls["triton"] = lambda: _grads(fused_linear_cross_entropy_triton(h, wv, labels), [h, wv], one)
            try:
                from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

                impls["liger"] = lambda: _grads(liger_fused_linear_cross_entropy(h, wv, labels, reduction="sum"),
                                                [h, wv], one)
            except ImportError:
                pass
        return "naive", impls
    raise ValueError(f"unknown op {op!r}; known: {OPS}")


def _liger(name: str):
    """A Liger-Kernel functional op (CUDA only), or None when Liger-Kernel is not installed."""
    try:
        from liger_kernel.transformers import functional
    except ImportError:
        return None
    return getattr(functional, name, None)


def _elementwise_case(op: str, rows: int, width: int, device: str, rand, g) -> tuple[str, dict[str, Run]]:
    import torch

    from kernels.hc_expand import hc_expand_reference, hc_expand_triton
    from kernels.rms_norm import rms_norm_reference, rms_norm_triton
    from kernels.rope import apply_rope_reference, apply_rope_triton
    from kernels.sinkhorn import sinkhorn_reference, sinkhorn_triton
    from kernels.swiglu import swiglu_reference, swiglu_triton

    cuda = device == "cuda"
    impls: dict[str, Run] = {}
    if op == "rms_norm":
        x, w, gy = rand(rows, width), (1 + 0.1 * rand(width, grad=False)).requires_grad_(), rand(rows, width, grad=False)
        fns = {"reference": lambda: rms_norm_reference(x, w, 1e-6)}
        if cuda:
            fns["triton"] = lambda: rms_norm_triton(x, w, 1e-6)
            liger = _liger("liger_rms_norm")
            if liger is not None:  # not in place: the same output gradient is fed to every run
                fns["liger"] = lambda: liger(x, w, 1e-6, casting_mode="llama", in_place=False)
        for name, fn in fns.items():
            impls[name] = lambda fn=fn: _grads(fn(), [x, w], gy)
    elif op == "swiglu":
        a, b, gy = rand(rows, width), rand(rows, width), rand(rows, width, grad=False)
        p = torch.rand(rows, generator=g).to(device=device, dtype=a.dtype).requires_grad_()
        fns = {"reference": lambda: swiglu_reference(a, b, 10.0, p)}
        if cuda:
            fns["triton"] = lambda: swiglu_triton(a, b, 10.0, p)
            liger = _liger("liger_swiglu")
            if liger is not None:
                fns["liger (no limit)"] = lambda: liger(a, b) * p.unsqueeze(-1)
        for name, fn in fns.items():
            impls[name] = lambda fn=fn: _grads(fn(), [a, b, p], gy)
    elif op == "rope":
        heads = max(1, width // 128)
        x, gy = rand(1, heads, rows, 128), rand(1, heads, rows, 128, grad=False)
        ang = torch.rand(1, rows, 32, generator=g).to(device) * 6.28
        cos, sin = ang.cos(), ang.sin()
        fns = {"reference": apply_rope_reference}
        if cuda:
            fns["triton"] = apply_rope_triton
        for name, fn in fns.items():
            impls[name] = lambda fn=fn: _grads(fn(x, cos, sin), [x], gy)
    elif op == "sinkhorn":
        logits, gy = rand(1, rows, 4, 4), rand(1, rows, 4, 4, grad=False)
        fns = {"reference": sinkhorn_reference}
        if cuda:
            fns["triton"] = sinkhorn_triton
        for name, fn in fns.items():
            impls[name] = lambda fn=fn: _grads(fn(logits, 20, 1e-6), [logits], gy)
    elif op == "hc_expand":  # 4 fp32 residual streams (as the model keeps them), the block output in the dtype
        def f32(*shape, grad=True):
            return torch.randn(*shape, generator=g).to(device).requires_grad_(grad)

        post, comb, x, gy = f32(rows, 4), f32(rows, 4, 4), f32(rows, 4, width), f32(rows, 4, width, grad=False)
        y = rand(rows, width)
        fns = {"reference": hc_expand_reference}
        if cuda:
            fns["triton"] = hc_expand_triton
        for name, fn in fns.items():
            impls[name] = lambda fn=fn: _grads(fn(post, comb, y, x), [post, comb, y, x], gy)
    return "reference", impls


# ------------------------------------------------------------------------------------------------ timing
def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def time_impls(impls: dict[str, Run], rounds: int, device: str) -> tuple[dict[str, float], dict[str, list]]:
    """Median seconds per implementation over alternating rounds (after one warm-up run each)."""
    names = list(impls)
    results = {name: impls[name]() for name in names}  # warm-up; keep the results for the accuracy check
    _sync(device)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            gc.collect()
            _sync(device)
            t0 = time.perf_counter()
            impls[name]()
            _sync(device)
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}, results


def abs_diffs(a: list, b: list) -> list[float]:
    """Max abs difference per tensor (output, then each gradient)."""
    return [float((x.float() - y.float()).abs().max()) if x.numel() else 0.0 for x, y in zip(a, b)]


# ------------------------------------------------------------------------------------------------ memory
def _proc_status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                key, val = line.split(":")
                out[key] = int(val.split()[0]) * 1024
    return out


def _mem_worker(op: str, impl: str, sz: dict, dtype_name: str, threads: int, q) -> None:
    import torch

    torch.set_num_threads(threads)
    _, impls = build_case(op, sz, "cpu", dtype_name)
    run = impls[impl]
    run()  # warm-up: one-time allocations (libraries, thread pools) are not the op's
    gc.collect()
    before = _proc_status()["VmRSS"]
    with open("/proc/self/clear_refs", "w") as f:  # reset VmHWM to the current RSS
        f.write("5")
    run()
    q.put(_proc_status()["VmHWM"] - before)


def peak_memory(op: str, impl: str, sz: dict, device: str, dtype_name: str, threads: int,
                impls: dict[str, Run] | None = None) -> float | None:
    """Bytes the forward + backward needs on top of its inputs (see the module docstring)."""
    if device == "cuda":
        import torch

        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        impls[impl]()
        torch.cuda.synchronize()
        return float(torch.cuda.max_memory_allocated() - before)
    if device != "cpu" or not os.path.exists("/proc/self/clear_refs"):
        return None
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    old = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # read by the child's glibc at start-up
    try:
        p = ctx.Process(target=_mem_worker, args=(op, impl, sz, dtype_name, threads, q))
        p.start()
        out = q.get(timeout=1800)
        p.join()
    finally:
        if old is None:
            os.environ.pop("MALLOC_MMAP_THRESHOLD_")
        else:
            os.environ["MALLOC_MMAP_THRESHOLD_"] = old
    return float(out)


# ------------------------------------------------------------------------------------------------ report
def _describe(op: str, sz: dict, dtype_name: str) -> str:
    shapes = {"rms_norm": f"{sz['rows']}x{sz['width']}", "swiglu": f"{sz['rows']}x{sz['width']} limit p",
              "rope": f"1x{max(1, sz['width'] // 128)}x{sz['rows']}x128 F=32", "sinkhorn": f"1x{sz['rows']}x4x4 20it",
              "hc_expand": f"{sz['rows']}x4x{sz['width']} fp32 streams"}
    if op in shapes:
        return f"{shapes[op]} {dtype_name}"
    if op == "flce":
        return f"N={sz['ce_tokens']} V={sz['vocab']} D={sz['ce_hidden']} {dtype_name}"
    return f"T={sz['tokens']} E={sz['experts']} k={sz['topk']} D={sz['hidden']} I={sz['inter']} {dtype_name}"


def _print_table(rows: list[dict], title: str) -> None:
    headers = ["op", "shape", "impl", "ms", "speedup", "peak MB", "mem ratio", "max|Δ|"]
    cells = [[r["op"], r["shape"], r["impl"], f"{r['ms']:.1f}", f"{r['speedup']:.2f}x",
              "-" if r["peak_mb"] is None else f"{r['peak_mb']:.1f}",
              "-" if r["mem_ratio"] is None else f"{r['mem_ratio']:.3f}",
              "-" if r["max_abs_diff"] is None else f"{r['max_abs_diff']:.2e}"] for r in rows]
    try:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=title)
        for h in headers:
            table.add_column(h, justify="left" if h in ("op", "shape", "impl") else "right")
        for c in cells:
            table.add_row(*c)
        Console(width=160).print(table)
    except ImportError:
        print(title)
        for c in [headers, *cells]:
            print("  ".join(f"{x:>14s}" for x in c))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", default=",".join(OPS), help=f"comma-separated subset of {','.join(OPS)}")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--dtype", default=None, help="default: float32 on CPU, bfloat16 on CUDA")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None,
                    help="CPU intra-op threads (default: torch's, i.e. every core, as training runs)")
    ap.add_argument("--quick", action="store_true", help="smaller shapes (a smoke run)")
    ap.add_argument("--no-memory", action="store_true", help="skip the peak-memory measurements")
    ap.add_argument("--ignore-frac", type=float, default=0.0, help="flce: fraction of labels set to -100")
    for key, val in SIZES.items():
        ap.add_argument(f"--{key.replace('_', '-')}", type=int, default=None, help=f"default {val}")
    a = ap.parse_args(argv)

    import torch

    device = ("cuda" if torch.cuda.is_available() else "cpu") if a.device == "auto" else a.device
    dtype_name = a.dtype or ("bfloat16" if device == "cuda" else "float32")
    if a.threads:
        torch.set_num_threads(a.threads)
    a.threads = torch.get_num_threads()
    sz = dict(QUICK if a.quick else SIZES)
    sz.update({k: getattr(a, k) for k in SIZES if getattr(a, k) is not None})
    sz["ignore_frac"] = a.ignore_frac
    ops = [o.strip() for o in a.ops.split(",") if o.strip()]

    rows: list[dict] = []
    for op in ops:
        baseline, impls = build_case(op, sz, device, dtype_name)
        times, results = time_impls(impls, a.rounds, device)
        mems = {name: (None if a.no_memory else peak_memory(op, name, sz, device, dtype_name, a.threads, impls))
                for name in impls}
        for name in impls:
            base_mem, mem = mems[baseline], mems[name]
            diffs = None if name == baseline else abs_diffs(results[name], results[baseline])
            rows.append({
                "op": op, "shape": _describe(op, sz, dtype_name), "impl": name, "ms": times[name] * 1e3,
                "speedup": times[baseline] / times[name], "peak_mb": None if mem is None else mem / 2 ** 20,
                "mem_ratio": None if mem is None or not base_mem else mem / base_mem,
                "max_abs_diff": None if diffs is None else max(diffs), "diffs": diffs,
            })
        del impls, results
        gc.collect()
        print(f"{op}: " + ", ".join(f"{r['impl']} {r['ms']:.1f} ms" for r in rows if r["op"] == op), flush=True)

    title = (f"kernels on {device} ({torch.get_num_threads()} threads), median of {a.rounds} alternating rounds; "
             f"speedup and memory vs each op's first row")
    _print_table(rows, title)
    for r in rows:
        if r["op"] == "flce" and r["diffs"] is not None:
            print(f"flce {r['impl']} vs naive, max abs diff of loss / dh / dW: "
                  + " / ".join(f"{x:.3e}" for x in r["diffs"]))
    if "flce" in ops and device == "cuda":
        from kernels.fused_linear_cross_entropy import _OUT_DTYPE_ADDMM

        print(f"flce fp32 dW accumulation by addmm(out_dtype=float32): {_OUT_DTYPE_ADDMM.get('cuda')}")
    result = {"device": device, "dtype": dtype_name, "threads": torch.get_num_threads(), "sizes": sz, "rows": rows}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
