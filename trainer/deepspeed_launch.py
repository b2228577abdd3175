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
import collections
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
_EXCEPTION = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt)(: .*)?$")
MetricsFn = Callable[[int, dict], None]


class EngineError(RuntimeError):
    """The multi-process job failed; the message carries the tail of its output."""


def _accelerator_env(env: dict) -> dict:
    """DeepSpeed's accelerator: CUDA / Ascend when present (its own detection), else the CPU one + gloo."""
    if "DS_ACCELERATOR" in env:
        return env
    import importlib.util

    import torch

    if not torch.cuda.is_available() and importlib.util.find_spec("torch_npu") is None:
        env["DS_ACCELERATOR"] = "cpu"
    return env


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the launching process dies (torchrun then stops the ranks)."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def command(spec_path: str | Path, nproc: int, target: list[str] | None = None) -> list[str]:
    target = target or ["-m", "trainer.deepspeed_launch"]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            *target, "--spec", str(spec_path)]


def launch(spec: dict, workdir: str | Path, nproc: int, on_metrics: MetricsFn | None = None,
           on_line: Callable[[str], None] | None = print, target: list[str] | None = None,
           env: dict | None = None) -> dict:
    """Run ``nproc`` ranks of ``target`` (default: this module) on ``spec``; return rank 0's result."""
    from trainer.deepspeed_engine import METRICS_PREFIX, RESULT_PREFIX

    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    spec_path = workdir / "spec.json"
    spec_path.write_text(json.dumps(spec, indent=2))
    run_env = _accelerator_env({**os.environ, **(env or {})})
    run_env["PYTHONUNBUFFERED"] = "1"
    run_env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [run_env.get("PYTHONPATH")])])
    run_env.setdefault("OMP_NUM_THREADS", str(spec.get("threads") or max(1, (os.cpu_count() or 1) // nproc)))
    proc = subprocess.Popen(command(spec_path, nproc, target), cwd=str(ROOT), env=run_env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, bufsize=1, start_new_session=True,
                            preexec_fn=_die_with_parent if sys.platform == "linux" else None)
    tail: collections.deque[str] = collections.deque(maxlen=60)
    errors: list[str] = []  # the ranks' exception lines ("ValueError: ...")
    result = None
    try:
        for line in proc.stdout:
            line = line.rstrip("\n")
            if line.startswith(METRICS_PREFIX):
                m = json.loads(line[len(METRICS_PREFIX):])
                if on_metrics:
                    on_metrics(int(m.pop("step")), m)
                continue
            if line.startswith(RESULT_PREFIX):
                result = json.loads(line[len(RESULT_PREFIX):])
                continue
            tail.append(line)
            if _EXCEPTION.match(line) and "ChildFailedError" not in line and len(errors) < 5:
                errors.append(line)
            if on_line:
                on_line(line)
        rc = proc.wait()
    except BaseException:  # the parent was interrupted: take the whole job down with it
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        proc.wait()
        raise
    if rc != 0 or result is None:
        raise EngineError(f"{' '.join(command(spec_path, nproc, target))} failed (exit {rc})"
                          + "".join(f"\n  {e}" for e in errors) + "\nlast output:\n" + "\n".join(tail))
    return result


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
