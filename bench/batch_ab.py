"""Less padding per step, side by side in one process: SFT batches grouped by length vs random, CPT rows packed
best-fit vs in order, on a lifecycle's own curated data and tokenizer.

Builds the config's native model (MTP included, AdamW) once and alternates training steps between the two sides
(A B, B A, ...: they share the machine's state, so differences of a few per cent show through the noise). Each
side trims its batches as the trainer does (``trim_padding``, multiple of 32). Prints the median step time, the
real (non-padding) tokens per step and the real tokens per second of each side.

Run after ``make run``: ``python bench/batch_ab.py --stage sft --steps 10`` (``--stage cpt``; ``--state-dir`` for
another lifecycle state, default ``.trex``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _newest(pattern: Path, what: str) -> Path:
    found = sorted(pattern.parent.glob(pattern.name), key=lambda p: p.stat().st_mtime)
    if not found:
        raise SystemExit(f"no {what} under {pattern.parent} (run `make run` first, or pass --state-dir)")
    return found[-1]


def main(argv: list[str] | None = None) -> dict:
    import datasets
    import torch
    import yaml

    from trainer.data import BatchOrder, cpt_documents, pack, row_lengths, trim_padding
    from trainer.export import build_model
    from trainer.models.deepseek_v4.args import ModelArgs
    from trainer.models.deepseek_v4.training import loss_fn
    from trainer.tokenizer import ChatTokenizer

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="configs/tiny.yaml")
    ap.add_argument("--state-dir", default=".trex")
    ap.add_argument("--stage", choices=["sft", "cpt"], default="sft")
    ap.add_argument("--steps", type=int, default=10, help="steps per side, after two warm-up steps each")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)

    torch.set_num_threads(a.threads)
    raw = yaml.safe_load(Path(a.config).read_text())
    out = Path(a.state_dir) / "outputs"
    tok = ChatTokenizer(_newest(out / "tokenizer" / "*", "tokenizer"))
    data_dir = _newest(out / "data" / "*", "curated data")
    train = raw["train"][a.stage]
    seq, bs = train["seq_len"], train["batch_size"]
    rows = datasets.load_from_disk(str(data_dir / a.stage)).to_list()
    if a.stage == "sft":
        data = pack([tok.encode_chat(r["messages"]) for r in rows], seq, tok.pad_id)
        sides = {"random": (data, BatchOrder(len(data), bs, 0)),
                 "grouped": (data, BatchOrder(len(data), bs, 0, row_lengths(data)))}
    else:
        docs = cpt_documents(tok, [r["text"] for r in rows], seq)
        plain, best = pack(docs, seq, tok.pad_id), pack(docs, seq, tok.pad_id, "best_fit")
        sides = {"in_order": (plain, BatchOrder(len(plain), bs, 0)), "best_fit": (best, BatchOrder(len(best), bs, 0))}
    model = build_model(ModelArgs(**raw["model"]), tok.vocab_size, seed=0).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    times: dict[str, list[float]] = {k: [] for k in sides}
    real: dict[str, list[int]] = {k: [] for k in sides}

    def step(name: str, s: int, record: bool) -> None:
        data, order = sides[name]
        batch = trim_padding(data.batch(order(s)))
        t0 = time.perf_counter()
        loss, n, mtp, n_mtp = loss_fn(model, batch)
        (loss / n + (0 if mtp is None else mtp / n_mtp)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if record:
            times[name].append(time.perf_counter() - t0)
            real[name].append(int((batch["doc_ids"] >= 0).sum()))

    names = list(sides)
    for s in range(2):
        for name in names:
            step(name, s, False)
    for s in range(2, 2 + a.steps):
        for name in (names if s % 2 else names[::-1]):
            step(name, s, True)
    result = {}
    for name in names:
        result[name] = {"step_ms": statistics.median(times[name]) * 1e3,
                        "real_tokens_per_step": statistics.mean(real[name]),
                        "real_tokens_per_s": sum(real[name]) / sum(times[name])}
        r = result[name]
        print(f"{a.stage} {name:9s} step {r['step_ms']:6.0f} ms  real tokens/step {r['real_tokens_per_step']:6.0f}  "
              f"real tokens/s {r['real_tokens_per_s']:6.0f}")
    a_, b_ = names
    print(f"{b_}/{a_} real tokens/s: {result[b_]['real_tokens_per_s'] / result[a_]['real_tokens_per_s']:.3f}x")
    return result


if __name__ == "__main__":
    main()
