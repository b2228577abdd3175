"""One rank of the parallel engine's safety test (under torchrun, gloo): three phases in one job.

1. ``skip``: NaN injected on rank 1 only at steps 3 and 4 (of 6) -- every rank must skip both (the
   verdict is global), count them, and leave weights, buffers and optimizer state as they were; the device
   peak is unknown (``TREX_DEVICE_PEAK`` set to a name not in the table), so no ``mfu`` is logged.
2. ``stop``: NaN from step 3 on with ``max_bad_steps=2``: every rank raises FloatingPointError at step 4.
3. ``async``: ``async_checkpoint`` on: a run stopped after step 4 and resumed in a fresh model ends
   bit-identical to a straight run; every published step is complete, no staging directory is left.

Writes ``out/result.json`` (rank 0) with what the test asserts.
"""

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from tests.trainer.helpers import random_docs, tiny_model, tiny_train_cfg  # noqa: E402
from trainer import checkpoint  # noqa: E402
from trainer.data import pack  # noqa: E402
from trainer.engines import distributed as engine  # noqa: E402
from trainer.engines.distributed import gather_full_state, train_parallel  # noqa: E402
from trainer.parallel.dims import Layout, exit_rank, init_distributed  # noqa: E402
from trex.core.config import ParallelConfig  # noqa: E402

NAN_STEPS: set[int] = set()
_accumulate = engine._accumulate
_calls = [0]


def poisoned_accumulate(part, batch, grad_accum):
    """The engine's micro-batch loop; on rank 1, at the chosen steps, the loss and gradients become NaN."""
    _accumulate(part, batch, grad_accum)
    _calls[0] += 1
    if dist.get_rank() == 1 and _calls[0] in NAN_STEPS:
        part.sums["loss"] = part.sums["loss"] * float("nan")
        for p in part.parameters():
            if p.grad is not None:
                p.grad.fill_(float("nan"))


def run(cfg, layout, ckpt, device, stop_after=None, nan_steps=(), logs=None):
    NAN_STEPS.clear()
    NAN_STEPS.update(nan_steps)
    _calls[0] = 0
    model = tiny_model(seed=0)
    data = pack(random_docs(n=48, seed=1), 32, 0)
    return train_parallel(model, data, cfg, layout, ckpt, seed=3, device=device, stop_after=stop_after,
                          on_log=(lambda s, m: logs.append({"step": s, **m})) if logs is not None else None)


def dcp_state(step_dir: Path) -> dict:
    """A published checkpoint read back as plain tensors (rank 0, no process group needed)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dst = step_dir.parent / f"{step_dir.name}.pt"
    dcp_to_torch_save(str(step_dir), str(dst))
    return torch.load(dst, weights_only=False)


def diff(a, b, prefix="") -> list[str]:
    """The keys where two nested states differ (empty: identical)."""
    if isinstance(a, dict):
        if a.keys() != b.keys():
            return [f"{prefix}: keys {sorted(set(a) ^ set(b))}"]
        return [d for k in a for d in diff(a[k], b[k], f"{prefix}/{k}")]
    if isinstance(a, torch.Tensor):
        return [] if torch.equal(a, b) else [prefix]
    return [] if a == b else [prefix]


def same(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return a == b


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.set_num_threads(1)
    engine._accumulate = poisoned_accumulate
    device = init_distributed("gloo", timeout_s=60)
    layout = Layout.from_config(ParallelConfig(), dist.get_world_size())  # DP2 / FSDP2
    out = Path(a.out)
    rank = dist.get_rank()
    base = dict(batch_size=8, log_every=1, warmup_steps=1, adam_eps=1e-6)
    result: dict = {}

    # 1. skip and count; MFU unknown
    os.environ["TREX_DEVICE_PEAK"] = "no-such-accelerator"
    logs: list[dict] = []
    res = run(tiny_train_cfg(steps=6, ckpt_every=2, keep_last=3, max_bad_steps=3, **base), layout,
              out / "skip", device, nan_steps=(3, 4), logs=logs)
    del os.environ["TREX_DEVICE_PEAK"]
    result["skip"] = {"skipped": res.skipped_steps, "mfu": res.mfu,
                      "logged_skipped": [m["skipped_steps"] for m in logs],
                      "mfu_logged": any("mfu" in m for m in logs),
                      "finite": [m["loss"] == m["loss"] for m in logs]}
    dist.barrier()
    if rank == 0:
        s2, s4 = dcp_state(out / "skip" / "step_00000002"), dcp_state(out / "skip" / "step_00000004")
        s6 = dcp_state(out / "skip" / "step_00000006")
        # all but the learning rate, which follows the step (the schedule advances over a skipped step)
        result["skip"]["changed_by_skipped"] = [k for k in diff(s2, s4)
                                                if not (k.startswith("/optim/param_groups.") and k.endswith(".lr"))]
        result["skip"]["changed_after"] = not same(s4["model"], s6["model"])

    # 2. too many in a row
    try:
        run(tiny_train_cfg(steps=6, ckpt_every=2, max_bad_steps=2, **base), layout, out / "stop", device,
            nan_steps=range(3, 7))
        result["stop"] = None
    except FloatingPointError as e:
        result["stop"] = str(e)
    flags = [None] * dist.get_world_size()
    dist.all_gather_object(flags, result["stop"] is not None)
    result["stop_all_ranks"] = all(flags)
    result["stop_latest"] = checkpoint.find_latest(out / "stop").name

    # 3. async checkpoints: resume is bit-identical, nothing torn is left
    cfg = tiny_train_cfg(steps=6, ckpt_every=2, keep_last=2, async_checkpoint=True, **base)
    straight = gather_full_state(run(cfg, layout, out / "a", device).parts)
    first = run(cfg, layout, out / "b", device, stop_after=4)
    resumed = run(cfg, layout, out / "b", device)
    got = gather_full_state(resumed.parts)
    result["async"] = {"first_latest": Path(first.checkpoint).name, "resumed_from": resumed.resumed_from,
                       "bit_identical": same(straight, got),
                       "dirs": sorted(p.name for p in (out / "b").iterdir()),
                       "complete": all(checkpoint.is_complete(p) for p in (out / "b").glob("step_*"))}
    if rank == 0:
        (out / "result.json").write_text(json.dumps(result))
    exit_rank()


if __name__ == "__main__":
    main()
