"""The RL stage's throughput on CPU: rollout (continuous-batching decoding with the sampled tokens' log-probabilities)
and update (the GRPO step of the training core), tokens per second each, as ``trex lifecycle`` runs them.

The config's model (random weights, ``--vocab`` tokens) runs ``--steps`` steps of the RL stage
(``trainer.rollout.RolloutSource`` + ``trainer.rl.GRPOObjective`` in ``trainer.engines.single``) with the config's
``train.rl`` (group size, prompts per rollout, rows per forward, dtype) on random prompts of ``--prompt`` tokens.
Random weights never emit an end token, so every response runs to ``--max-new`` tokens. The reward is a stand-in
(the parity of the response's token ids: half the groups are informative), so the figures are the model's, not the
sandbox's (``trex bench sandbox`` measures that). Prints the median over the steps after the first of: rollout
tokens/s (generated tokens / decoding time), update tokens/s (the step's input tokens / its forward + backward +
optimizer time, the old-log-probability forward included in the rollout's share), and seconds per step by part,
with the host's CPU named beside the figures.

Run: ``python bench/rl_bench.py [--config configs/tiny.yaml] [--steps 4] [--prompt 250] [--max-new 200]`` (or
``trex bench rl ...``).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def host() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main(argv: list[str] | None = None) -> dict:
    import torch

    from trainer.engines import single
    from trainer.export import build_model
    from trainer.rl import GRPOObjective, policy_parameters
    from trainer.rollout import RLPrompt, RolloutSource
    from trex.core.config import load_config

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/tiny.yaml")
    ap.add_argument("--set", action="append", default=[], help="override: section.key=value")
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=4, help="RL steps (one rollout each; the first is warm-up)")
    ap.add_argument("--prompt", type=int, default=250, help="prompt tokens (the tiny default's are ~150-350)")
    ap.add_argument("--max-new", type=int, default=200, help="response tokens (every one runs to the limit)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    cfg = load_config(args.config, [*args.set, f"train.rl.steps={args.steps}", f"train.rl.max_new_tokens={args.max_new}",
                                    "train.rl.ppo_epochs=1", "train.rl.minibatches=1", "train.rl.ckpt_every=100000"])
    rl = cfg.train.rl
    model = build_model(cfg.model.architecture(), args.vocab, seed=0)
    policy_parameters(model)
    g = torch.Generator().manual_seed(0)
    prompts = [RLPrompt(torch.randint(2, args.vocab, (args.prompt,), generator=g).tolist(), {"id": i})
               for i in range(4 * rl.prompts_per_rollout)]

    def parity(rows, texts):
        return [{"reward": float(sum(map(int, t.split(","))) % 2 == 0) if t else 0.0} for t in texts]

    logs: list[dict] = []
    source = RolloutSource(model, prompts, parity, rl, end_ids={0}, pad_id=1, decode=lambda ids: ",".join(map(str, ids)),
                           seed=0)
    with tempfile.TemporaryDirectory() as ckpt:
        single.train(model, None, rl, ckpt, 0, on_log=lambda s, m: logs.append(m), objective=GRPOObjective(rl),
                     source=source)
    steady = logs[1:] or logs
    med = {k: statistics.median(m[k] for m in steady) for k in ("rollout_tokens_per_s", "update_tokens_per_s",
                                                                 "rollout_s", "reward_s")}
    rows = rl.group_size * rl.prompts_per_rollout
    result = {"host": host(), "threads": args.threads, "dtype": rl.dtype, "rows_per_rollout": rows,
              "prompt_tokens": args.prompt, "response_tokens": args.max_new, "steps": args.steps, **med,
              "update_s": rows * (args.prompt + args.max_new) / med["update_tokens_per_s"]}
    if args.json:
        print(json.dumps(result))
    else:
        print(f"host: {result['host']} ({args.threads} threads, {rl.dtype}); {rows} responses of {args.max_new} tokens "
              f"on {args.prompt}-token prompts per rollout, medians of steps 2..{args.steps}")
        print(f"  rollout: {med['rollout_tokens_per_s']:8.0f} generated tokens/s  ({med['rollout_s']:.2f} s a rollout)")
        print(f"  update:  {med['update_tokens_per_s']:8.0f} tokens/s            ({result['update_s']:.2f} s a step)")
        print(f"  reward (stand-in, no sandbox): {med['reward_s']:.3f} s")
    return result


if __name__ == "__main__":
    main()
