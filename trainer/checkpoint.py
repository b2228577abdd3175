"""Atomic, resumable checkpoints with ``torch.distributed.checkpoint`` (DCP).

Layout::

    ckpt_dir/step_00000050/   DCP shards of {"model", "optim"} + trainer_state.json + rng.pt + COMPLETE
                              (+ source.pt: an RL stage's rollout in progress)
    ckpt_dir/latest           text file naming the newest complete step directory

A step is written into ``step_XXXXXXXX.tmp``, its files fsynced, ``COMPLETE`` written, then the
directory is renamed into place and ``latest`` is replaced atomically. On load, a torn or
incomplete checkpoint (no ``COMPLETE``, missing DCP metadata) is skipped with a warning and the
previous complete one is used. Only the newest ``keep_last`` complete steps are kept.

Asynchronous saves (``async_save``; the parallel engine's :func:`save_parts` too) stage the tensors to CPU
memory, write the shards in a background thread and publish (marker, fsync, rename, ``latest``) only when
:meth:`PendingSave.wait` is called -- by the training loops after the first step at which the write has
finished, or at the next save: a kill before that leaves a ``.tmp`` directory that loading ignores.

A step's files are a function of the training state alone (the stage directory's content hash,
``trex.core.refs``, keys everything downstream): DCP's ``.metadata`` is written without the save's random id and
the path it was written to (:class:`ContentWriter`), ``rng.pt`` holds RNGs seeded from the run's seed
(:func:`seed_rngs`), ``trainer_state.json`` no timings.

Crash tests and ``bench/chaos.py`` kill the process at named points of this protocol with
:func:`kill_point` (``TREX_KILL_AT``); unset, the hook is a dictionary lookup.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import signal
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)

log = logging.getLogger(__name__)
COMPLETE = "COMPLETE"
LATEST = "latest"
SOURCE = "source.pt"  # the training data source's state, when it has one (an RL stage's rollout in progress)
KILL_ENV = "TREX_KILL_AT"
KILL_POINTS = ("step", "save:staged", "save:written", "save:complete", "save:renamed", "async:inflight",
               "export:weights")


def kill_point(name: str, step: int | None = None) -> None:
    """Test hook: ``TREX_KILL_AT=<name>[@<step>]`` SIGKILLs this process when it reaches point ``name`` (at
    save/optimizer step ``step``, if given); ``TREX_KILL_RANK=<r>`` restricts it to the rank whose ``RANK``
    is ``r``. The points (:data:`KILL_POINTS`): ``step`` after an optimizer step, before its checkpoint;
    ``save:staged`` after the trainer state is in ``step_N.tmp``, before the shards; ``save:written`` after
    the shards (an async save: when it is waited for), before ``COMPLETE``; ``save:complete`` after the
    marker and fsync, before the rename; ``save:renamed`` after the rename, before ``latest`` moves;
    ``async:inflight`` just after an async save was started (its shards are being written);
    ``export:weights`` after an export's weights, before its config and rename. A kill, not an exception:
    nothing gets to clean up, as with a lost node or the OOM killer."""
    spec = os.environ.get(KILL_ENV)
    if not spec:
        return
    point, _, at = spec.partition("@")
    if point != name or (at and step is not None and int(at) != step):
        return
    rank = os.environ.get("TREX_KILL_RANK")
    if rank is not None and rank != os.environ.get("RANK", "0"):
        return
    print(f"TREX_KILL_AT: killing pid {os.getpid()} at {name}" + (f"@{step}" if step is not None else ""),
          file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def _step_name(step: int) -> str:
    return f"step_{step:08d}"


def _fsync_tree(root: Path) -> None:
    for p in root.rglob("*"):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    fd = os.open(root, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (its entries) by path."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def seed_rngs(seed: int) -> None:
    """Seed every RNG a checkpoint saves (:func:`rng_state`): torch's (all devices) and Python's. An unseeded
    Python ``random`` made ``rng.pt`` differ between two identical runs."""
    torch.manual_seed(seed)
    random.seed(seed)


def rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "python": random.getstate()}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])


class ContentWriter(FileSystemWriter):
    """DCP's file writer without the :class:`~torch.distributed.checkpoint.metadata.StorageMeta` it pickles into
    ``.metadata``: the absolute path of the ``step_N.tmp`` directory written and a random ``save_id`` (uuid4).
    Neither describes the checkpoint (``FileSystemReader`` substitutes an empty one when loading), and both
    made the bytes of ``.metadata`` -- and so the stage's content hash -- differ between two identical runs."""

    def storage_meta(self) -> None:
        return None


def is_complete(step_dir: Path) -> bool:
    return (step_dir / COMPLETE).is_file() and (step_dir / ".metadata").is_file() and (step_dir / "trainer_state.json").is_file()


class PendingSave:
    """An asynchronous save in flight: DCP writes from a CPU copy while training continues;
    :meth:`wait` finishes it (marker, fsync, rename, ``latest``, retention). In a process group every rank
    calls :meth:`wait` at the same point (it ends with a barrier)."""

    def __init__(self, future, finish, step: int | None = None):
        self._future, self._finish, self.path, self.step = future, finish, None, step

    def done(self) -> bool:
        """The background write has finished (:meth:`wait` would only publish)."""
        return self._future.done()

    def wait(self) -> Path:
        if self.path is None:
            self._future.result()
            kill_point("save:written", self.step)
            self.path = self._finish()
        return self.path


def _stage(root: Path, step: int, trainer_state: dict) -> Path:
    """A fresh ``step_N.tmp`` holding the trainer state and RNG (the DCP shards are written into it next)."""
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / (_step_name(step) + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    state = dict(trainer_state)
    source = state.pop("source", None)  # the data source's own state (an RL rollout's tensors): a file of its own
    (tmp / "trainer_state.json").write_text(json.dumps({**state, "step": step}, indent=2))
    torch.save(rng_state(), tmp / "rng.pt")
    if source is not None:
        torch.save(source, tmp / SOURCE)
    return tmp


def _trainer_state(step_dir: Path) -> dict:
    """The trainer state of a step, with its data source's state (``source``) where the step saved one."""
    state = json.loads((step_dir / "trainer_state.json").read_text())
    if (step_dir / SOURCE).is_file():
        state["source"] = torch.load(step_dir / SOURCE, weights_only=False)
    return state


def _publish(root: Path, tmp: Path, step: int, keep_last: int) -> Path:
    """Mark ``tmp`` complete, fsync it, rename it into place, move ``latest`` atomically, apply retention."""
    final = root / _step_name(step)
    (tmp / COMPLETE).write_text("ok\n")
    _fsync_tree(tmp)
    kill_point("save:complete", step)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    fsync_path(root)
    kill_point("save:renamed", step)
    pointer = root / (LATEST + ".tmp")
    pointer.write_text(final.name + "\n")
    with open(pointer, "rb") as f:
        os.fsync(f.fileno())
    os.replace(pointer, root / LATEST)
    _retain(root, keep_last)
    return final


def _options(model: torch.nn.Module) -> StateDictOptions | None:
    """A model with frozen parameters (LoRA on a frozen base) checkpoints the trained ones and the buffers only:
    the base is the init checkpoint's, loaded again on resume."""
    if all(p.requires_grad for p in model.parameters()):
        return None
    return StateDictOptions(ignore_frozen_params=True, strict=False)


def _frozen_only(model: torch.nn.Module, keys, step_dir: Path) -> None:
    """After a non-strict load: only frozen parameters may have been missing, nothing unexpected."""
    if keys is None or not hasattr(keys, "missing_keys"):
        return
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    missing = [k for k in keys.missing_keys if k not in frozen]
    if missing or keys.unexpected_keys:
        raise RuntimeError(f"{step_dir}: checkpoint does not fit the model: missing {missing[:3]}, unexpected "
                           f"{list(keys.unexpected_keys)[:3]}")


def save(ckpt_dir: str | Path, step: int, model: torch.nn.Module, optimizer, trainer_state: dict,
         keep_last: int = 2, async_save: bool = False) -> Path | PendingSave:
    """Write step ``step`` atomically. ``optimizer`` is one optimizer or a list of them. With
    ``async_save`` the tensors are staged to CPU memory and written in the background: the step only
    becomes visible (and ``latest`` moves) when the returned :class:`PendingSave` is waited for."""
    root = Path(ckpt_dir)
    tmp = _stage(root, step, trainer_state)
    kill_point("save:staged", step)
    msd, osd = get_state_dict(model, optimizer, options=_options(model))

    def finish() -> Path:
        return _publish(root, tmp, step, keep_last)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        if async_save:
            pending = PendingSave(dcp.async_save({"model": msd, "optim": osd}, storage_writer=ContentWriter(tmp)),
                                  finish, step)
            kill_point("async:inflight", step)
            return pending
        dcp.save({"model": msd, "optim": osd}, storage_writer=ContentWriter(tmp))
    kill_point("save:written", step)
    return finish()


def _retain(root: Path, keep_last: int) -> None:
    steps = sorted(p for p in root.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp") and is_complete(p))
    for old in steps[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)


def find_latest(ckpt_dir: str | Path) -> Path | None:
    """Newest complete step directory; a torn ``latest`` target falls back with a warning."""
    root = Path(ckpt_dir)
    if not root.is_dir():
        return None
    candidates = sorted((p for p in root.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp")), reverse=True)
    pointer = root / LATEST
    if pointer.is_file():
        named = root / pointer.read_text().strip()
        if is_complete(named):
            return named
        log.warning("checkpoint %s named by %s is incomplete or missing; falling back", named, pointer)
        warnings.warn(f"torn checkpoint {named}; falling back to the previous complete one", RuntimeWarning)
    for p in candidates:
        if is_complete(p):
            return p
        log.warning("skipping incomplete checkpoint %s", p)
    return None


def load(step_dir: str | Path, model: torch.nn.Module, optimizer) -> dict:
    """Load model (and optimizer(s)) state in place; restore RNG; return the trainer state."""
    step_dir = Path(step_dir)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        if optimizer is None:
            msd = model.state_dict()
            state = {"model": msd}
            dcp.load(state, checkpoint_id=str(step_dir))
            model.load_state_dict(state["model"])
        else:
            opts = _options(model)
            msd, osd = get_state_dict(model, optimizer, options=opts)
            state = {"model": msd, "optim": osd}
            dcp.load(state, checkpoint_id=str(step_dir))
            keys = set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                                  options=opts)
            _frozen_only(model, keys, step_dir)
    set_rng_state(torch.load(step_dir / "rng.pt", weights_only=False))
    return _trainer_state(step_dir)


# ------------------------------------------------------------------------------- parallel (model parts)
def _parts_state(parts: list[torch.nn.Module], optimizers: list | None) -> list[tuple[dict, dict | None]]:
    """Per model part (pipeline stage): its model and optimizer state. Parameter names are the full model's
    and optimizer state is keyed by them too (``flatten_optimizer_state_dict``), so the merged state of all
    parts is layout-free: a checkpoint written under one layout loads under any other (DCP reshards
    DTensors, FSDP and expert shards alike)."""
    opts = StateDictOptions(flatten_optimizer_state_dict=True)
    return [(get_model_state_dict(part, options=opts),
             None if optimizers is None else get_optimizer_state_dict(part, optimizers[i], options=opts))
            for i, part in enumerate(parts)]


def _merged(per_part: list[tuple[dict, dict | None]]) -> dict:
    state: dict = {"model": {}}
    for msd, osd in per_part:
        state["model"].update(msd)
        if osd is not None:
            state.setdefault("optim", {}).update(osd)
    return state


def save_parts(ckpt_dir: str | Path, step: int, parts: list[torch.nn.Module], optimizers: list,
               trainer_state: dict, keep_last: int = 2, async_group=None) -> Path | PendingSave:
    """Collective save of every rank's parts; rank 0 marks it complete and moves ``latest``.

    With ``async_group`` (a gloo process group of all ranks, used by nothing else: the background
    writer's collectives must not interleave with training's on the default group) the shards are staged
    to CPU memory and written by DCP's background thread; every rank then calls the returned
    :meth:`PendingSave.wait` at the same point. DCP writes ``.metadata`` only after every rank's shards
    are written (and fsynced), so once rank 0's write has finished, publishing is as safe as after a
    synchronous save."""
    root = Path(ckpt_dir)
    rank = dist.get_rank() if dist.is_initialized() else 0
    tmp = _stage(root, step, trainer_state) if rank == 0 else root / (_step_name(step) + ".tmp")
    kill_point("save:staged", step)
    if dist.is_initialized():
        dist.barrier()

    def finish() -> Path:
        final = _publish(root, tmp, step, keep_last) if rank == 0 else root / _step_name(step)
        if dist.is_initialized():
            dist.barrier()
        return final

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        state = _merged(_parts_state(parts, optimizers))
        if async_group is not None:
            pending = PendingSave(dcp.async_save(state, storage_writer=ContentWriter(tmp), process_group=async_group),
                                  finish, step)
            kill_point("async:inflight", step)
            return pending
        dcp.save(state, storage_writer=ContentWriter(tmp))
    kill_point("save:written", step)
    return finish()


def load_parts(step_dir: str | Path, parts: list[torch.nn.Module], optimizers: list | None) -> dict:
    """Load a :func:`save_parts` checkpoint into this rank's parts, whatever layout wrote it."""
    step_dir = Path(step_dir)
    per_part = _parts_state(parts, optimizers)
    state = _merged(per_part)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=str(step_dir))
        opts = StateDictOptions(flatten_optimizer_state_dict=True)
        for i, (part, (msd, osd)) in enumerate(zip(parts, per_part)):
            set_model_state_dict(part, {k: state["model"][k] for k in msd}, options=opts)
            if optimizers is not None:
                set_optimizer_state_dict(part, optimizers[i], {k: state["optim"][k] for k in osd}, options=opts)
    return _trainer_state(step_dir)
