"""Native DeepSeek-V4 vs transformers' DeepseekV4ForCausalLM: training throughput side by side.

Same model config (default: the tiny lifecycle model), same initial weights, same random batches. Each
measurement runs in a fresh spawned process (so peak RSS is per engine), engines alternate A/B/A/B, and
the table reports the median tokens/s, peak memory, MFU against the measured CPU peaks in fp32 and in bf16
(``trainer.metrics.peak_flops``, probed before and after the runs, the better of the two; on CUDA: the
device's peak from ``trainer.metrics.PEAK_BF16``), and the native/HF ratio.

Run: ``python bench/model_bench.py [--config configs/tiny.yaml] [--rounds 3] [--set model.hidden_size=1024]
[--device cuda --dtype bf16] [--engines native,hf,native-reference] [--compile] [--breakdown] [--profile DIR]``.
``native`` uses the kernel registry's choice for the device (Triton on CUDA), ``native-reference`` forces the torch reference ops,
``native-sdpa`` only the attention core's (masked SDPA instead of FlexAttention);
peak memory is the process's peak RSS on CPU and ``torch.cuda.max_memory_allocated`` on CUDA. ``--breakdown``
(CPU) profiles one more step per run, splits its time into GEMMs, attention kernels and the rest, and bounds the
native/HF ratio: HF's step over native's GEMM + attention time, what native would reach with nothing else left.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import resource
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _worker(engine: str, model_cfg: dict, vocab: int, batch: int, seq: int, steps: int, threads: int,
            device: str, dtype: str, compile_: bool, breakdown: bool, profile_dir: str | None, q) -> None:
    import contextlib

    import torch

    from kernels import registry
    from trainer.export import build_model
    from trainer.optim import adamw_fused
    from trainer.models.deepseek_v4.args import ModelArgs
    from trainer.models.deepseek_v4.state_dict_adapter import hf_config, to_hf

    torch.set_num_threads(threads)
    if engine == "native-reference":
        registry.set_overrides({"*": "reference"})
    if engine == "native-sdpa":  # the attention core as one masked SDPA call, not FlexAttention
        registry.set_overrides({"sink_attention": "reference"})
    cfg = ModelArgs(**model_cfg)
    native = build_model(cfg, vocab, seed=0)
    if engine == "hf":
        from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

        model = DeepseekV4ForCausalLM(DeepseekV4Config(**hf_config(cfg, vocab))).float()
        model.load_state_dict({k: v for k, v in to_hf(native.state_dict(), cfg).items() if not k.startswith("mtp.")})
        del native

        def step_loss(ids):
            return model(input_ids=ids, labels=ids).loss
    else:
        from trainer.data import IGNORE
        from trainer.models.deepseek_v4.training import loss_fn

        model = native

        def step_loss(ids):  # the trainer's step: hidden states -> fused LM head + loss (+ the indexers' loss)
            labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], IGNORE)], 1)
            loss, n, _, _ = loss_fn(model, {"input_ids": ids, "doc_ids": torch.zeros_like(ids), "labels": labels})
            return loss / n
    model.to(device).train()
    if compile_:  # the trainer's own compilation (train.<stage>.compile): native blocks; HF's whole model
        if engine == "hf":
            model.compile()
        else:
            from trainer.models.deepseek_v4.training import apply_compile

            apply_compile(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=adamw_fused(model.parameters()) or None)  # (as trained)
    autocast = torch.autocast(device, dtype=torch.bfloat16) if dtype == "bf16" else contextlib.nullcontext()
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    g = torch.Generator().manual_seed(1)
    times, losses = [], []
    warmup = 3 if compile_ else 1

    def step() -> None:
        ids = torch.randint(0, vocab, (batch, seq), generator=g).to(device)
        sync()
        t0 = time.perf_counter()
        with autocast:
            loss = step_loss(ids)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        if len(losses) >= warmup:  # step 0 warms up (and compiles: also the next, a second shape)
            times.append(time.perf_counter() - t0)
        losses.append(float(loss.detach()))

    for _ in range(steps + warmup):
        step()
    split = None
    if breakdown:  # one more step, profiled (not timed): where its CPU time goes
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step()
        times.pop()
        split = kernel_split(prof.key_averages())
    if profile_dir:  # one more step (not timed) under torch.profiler: the top ops by device (or CPU) self time
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
        with profile(activities=acts, record_shapes=True) as prof:
            step()
        times.pop()
        key = "self_device_time_total" if device == "cuda" else "self_cpu_time_total"
        out = Path(profile_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"profile_{engine}{'_compiled' if compile_ else ''}_{dtype}.txt").write_text(
            prof.key_averages().table(sort_by=key, row_limit=45, max_name_column_width=70) + "\n\n"
            + prof.key_averages(group_by_input_shape=True).table(sort_by=key, row_limit=30,
                                                                  max_name_column_width=50, max_shapes_column_width=90))
    peak = (torch.cuda.max_memory_allocated() / 2 ** 20 if device == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    q.put({"engine": engine, "tokens_per_s": batch * seq / statistics.median(times), "losses": losses,
           "peak_rss_mb": peak, "kernels": sorted(set(registry.choices().values())), "split": split})


GEMM_OPS = {"aten::mm", "aten::bmm", "aten::addmm", "aten::addmm_", "aten::baddbmm", "aten::baddbmm_",
            "aten::_scaled_mm", "aten::_grouped_mm"}


def kernel_split(events) -> dict[str, float]:
    """Self CPU milliseconds of a profiled step in three parts: ``gemm`` (matrix products), ``attention``
    (the fused SDPA kernels and softmax, forward and backward: what an eager attention spends outside its
    GEMMs) and ``other`` (everything else: element-wise chains, copies, indexing, the optimizer, Python)."""
    out = {"gemm": 0.0, "attention": 0.0, "other": 0.0}
    for e in events:
        ms = e.self_cpu_time_total / 1e3
        if e.key in GEMM_OPS:
            out["gemm"] += ms
        elif "scaled_dot_product" in e.key or "flash_attention" in e.key or "softmax" in e.key:
            out["attention"] += ms
        else:
            out["other"] += ms
    out["total"] = sum(out.values())
    return out


def measure(engine: str, *args) -> dict:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_worker, args=(engine, *args, q))
    p.start()
    out = q.get()
    p.join()
    return out


def main(argv: list[str] | None = None) -> dict:
    from trainer.allocator import in_use
    from trainer.metrics import cpu_capability, cpu_peaks_apart, peak_flops, training_flops_per_token
    from trex.core.config import load_config

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/tiny.yaml")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=1024, help="default: the tiny model's full context")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--set", dest="overrides", action="append", default=[], help="config override a.b=c")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"], help="bf16: autocast, fp32 weights")
    ap.add_argument("--engines", default="native,hf", help="comma-separated: native, hf, native-reference, native-sdpa")
    ap.add_argument("--compile", action="store_true", help="torch.compile both sides (native: every block, as "
                    "train.<stage>.compile does; transformers: the whole model); 3 warm-up steps")
    ap.add_argument("--profile", default=None, metavar="DIR", help="profile one more step per run (CPU and CUDA "
                    "activity) and write the top ops by self device time to DIR/profile_<engine>_<dtype>.txt")
    ap.add_argument("--breakdown", action="store_true", help="CPU: profile one more step per run and split its "
                    "time into GEMMs, attention kernels and the rest; bound the native/HF ratio by it")
    a = ap.parse_args(argv)
    if a.breakdown and a.device != "cpu":
        raise SystemExit("--breakdown splits CPU time; on CUDA use torch.profiler's device view")
    cfg = load_config(a.config, a.overrides).model.model_copy(update={"mtp_layers": 0})
    model_cfg = cfg.model_dump(mode="json")  # transformers has no MTP head: compare the trunk
    args = (model_cfg, a.vocab, a.batch, a.seq, a.steps, a.threads, a.device, a.dtype, a.compile, a.breakdown,
            a.profile)
    engines = [e.strip() for e in a.engines.split(",") if e.strip()]

    before = cpu_peaks_apart(a.threads) if a.device == "cpu" else {}
    runs: dict[str, list[dict]] = {e: [] for e in engines}
    for r in range(a.rounds):
        for engine in (engines if r % 2 == 0 else engines[::-1]):
            runs[engine].append(measure(engine, *args))
            print(f"round {r + 1} {engine:16s} {runs[engine][-1]['tokens_per_s']:11.1f} tokens/s "
                  f"(kernels: {','.join(runs[engine][-1]['kernels'])})", flush=True)
    flops = training_flops_per_token(cfg, a.vocab, a.seq)
    if a.device == "cpu":  # the better of the probes before and after the runs (one can hit a slow moment)
        after = cpu_peaks_apart(a.threads)
        peaks = {d: max(before[d], after[d]) for d in after}
    else:
        peaks = {d: peak_flops(a.device) for d in ("fp32", "bf16")}  # the device table's dense bf16 peak
    peak = peaks[a.dtype]
    rows = {}
    for engine, rs in runs.items():
        tps = statistics.median(r["tokens_per_s"] for r in rs)
        rows[engine] = {"tokens_per_s": tps, "peak_rss_mb": statistics.median(r["peak_rss_mb"] for r in rs),
                        "mfu": tps * flops / peak, "mfu_vs_fp32_peak": tps * flops / peaks["fp32"],
                        "mfu_vs_bf16_peak": tps * flops / peaks["bf16"], "first_loss": rs[0]["losses"][0]}
    where = (f"{a.threads} threads, {cpu_capability()}, allocator {in_use()}, "
             f"measured CPU peak fp32 {peaks['fp32'] / 1e9:.1f} / bf16 "
             f"{peaks['bf16'] / 1e9:.1f} GFLOP/s" if a.device == "cpu"
             else f"{a.device}, peak {peak / 1e12:.0f} TFLOP/s (table)")
    print(f"\nmodel {a.config} {' '.join(a.overrides)} (no MTP), batch {a.batch} x {a.seq} tokens, {a.dtype}"
          f"{', compiled' if a.compile else ''}, "
          f"{where}, {a.rounds} alternating rounds, {flops / 1e6:.1f} MFLOP/token")
    print(f"{'engine':16s} {'tokens/s':>11s} {'peak MB':>9s} {'MFU fp32 pk':>12s} {'MFU bf16 pk':>12s} "
          f"{'first loss':>11s}")
    for engine, r in rows.items():
        print(f"{engine:16s} {r['tokens_per_s']:11.1f} {r['peak_rss_mb']:9.0f} {r['mfu_vs_fp32_peak']:12.2%} "
              f"{r['mfu_vs_bf16_peak']:12.2%} {r['first_loss']:11.5f}")
    ratio = None
    if "native" in rows and "hf" in rows:
        ratio = rows["native"]["tokens_per_s"] / rows["hf"]["tokens_per_s"]
        print(f"native / HF throughput: {ratio:.2f}x   memory: "
              f"{rows['native']['peak_rss_mb'] / rows['hf']['peak_rss_mb']:.2f}x")
    if "native" in rows and "native-sdpa" in rows:
        print(f"native (FlexAttention on CUDA) / native-sdpa throughput: "
              f"{rows['native']['tokens_per_s'] / rows['native-sdpa']['tokens_per_s']:.2f}x")
    if "native" in rows and "native-reference" in rows:
        print(f"native (registry kernels) / native-reference throughput: "
              f"{rows['native']['tokens_per_s'] / rows['native-reference']['tokens_per_s']:.2f}x")
    if a.breakdown:
        print(f"\n{'step split (ms)':16s} {'GEMM':>8s} {'attention':>10s} {'other':>8s} {'total':>8s} {'kernels':>8s}")
        for engine, rs in runs.items():
            sp = {k: statistics.median(r["split"][k] for r in rs) for k in ("gemm", "attention", "other", "total")}
            rows[engine]["split_ms"] = sp
            print(f"{engine:16s} {sp['gemm']:8.0f} {sp['attention']:10.0f} {sp['other']:8.0f} {sp['total']:8.0f} "
                  f"{(sp['gemm'] + sp['attention']) / sp['total']:8.0%}")
        if "native" in rows and "hf" in rows:  # native with nothing but its kernels, against HF as it is
            n, h = rows["native"]["split_ms"], rows["hf"]["split_ms"]
            bound = h["total"] / (n["gemm"] + n["attention"])
            rows["native"]["ratio_bound"] = bound
            print(f"native / HF bound if native's 'other' time were zero (its GEMM and attention kernels as they "
                  f"are): {bound:.2f}x")
    result = {"rows": rows, "ratio": ratio, "flops_per_token": flops, "peak_flops": peak, "peaks": peaks,
              "device": a.device, "dtype": a.dtype, "compile": a.compile,
              "cpu_capability": cpu_capability() if a.device == "cpu" else None, "allocator": in_use()}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
