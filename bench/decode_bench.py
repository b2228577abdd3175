"""Batched greedy decoding on CPU (what ``trex evaluate`` and ``trex serve`` run): the current decode path
against the former one, side by side in one process.

A config's native model (random weights, ``--vocab`` tokens) decodes ``--rows`` prompts of ``--prompt``
tokens (random ids) in one batch. Row ``i`` stops after its own number of new tokens (its ``max_new_tokens``),
spread evenly over ``[--min-new, --max-new]`` (random weights never emit an end token), so rows leave the batch
one after another as they do in an evaluation. The two sides, in alternating rounds (A B, B A, ...):

* ``new``: the code as it is -- the attention of a decoding step (one query per row) by two batched matrix
  products (``cpu_attention.CPU_DIRECT_QUERIES``);
* ``old``: the flash kernel over the visible columns selected from the cache (``CPU_DIRECT_QUERIES = 0``), as
  for training.

Prints generated tokens/s per side (median of the rounds), the ratio, and whether both sides generated the same
tokens (greedy: they should, up to a near-tie flipped by rounding).

Run: ``python bench/decode_bench.py [--config configs/tiny.yaml] [--rows 60] [--prompt 160] [--min-new 100]
[--max-new 320] [--rounds 3]`` (or ``trex bench decode ...``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv: list[str] | None = None) -> dict:
    import torch
    import yaml

    import trainer.models.deepseek_v4.cpu_attention as cpu_attention
    from trainer.export import build_model
    from trainer.generate import Row, decode_rows
    from trainer.models.deepseek_v4.args import ModelArgs

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/tiny.yaml")
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--rows", type=int, default=60, help="prompts decoded in one batch (eval.batch_size)")
    ap.add_argument("--prompt", type=int, default=160, help="prompt tokens per row")
    ap.add_argument("--min-new", type=int, default=100)
    ap.add_argument("--max-new", type=int, default=320)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    cfg = ModelArgs(**yaml.safe_load(Path(args.config).read_text())["model"])
    if args.prompt + args.max_new > cfg.max_seq_len:
        raise SystemExit(f"--prompt + --max-new = {args.prompt + args.max_new} exceeds the model's max_seq_len "
                         f"{cfg.max_seq_len}")
    model = build_model(cfg, args.vocab, seed=0).eval()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, args.vocab, (args.prompt,), generator=g).tolist() for _ in range(args.rows)]
    span = args.max_new - args.min_new
    budgets = [args.min_new + (span * i) // max(1, args.rows - 1) for i in range(args.rows)]

    def run() -> list[list[int]]:
        rows = [Row(p, n) for p, n in zip(prompts, budgets)]  # each row stops at its own length
        decode_rows(model, rows, end_ids=set(), pad_id=0)
        return [r.tokens for r in rows]

    sides = {"new": cpu_attention.CPU_DIRECT_QUERIES, "old": 0}
    times: dict[str, list[float]] = {k: [] for k in sides}
    tokens: dict[str, list[list[int]]] = {}
    order = list(sides)
    try:
        for r in range(args.rounds + 1):  # round 0 warms up
            for name in (order if r % 2 else order[::-1]):
                cpu_attention.CPU_DIRECT_QUERIES = sides[name]
                t0 = time.perf_counter()
                out = run()
                dt = time.perf_counter() - t0
                if r:
                    times[name].append(dt)
                tokens[name] = out
    finally:
        cpu_attention.CPU_DIRECT_QUERIES = sides["new"]
    n_tok = sum(budgets)
    rates = {k: n_tok / statistics.median(v) for k, v in times.items()}
    same = sum(a == b for a, b in zip(tokens["new"], tokens["old"]))
    print(f"decode {args.config}: {args.rows} rows x {args.prompt}-token prompts, {args.min_new}-{args.max_new} new "
          f"tokens each ({n_tok} in all), {args.threads} threads, median of {args.rounds} alternating rounds")
    for k in sides:
        print(f"  {k:4s} {rates[k]:9.1f} tokens/s   ({', '.join(f'{t:.2f}' for t in times[k])} s)")
    print(f"  new / old: {rates['new'] / rates['old']:.2f}x; identical completions: {same}/{args.rows}")
    result = {"tokens_per_s": rates, "ratio": rates["new"] / rates["old"], "identical": same, "rows": args.rows}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
