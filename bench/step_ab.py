"""A kernel's reference implementation against its definition, in the whole training step, in one process.

Builds the config's native model once and runs training steps (the trainer's loss: fused LM head + CE, the
indexer loss, MTP; AdamW) whose ops alternate between two sets of implementations: ``new`` (the registry's
reference backends as they are) and ``old`` (the ops named by ``--swap op=module:function``, typically the
``*_formula`` definitions), by ``--traced op=module:function`` (what compiled code traces for the op, its
``register(..., traced=)``) or by ``--patch module:attr=module:function`` (any module-level function of the model
code, e.g. an alternative written for the comparison), by ``--old-backend op=backend`` (the registry's choice for
the op on the old side, e.g. ``hc_pre=reference`` against the preferred ``cpp``); ``--old-adamw foreach`` gives the old side its own foreach
AdamW (the new side steps the one ``trainer.optim`` picks); ``--compile`` compiles the model as training does
(``apply_compile``; two warm-up steps a side). Alternating steps in one process (A B, B A, ...) share the machine's state --
caches, allocator, other jobs -- so differences of a few per cent show through the noise that separate
processes add on a 2-core host (+-10 %). Prints the median step time of each side and the speed ratio.

Run: ``python bench/step_ab.py --config configs/bench_20m.yaml --dtype bf16 --steps 6
--swap hc_mixes=kernels.hc_mixes:hc_mixes_formula --swap hc_expand=kernels.hc_expand:hc_expand_formula``
(``trex bench step-ab ...``); ``--patch trainer.models.deepseek_v4.attention:grouped_out_proj=mymod:einsum_version``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _impl(spec: str):
    op, _, ref = spec.partition("=")
    module, _, name = ref.partition(":")
    if not (op and module and name):
        raise SystemExit(f"--swap {spec!r}: expected op=module:function")
    return op, getattr(importlib.import_module(module), name)


def _target(spec: str):
    """``module:attr=module:function`` -> (module object, attr, the current value, the replacement)."""
    target, _, ref = spec.partition("=")
    module, _, attr = target.partition(":")
    if not (module and attr and ref):
        raise SystemExit(f"--patch {spec!r}: expected module:attr=module:function")
    mod = importlib.import_module(module)
    if not hasattr(mod, attr):
        raise SystemExit(f"--patch {spec!r}: {module} has no attribute {attr!r}")
    rmod, _, rname = ref.partition(":")
    return mod, attr, getattr(mod, attr), getattr(importlib.import_module(rmod), rname)


def main(argv: list[str] | None = None) -> dict:
    import torch
    import yaml

    from kernels import registry
    from trainer.data import IGNORE
    from trainer.export import build_model
    from trainer.models.deepseek_v4.args import ModelArgs
    from trainer.models.deepseek_v4.training import apply_compile, loss_fn
    from trainer.optim import adamw_fused

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="configs/tiny.yaml")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"], help="bf16: autocast, fp32 weights")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--steps", type=int, default=8, help="steps per side, after one warm-up step each")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--docs", type=float, default=1.0, help="documents packed per row, on average (random "
                    "boundaries each step, as packed training batches; 1: one document per row)")
    ap.add_argument("--swap", action="append", default=[], help="op=module:function (repeatable)")
    ap.add_argument("--traced", action="append", default=[], help="op=module:function: what the old side's compiled "
                    "code traces for the op (repeatable; with --compile)")
    ap.add_argument("--patch", action="append", default=[], help="module:attr=module:function (repeatable)")
    ap.add_argument("--old-backend", action="append", default=[], help="op=backend: the old side's kernel backend "
                    "for the op (repeatable; the new side keeps the registry's choice)")
    ap.add_argument("--compile", action="store_true", help="compile the model as training does (apply_compile)")
    ap.add_argument("--old-adamw", choices=["same", "foreach"], default="same",
                    help="foreach: the old side steps its own foreach AdamW (the new side: trainer.optim's choice)")
    a = ap.parse_args(argv)
    if not (a.swap or a.traced or a.patch or a.old_backend or a.old_adamw != "same"):
        ap.error("name at least one --swap, --traced, --patch, --old-backend or --old-adamw")
    old_backends = {}
    for spec in a.old_backend:
        op, _, backend = spec.partition("=")
        if not (op and backend):
            raise SystemExit(f"--old-backend {spec!r}: expected op=backend")
        old_backends[op] = backend
    if a.traced and not a.compile:
        ap.error("--traced changes what compilation traces: add --compile")

    old = dict(_impl(s) for s in a.swap)
    base_overrides = registry.overrides()
    for op, backend in old_backends.items():  # fails early, naming what exists, if the op or backend does not
        with registry.use_backends(**{op: backend}):
            registry.select(op, "cpu")
    patches = [_target(s) for s in a.patch]
    new = {op: registry.get(op, "cpu") for op in old}  # raises KeyError for an unknown op
    old_traced = dict(_impl(s) for s in a.traced)
    new_traced = {op: registry.traced(op, "reference") for op in old_traced}
    raw = yaml.safe_load(Path(a.config).read_text())
    torch.set_num_threads(a.threads)
    vocab = raw["tokenizer"]["vocab_size"]
    model = build_model(ModelArgs(**raw["model"]), vocab, seed=0).train()
    if a.compile:
        apply_compile(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=adamw_fused(model.parameters()) or None)
    old_opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True) if a.old_adamw == "foreach" else opt
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if a.dtype == "bf16" else contextlib.nullcontext()
    g = torch.Generator().manual_seed(1)

    def step(side: str) -> float:
        ids = torch.randint(0, vocab, (a.batch, a.seq), generator=g)
        labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], IGNORE)], 1)
        starts = torch.rand(a.batch, a.seq, generator=g) < (a.docs - 1) / a.seq  # a new document begins here
        starts[:, 0] = False
        docs = starts.long().cumsum(1)
        labels = labels.masked_fill(torch.cat([starts[:, 1:], torch.zeros_like(starts[:, :1])], 1), IGNORE)
        t0 = time.perf_counter()
        with autocast:
            loss, n, _, _ = loss_fn(model, {"input_ids": ids, "doc_ids": docs, "labels": labels})
        (loss / n).backward()
        (old_opt if side == "old" else opt).step()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    def use(impls: dict) -> None:
        for op, fn in impls.items():
            registry.register(op, "reference")(fn)
        for op, fn in (old_traced if impls is old else new_traced).items():
            registry.set_traced(op, "reference", fn)
        for mod, attr, current, replacement in patches:
            setattr(mod, attr, replacement if impls is old else current)
        if old_backends:  # (re-choosing updates what compiled code guards on: each side compiles its own graphs)
            registry.set_overrides({**base_overrides, **old_backends} if impls is old else base_overrides)
            registry.resolve_all("cpu")

    times: dict[str, list[float]] = {"old": [], "new": []}
    try:
        for side in ("old", "new") * (2 if a.compile else 1):  # warm-up (and compilation)
            use(old if side == "old" else new)
            step(side)
        for i in range(a.steps):
            for side in (("old", "new") if i % 2 == 0 else ("new", "old")):
                use(old if side == "old" else new)
                times[side].append(step(side))
    finally:
        use(new)
    med = {k: statistics.median(v) for k, v in times.items()}
    swapped = (sorted(old) + [f"traced {op}" for op in sorted(old_traced)] + [p.partition("=")[0] for p in a.patch]
               + [f"{op}={backend}" for op, backend in old_backends.items()]
               + (["adamw"] if a.old_adamw != "same" else []))
    out = {"config": a.config, "dtype": a.dtype, "compiled": a.compile, "swapped": swapped, "old_ms": med["old"] * 1e3,
           "new_ms": med["new"] * 1e3, "speedup": med["old"] / med["new"], "steps": times}
    print(f"{a.config} {a.dtype} ({', '.join(swapped)}): old {out['old_ms']:.0f} ms, new {out['new_ms']:.0f} ms "
          f"per step (medians of {a.steps}), new/old speed {out['speedup']:.3f}x")
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
