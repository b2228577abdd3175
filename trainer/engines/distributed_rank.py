"""One rank of the native distributed engine as a ``torchrun`` job (``trainer.torchrun.launch``)::

    python -m torch.distributed.run ... -m trainer.engines.distributed_rank --spec spec.json

Start the process group (backend from the device: gloo / NCCL / HCCL, with ``parallel.timeout_s`` as the
collective timeout), build the same model from the seed (or the ``init_dir`` export), train under the
configured layout with resume from the newest complete checkpoint, print rank 0's metrics as
``TREX_METRICS`` lines, gather the weights and let rank 0 write the HF export, then print ``TREX_RESULT``.
Any exception ends this rank at once with a non-zero status (the others may be blocked in a collective;
torchrun stops them).
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from trainer.data import load_packed
from trainer.engines.distributed import gather_full_state, train_parallel
from trainer.export import build_model, export, load_export
from trainer.parallel.dims import Layout, init_distributed
from trainer.torchrun import JobSpec, emit_metrics, peak_memory_all, read_spec, report, run_rank


def run(spec: JobSpec) -> dict:
    pc, cfg = spec.parallel, spec.train
    device = init_distributed(pc.backend, pc.timeout_s)
    torch.manual_seed(spec.seed)
    model = build_model(spec.model, spec.vocab_size, spec.seed)
    if spec.init_dir:
        model.load_state_dict(load_export(spec.init_dir).state_dict())
    data = load_packed(spec.data)
    layout = Layout.from_config(pc, dist.get_world_size())
    result = train_parallel(model, data, cfg, layout, spec.ckpt_dir, spec.seed, on_log=emit_metrics,
                            stop_after=spec.stop_after, device=device)
    if spec.export_dir and result.steps == cfg.steps:
        full = gather_full_state(result.parts)  # every rank takes part
        if dist.get_rank() == 0:
            fresh = build_model(spec.model, spec.vocab_size, spec.seed)
            fresh.load_state_dict(full)
            export(fresh, spec.tokenizer_dir, spec.export_dir, spec.export_extra)
    return report(result, peak_memory_all(device), layout=layout.dims.describe())


def main(argv: list[str] | None = None) -> int:
    return run_rank(lambda: run(read_spec(argv, "one rank of the native distributed engine (run under torchrun)")))


if __name__ == "__main__":
    sys.exit(main())
