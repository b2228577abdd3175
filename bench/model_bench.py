"""Native DeepSeek-V4 vs transformers' DeepseekV4ForCausalLM: training throughput side by side.

Same model config (default: the tiny lifecycle model), same initial weights, same random batches. Each
measurement runs in a fresh spawned process (so peak RSS is per engine), engines alternate A/B/A/B, and
the table reports the median tokens/s, peak memory, MFU against the measured CPU peak, and the
native/HF ratio. Run: ``python bench/model_bench.py [--config configs/tiny.yaml] [--rounds 3]``.
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


def _worker(engine: str, model_cfg: dict, vocab: int, batch: int, seq: int, steps: int, threads: int, q) -> None:
    import torch
    import torch.nn.functional as F

    from trainer.export import build_model
    from trainer.models.deepseek_v4.state_dict_adapter import hf_config, to_hf
    from trex.config import ModelConfig

    torch.set_num_threads(threads)
    cfg = ModelConfig(**model_cfg)
    native = build_model(cfg, vocab, seed=0)
    if engine == "hf":
        from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

        model = DeepseekV4ForCausalLM(DeepseekV4Config(**hf_config(cfg, vocab))).float()
        model.load_state_dict({k: v for k, v in to_hf(native.state_dict(), cfg).items() if not k.startswith("mtp.")})
        del native

        def step_loss(ids):
            return model(input_ids=ids, labels=ids).loss
    else:
        model = native

        def step_loss(ids):
            logits = model(ids)
            return F.cross_entropy(logits[:, :-1].reshape(-1, vocab), ids[:, 1:].reshape(-1))
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    times, losses = [], []
    for s in range(steps + 1):
        ids = torch.randint(0, vocab, (batch, seq), generator=g)
        t0 = time.perf_counter()
        loss = step_loss(ids)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if s:  # step 0 warms up
            times.append(time.perf_counter() - t0)
        losses.append(float(loss))
    q.put({"engine": engine, "tokens_per_s": batch * seq / statistics.median(times), "losses": losses,
           "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024})


def measure(engine: str, *args) -> dict:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_worker, args=(engine, *args, q))
    p.start()
    out = q.get()
    p.join()
    return out


def main(argv: list[str] | None = None) -> dict:
    from trainer.metrics import peak_flops, training_flops_per_token
    from trex.config import load_config

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/tiny.yaml")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=1024, help="default: the tiny model's full context")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    cfg = load_config(a.config).model
    model_cfg = {**cfg.model_dump(mode="json"), "mtp_layers": 0}  # transformers has no MTP head: compare the trunk
    args = (model_cfg, a.vocab, a.batch, a.seq, a.steps, a.threads)
    runs: dict[str, list[dict]] = {"native": [], "hf": []}
    for r in range(a.rounds):
        for engine in (("native", "hf") if r % 2 == 0 else ("hf", "native")):
            runs[engine].append(measure(engine, *args))
            print(f"round {r + 1} {engine:6s} {runs[engine][-1]['tokens_per_s']:9.1f} tokens/s", flush=True)
    flops = training_flops_per_token(load_config(a.config).model.model_copy(update={"mtp_layers": 0}), a.vocab, a.seq)
    peak = peak_flops("cpu")
    rows = {}
    for engine, rs in runs.items():
        tps = statistics.median(r["tokens_per_s"] for r in rs)
        rows[engine] = {"tokens_per_s": tps, "peak_rss_mb": statistics.median(r["peak_rss_mb"] for r in rs),
                        "mfu": tps * flops / peak, "first_loss": rs[0]["losses"][0]}
    ratio = rows["native"]["tokens_per_s"] / rows["hf"]["tokens_per_s"]
    print(f"\nmodel {a.config} (no MTP), batch {a.batch} x {a.seq} tokens, {a.threads} threads, "
          f"{a.rounds} alternating rounds, CPU peak {peak / 1e9:.1f} GFLOP/s (measured)")
    print(f"{'engine':8s} {'tokens/s':>10s} {'peak RSS MB':>12s} {'MFU':>8s} {'first loss':>11s}")
    for engine, r in rows.items():
        print(f"{engine:8s} {r['tokens_per_s']:10.1f} {r['peak_rss_mb']:12.0f} {r['mfu']:8.2%} {r['first_loss']:11.5f}")
    print(f"native / HF throughput: {ratio:.2f}x   memory: {rows['native']['peak_rss_mb'] / rows['hf']['peak_rss_mb']:.2f}x")
    result = {"rows": rows, "ratio": ratio, "flops_per_token": flops, "cpu_peak": peak}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
