"""Batched decoding on CPU (what ``trex evaluate``, ``trex serve`` and the RL stage's rollouts run): the current
decoder against the former one, side by side in one process.

A config's native model (random weights, ``--vocab`` tokens) decodes ``--rows`` prompts of ``--prompt``
tokens (random ids) in one batch. Row ``i`` stops after its own number of new tokens (its ``max_new_tokens``),
spread evenly over ``[--min-new, --max-new]`` (random weights never emit an end token), so rows leave the batch
one after another as they do in an evaluation. Greedy by default (evaluation); ``--temperature 0.7 --logprobs``
samples as the RL rollouts do, keeping every token's log-probability. The two sides, in alternating rounds
(A B, B A, ...):

* ``new``: the code as it is -- a finished row leaves the cache by moving the last row into its slot
  (``DecodeCache.keep`` copies the moved rows only), a decoding step reads the cache and the compressed entries
  apart, and the rows sample together (``generate.sample_tokens``: one uniform draw per row);
* ``former``: the decoder before 2026-12-07 -- every finished row gathered the whole cache into new buffers, each
  step joined the cache and the compressed entries (a copy of the cache per compressed layer), and each row
  sampled and scored its token alone (``torch.multinomial``, a ``log_softmax`` per row).

Prints generated tokens/s per side (median of the rounds), the ratio and, greedy, whether both sides generated
the same tokens (they should, up to a near-tie flipped by rounding).

Run: ``python bench/decode_bench.py [--config configs/tiny.yaml] [--rows 60] [--prompt 160] [--min-new 100]
[--max-new 320] [--temperature 0] [--logprobs] [--rounds 3]`` (or ``trex bench decode ...``).
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

    import trainer.generate as generate
    import trainer.models.deepseek_v4.cpu_attention as cpu_attention
    from trainer.export import build_model
    from trainer.generate import Row, decode_rows
    from trainer.models.deepseek_v4.args import ModelArgs
    from trainer.models.deepseek_v4.packing import DecodeCache

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/tiny.yaml")
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--rows", type=int, default=60, help="prompts decoded in one batch (eval.batch_size)")
    ap.add_argument("--prompt", type=int, default=160, help="prompt tokens per row")
    ap.add_argument("--min-new", type=int, default=100)
    ap.add_argument("--max-new", type=int, default=320)
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy (evaluation); > 0: sampled (rollouts)")
    ap.add_argument("--logprobs", action="store_true", help="keep every token's log-probability (RL rollouts)")
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
        rows = [Row(p, n, args.temperature, 1.0, i, logprobs=[] if args.logprobs else None)
                for i, (p, n) in enumerate(zip(prompts, budgets))]  # each row stops at its own length
        decode_rows(model, rows, end_ids=set(), pad_id=0)
        return [r.tokens for r in rows]

    current = {"keep": DecodeCache.keep, "direct": cpu_attention._direct,
               "advance": generate.DecodeBatch._advance}
    former = {"keep": _former_keep, "direct": lambda q, kv, sinks, mask: current["direct"](
        q, [torch.cat(kv, dim=1)] if len(kv) > 1 else kv, sinks, mask), "advance": _former_advance}

    def use(side: dict) -> None:
        DecodeCache.keep, cpu_attention._direct = side["keep"], side["direct"]
        generate.DecodeBatch._advance = side["advance"]

    sides = {"new": current, "former": former}
    times: dict[str, list[float]] = {k: [] for k in sides}
    tokens: dict[str, list[list[int]]] = {}
    order = list(sides)
    try:
        for r in range(args.rounds + 1):  # round 0 warms up
            for name in (order if r % 2 else order[::-1]):
                use(sides[name])
                t0 = time.perf_counter()
                out = run()
                dt = time.perf_counter() - t0
                if r:
                    times[name].append(dt)
                tokens[name] = out
    finally:
        use(current)
    n_tok = sum(budgets)
    rates = {k: n_tok / statistics.median(v) for k, v in times.items()}
    same = sum(a == b for a, b in zip(tokens["new"], tokens["former"]))
    how = "greedy" if args.temperature <= 0 else f"sampled at T {args.temperature}"
    print(f"decode {args.config}: {args.rows} rows x {args.prompt}-token prompts, {args.min_new}-{args.max_new} new "
          f"tokens each ({n_tok} in all), {how}{', log-probabilities kept' if args.logprobs else ''}, "
          f"{args.threads} threads, median of {args.rounds} alternating rounds")
    for k in sides:
        print(f"  {k:6s} {rates[k]:9.1f} tokens/s   ({', '.join(f'{t:.2f}' for t in times[k])} s)")
    ratio = rates["new"] / rates["former"]
    print(f"  new / former: {ratio:.2f}x" + (f"; identical completions: {same}/{args.rows}" if args.temperature <= 0
                                             else " (sampled: the two sides draw differently)"))
    result = {"tokens_per_s": rates, "ratio": ratio, "identical": same, "rows": args.rows,
              "temperature": args.temperature, "logprobs": args.logprobs}
    print(json.dumps(result))
    return result


def _former_keep(self, rows_b) -> None:
    """The former ``DecodeCache.keep``: the kept rows gathered into new buffers."""
    self.buffers = {k: v[rows_b] for k, v in self.buffers.items()}
    self.batch, self.length = len(rows_b), 0


def _former_advance(self, rows, logits_bv):
    """The former ``DecodeBatch._advance``: each row sampled (``torch.multinomial``) and scored alone."""
    import torch

    tokens = []
    for j, row in enumerate(rows):
        if row.temperature <= 0:
            tok = int(logits_bv[j].argmax())
        else:
            probs = torch.softmax(logits_bv[j:j + 1].float() / row.temperature, dim=-1)
            if row.top_p < 1.0:
                sorted_p, order = probs.sort(dim=-1, descending=True)
                sorted_p[(sorted_p.cumsum(-1) - sorted_p) > row.top_p] = 0.0
                probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
            tok = int(torch.multinomial(probs / probs.sum(-1, keepdim=True), 1, generator=row.generator)[0, 0])
        if row.logprobs is not None:
            scale = row.temperature if row.temperature_logprobs and row.temperature > 0 else 1.0
            row.logprobs.append(float(torch.log_softmax(logits_bv[j].float() / scale, -1)[tok]))
        tokens.append(tok)
    return self._take(rows, tokens)


if __name__ == "__main__":
    main()
