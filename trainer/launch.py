"""Run a training engine as a ``torchrun`` job and follow it (the native parallel engine and the DeepSpeed
baseline share this).

:func:`launch` writes the job's spec, runs ``python -m torch.distributed.run ... <target> --spec spec.json``
as a subprocess in its own process group (single node: ``--standalone``; several: ``--nnodes`` and a c10d
rendezvous at ``--rdzv-endpoint``), streams its output line by line, hands rank 0's ``TREX_METRICS {json}``
lines to ``on_metrics`` and returns the ``TREX_RESULT`` dict; a non-zero exit raises :class:`EngineError`
with the ranks' exception lines and the output's tail. If the parent dies, the job is terminated.
"""

from __future__ import annotations

import collections
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Callable

METRICS_PREFIX = "TREX_METRICS "
RESULT_PREFIX = "TREX_RESULT "

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


def command(spec_path: str | Path, nproc: int, target: list[str] | None = None, nnodes: int = 1,
            rdzv_endpoint: str | None = None, node_rank: int | None = None) -> list[str]:
    target = target or ["-m", "trainer.deepspeed_launch"]
    if nnodes == 1:
        where = ["--standalone"]
    else:
        where = [f"--nnodes={nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}"]
        if node_rank is not None:
            where.append(f"--node-rank={node_rank}")
    return [sys.executable, "-m", "torch.distributed.run", *where, f"--nproc-per-node={nproc}",
            *target, "--spec", str(spec_path)]


def launch(spec: dict, workdir: str | Path, nproc: int, on_metrics: MetricsFn | None = None,
           on_line: Callable[[str], None] | None = print, target: list[str] | None = None,
           env: dict | None = None, nnodes: int = 1, rdzv_endpoint: str | None = None) -> dict:
    """Run ``nproc`` ranks per node of ``target`` (default: the DeepSpeed baseline) on ``spec``; return rank
    0's result."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    spec_path = workdir / "spec.json"
    spec_path.write_text(json.dumps(spec, indent=2))
    run_env = _accelerator_env({**os.environ, **(env or {})})
    run_env["PYTHONUNBUFFERED"] = "1"
    run_env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [run_env.get("PYTHONPATH")])])
    run_env.setdefault("OMP_NUM_THREADS", str(spec.get("threads") or max(1, (os.cpu_count() or 1) // nproc)))
    cmd = command(spec_path, nproc, target, nnodes, rdzv_endpoint)
    proc = subprocess.Popen(cmd, cwd=str(ROOT), env=run_env, stdout=subprocess.PIPE,
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
        raise EngineError(f"{' '.join(cmd)} failed (exit {rc})"
                          + "".join(f"\n  {e}" for e in errors) + "\nlast output:\n" + "\n".join(tail))
    return result


# -------------------------------------------------------------------------- the rank side of the protocol
def emit(prefix: str, payload: dict) -> None:
    """One protocol line (``TREX_METRICS`` / ``TREX_RESULT``) on stdout, flushed."""
    print(prefix + json.dumps(payload), flush=True)


def peak_memory_mb(device) -> float:
    """Peak accelerator memory of this rank, or its peak RSS on CPU (Linux: KiB)."""
    import resource

    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2 ** 20
    if device.type == "npu":
        return torch.npu.max_memory_allocated(device) / 2 ** 20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_rank(fn: Callable[[], object]) -> int:
    """A rank's main: on any exception print it and exit at once (the other ranks may be blocked in a
    collective; torchrun stops them), else end the process group cleanly (barrier, then destroy)."""
    try:
        fn()
    except BaseException:
        import traceback

        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    import torch.distributed as dist

    if dist.is_initialized():  # no SIGABRT from gloo at interpreter exit
        dist.barrier()
        dist.destroy_process_group()
    return 0


# ------------------------------------------------------------------------ the parent side, for the tasks
def metrics_callback(on_log: MetricsFn | None, on_step: Callable[[int], None] | None) -> MetricsFn:
    def metrics(step: int, m: dict) -> None:
        if on_log:
            on_log(step, m)
        if on_step:
            on_step(step)
    return metrics


def train_result(r: dict):
    """A :class:`trainer.loop.TrainResult` from a job's ``TREX_RESULT`` (``.extra``: max peak memory, world)."""
    from trainer.loop import TrainResult

    result = TrainResult(steps=r["steps"], resumed_from=r["resumed_from"], final_loss=r["final_loss"],
                         tokens_per_s=r["tokens_per_s"], checkpoint=r["checkpoint"],
                         skipped_steps=r["skipped_steps"], mfu=r["mfu"])
    result.extra = {"peak_mem_mb_max": max(r["peak_mem_mb"]), "world": r["world"]}
    return result
