"""Launch the DeepSpeed baseline engine as a multi-process job, and its per-rank entry point.

Entry point (every rank, under torchrun)::

    python -m torch.distributed.run --standalone --nproc-per-node N -m trainer.deepspeed_launch --spec spec.json

Parent side: :func:`launch` writes the spec, runs that command as a subprocess in its own process group,
streams its output line by line, hands rank 0's ``TREX_METRICS {json}`` lines to ``on_metrics`` and
returns the ``TREX_RESULT`` dict; a non-zero exit raises :class:`EngineError` with the output's tail.
:func:`train_stage` is what the Prefect train task calls (``train.engine: deepspeed``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Callable

from trainer.launch import EngineError, MetricsFn, command, launch  # noqa: F401 (re-exported)

def train_stage(model_cfg, vocab_size: int, tcfg, seed: int, data, out_dir: str | Path, tokenizer_dir: str | None,
                init_dir: str | None = None, on_log: MetricsFn | None = None,
                on_step: Callable[[int], None] | None = None, export_extra: dict | None = None,
                on_line: Callable[[str], None] | None = print):
    """The Prefect train task's ``engine: deepspeed`` branch: pack file, launch, export into ``out_dir``.

    Returns a :class:`trainer.loop.TrainResult` (plus ``peak_mem_mb`` per rank in ``.extra``)."""
    from trainer.deepspeed_engine import save_packed
    from trainer.loop import TrainResult

    out = Path(out_dir)
    engine_dir = out / "deepspeed"
    packed = save_packed(data, engine_dir / "packed.pt")
    spec = {"model": model_cfg.model_dump(mode="json"), "vocab_size": vocab_size,
            "train": tcfg.model_dump(mode="json"), "seed": seed, "data": str(packed),
            "ckpt_dir": str(out / "checkpoints"), "export_dir": str(out / "export"),
            "tokenizer_dir": tokenizer_dir, "init_dir": init_dir, "export_extra": export_extra or {}}

    def metrics(step: int, m: dict) -> None:
        if on_log:
            on_log(step, m)
        if on_step:
            on_step(step)

    r = launch(spec, engine_dir, tcfg.nproc, on_metrics=metrics, on_line=on_line)
    result = TrainResult(steps=r["steps"], resumed_from=r["resumed_from"], final_loss=r["final_loss"],
                         tokens_per_s=r["tokens_per_s"], checkpoint=r["checkpoint"],
                         skipped_steps=r["skipped_steps"], mfu=r["mfu"])
    result.extra = {"peak_mem_mb_max": max(r["peak_mem_mb"]), "world": r["world"]}
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="one rank of the DeepSpeed baseline engine (run under torchrun)")
    ap.add_argument("--spec", required=True, help="JSON spec (see trainer.deepspeed_engine.run)")
    a = ap.parse_args(argv)
    import torch.distributed as dist

    from trainer.deepspeed_engine import run

    try:
        run(json.loads(Path(a.spec).read_text()))
    except BaseException:
        # the other ranks may be blocked in a collective: no barrier, exit now and let torchrun stop them
        import traceback

        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    if dist.is_initialized():  # a clean gloo shutdown: no SIGABRT at interpreter exit
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
