"""Run a training engine as a ``torchrun`` job and follow it: the parent side and the rank side of the protocol
(the native distributed engine and the DeepSpeed baseline share both).

Parent: :func:`launch` writes the job's :class:`JobSpec` (``spec.json``), runs
``python -m torch.distributed.run ... -m <rank entry> --spec spec.json`` as a subprocess in its own process
group (single node: ``--standalone``; several: ``--nnodes`` and a c10d rendezvous at ``--rdzv-endpoint``),
streams its output line by line, hands rank 0's ``TREX_METRICS {json}`` lines to ``on_metrics`` and returns
the ``TREX_RESULT`` dict; a non-zero exit raises :class:`EngineError` with the ranks' exception lines and the
output's tail. If the parent dies, the job is terminated.

Ranks: :func:`run_rank` is a rank's main, :func:`emit_metrics` / :func:`report` print the protocol lines.
The ranks never talk to MLflow: the parent logs what they print.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import importlib.util
import json
import os
import re
import resource
import signal
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Callable, NoReturn

import torch
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict, Field

from trainer.allocator import preload_env
from trainer.core import TrainResult
from trainer.models.deepseek_v4.args import ModelArgs
from trainer.parallel.dims import exit_rank
from trex.core.config import ParallelConfig, StageTrainConfig

METRICS_PREFIX = "TREX_METRICS "
RESULT_PREFIX = "TREX_RESULT "
RANK_ENTRY = {"native": "trainer.engines.distributed_rank", "deepspeed": "trainer.engines.deepspeed_rank"}

ROOT = Path(__file__).resolve().parents[1]
_EXCEPTION = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt)(: .*)?$")
MetricsFn = Callable[[int, dict], None]


class JobSpec(BaseModel):
    """What every rank of a job reads (``spec.json``, written once by :func:`launch`)."""

    model_config = ConfigDict(extra="forbid")

    model: ModelArgs | None = Field(None, description="None: the DeepSpeed engine starts from init_dir alone")
    vocab_size: int | None = None
    train: StageTrainConfig  # train.engine picks the rank entry (RANK_ENTRY)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)  # the native engine's layout
    seed: int = 0
    data: str  # a trainer.data.save_packed file
    ckpt_dir: str
    export_dir: str | None = None  # written by rank 0 when the run reaches its last step
    tokenizer_dir: str | None = None
    init_dir: str | None = None  # an export (or HF directory) to start from
    export_extra: dict = Field(default_factory=dict)  # more keys for the export's config.json
    threads: int | None = None  # torch threads per rank (default: cores / processes)
    stop_after: int | None = None  # end after this step, as a kill would
    device_peak: float | None = None  # DeepSpeed: FLOP/s per rank for MFU (default: measured / known)


class EngineError(RuntimeError):
    """The multi-process job failed; the message carries the tail of its output."""


def _accelerator_env(env: dict) -> dict:
    """DeepSpeed's accelerator: CUDA / Ascend when present (its own detection), else the CPU one + gloo."""
    if "DS_ACCELERATOR" in env:
        return env
    if not torch.cuda.is_available() and importlib.util.find_spec("torch_npu") is None:
        env["DS_ACCELERATOR"] = "cpu"
    return env


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the launching process dies (torchrun then stops the ranks)."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def command(spec_path: str | Path, nproc: int, target: list[str], nnodes: int = 1,
            rdzv_endpoint: str | None = None, node_rank: int | None = None) -> list[str]:
    if nnodes == 1:
        where = ["--standalone"]
    else:
        where = [f"--nnodes={nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}"]
        if node_rank is not None:
            where.append(f"--node-rank={node_rank}")
    return [sys.executable, "-m", "torch.distributed.run", *where, f"--nproc-per-node={nproc}",
            *target, "--spec", str(spec_path)]


def launch(spec: JobSpec, workdir: str | Path, nproc: int, on_metrics: MetricsFn | None = None,
           on_line: Callable[[str], None] | None = print, target: list[str] | None = None,
           env: dict | None = None, nnodes: int = 1, rdzv_endpoint: str | None = None) -> dict:
    """Run ``nproc`` ranks per node of ``target`` (default: the rank entry of ``spec.train.engine``) on
    ``spec``; return rank 0's result."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    spec_path = workdir / "spec.json"
    spec_path.write_text(spec.model_dump_json(indent=2))
    run_env = _accelerator_env({**os.environ, **(env or {})})
    run_env = preload_env(run_env) or run_env  # every rank with the CPU allocator (tcmalloc where there is one)
    run_env["PYTHONUNBUFFERED"] = "1"
    run_env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [run_env.get("PYTHONPATH")])])
    run_env.setdefault("OMP_NUM_THREADS", str(spec.threads or max(1, (os.cpu_count() or 1) // nproc)))
    cmd = command(spec_path, nproc, target or ["-m", RANK_ENTRY[spec.train.engine]], nnodes, rdzv_endpoint)
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


def metrics_callback(on_log: MetricsFn | None, on_step: Callable[[int], None] | None) -> MetricsFn:
    def metrics(step: int, m: dict) -> None:
        if on_log:
            on_log(step, m)
        if on_step:
            on_step(step)
    return metrics


def train_result(r: dict) -> TrainResult:
    """A :class:`TrainResult` from a job's ``TREX_RESULT`` (``.extra``: max peak memory, world, init bytes read and,
    under QLoRA, the quantised base each rank holds)."""
    return TrainResult(steps=r["steps"], resumed_from=r["resumed_from"], final_loss=r["final_loss"],
                       tokens_per_s=r["tokens_per_s"], checkpoint=r["checkpoint"], skipped_steps=r["skipped_steps"],
                       mfu=r["mfu"], finished=r.get("finished", True),
                       decay_triggered_at=r.get("decay_triggered_at"), extra={"peak_mem_mb_max": max(r["peak_mem_mb"]), "world": r["world"],
                                            **_read_stats(r.get("init_bytes_read")),
                                            **{f"quantised_bytes_rank{i}": n
                                               for i, n in enumerate(r.get("quantised_bytes") or []) if n}})


def _read_stats(per_rank: list[int] | None) -> dict[str, int]:
    """The bytes the ranks read from the init checkpoint: each rank's, the most any rank read, and the sum."""
    if not per_rank:
        return {}
    return {**{f"init_bytes_read_rank{r}": n for r, n in enumerate(per_rank)},
            "init_bytes_read_max": max(per_rank), "init_bytes_read_sum": sum(per_rank)}


# -------------------------------------------------------------------------- the rank side of the protocol
def read_spec(argv: list[str] | None, description: str) -> JobSpec:
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--spec", required=True, help="the job's spec.json (trainer.torchrun.JobSpec)")
    return JobSpec.model_validate_json(Path(ap.parse_args(argv).spec).read_text())


def emit(prefix: str, payload: dict) -> None:
    """One protocol line (``TREX_METRICS`` / ``TREX_RESULT``) on stdout, flushed."""
    print(prefix + json.dumps(payload), flush=True)


def emit_metrics(step: int, metrics: dict) -> None:
    """An ``on_log`` for rank 0: the metrics as a ``TREX_METRICS`` line for the parent to log."""
    emit(METRICS_PREFIX, {"step": step, **metrics})


def peak_memory_mb(device) -> float:
    """Peak accelerator memory of this rank, or its peak RSS on CPU (Linux: KiB)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2 ** 20
    if device.type == "npu":
        return torch.npu.max_memory_allocated(device) / 2 ** 20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def peak_memory_all(device) -> list[float]:
    """Every rank's :func:`peak_memory_mb` (a collective)."""
    mem = [None] * dist.get_world_size()
    dist.all_gather_object(mem, peak_memory_mb(device))
    return mem


def report(result: TrainResult, peak_mem_mb: list[float], **extra) -> dict:
    """Rank 0 prints the ``TREX_RESULT`` line: the core result, ``world``, ``peak_mem_mb`` per rank
    (:func:`peak_memory_all`) and ``extra``. Returns the result dict."""
    out = {"steps": result.steps, "resumed_from": result.resumed_from, "final_loss": result.final_loss,
           "tokens_per_s": result.tokens_per_s, "mfu": result.mfu, "checkpoint": result.checkpoint,
           "skipped_steps": result.skipped_steps, "finished": result.finished,
           "decay_triggered_at": result.decay_triggered_at, "world": dist.get_world_size(), "peak_mem_mb": peak_mem_mb,
           **extra}
    if dist.get_rank() == 0:
        emit(RESULT_PREFIX, out)
    return out


def run_rank(fn: Callable[[], object]) -> NoReturn:
    """A rank's main: on any exception print it and exit at once (the other ranks may be blocked in a
    collective; torchrun stops them), else end the process group cleanly (barrier, then destroy) and exit
    without interpreter finalization (:func:`trainer.parallel.dims.exit_rank`: no SIGABRT from gloo there)."""
    try:
        fn()
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    exit_rank(0)
