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
import sys
from pathlib import Path
from typing import Callable

from trainer.launch import EngineError, MetricsFn, command, launch, metrics_callback, run_rank, train_result  # noqa: F401

def train_stage(model_cfg, vocab_size: int, tcfg, seed: int, data, out_dir: str | Path, tokenizer_dir: str | None,
                init_dir: str | None = None, on_log: MetricsFn | None = None,
                on_step: Callable[[int], None] | None = None, export_extra: dict | None = None,
                on_line: Callable[[str], None] | None = print):
    """The Prefect train task's ``engine: deepspeed`` branch: pack file, launch, export into ``out_dir``.

    Returns a :class:`trainer.loop.TrainResult` (plus ``peak_mem_mb`` per rank in ``.extra``)."""
    from trainer.deepspeed_engine import save_packed

    out = Path(out_dir)
    engine_dir = out / "deepspeed"
    packed = save_packed(data, engine_dir / "packed.pt")
    spec = {"model": model_cfg.model_dump(mode="json"), "vocab_size": vocab_size,
            "train": tcfg.model_dump(mode="json"), "seed": seed, "data": str(packed),
            "ckpt_dir": str(out / "checkpoints"), "export_dir": str(out / "export"),
            "tokenizer_dir": tokenizer_dir, "init_dir": init_dir, "export_extra": export_extra or {}}

    r = launch(spec, engine_dir, tcfg.nproc, on_metrics=metrics_callback(on_log, on_step), on_line=on_line)
    return train_result(r)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="one rank of the DeepSpeed baseline engine (run under torchrun)")
    ap.add_argument("--spec", required=True, help="JSON spec (see trainer.deepspeed_engine.run)")
    a = ap.parse_args(argv)
    from trainer.deepspeed_engine import run

    return run_rank(lambda: run(json.loads(Path(a.spec).read_text())))


if __name__ == "__main__":
    sys.exit(main())
