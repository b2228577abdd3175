"""One rank of the native distributed engine as a ``torchrun`` job (``trainer.torchrun.launch``)::

    python -m torch.distributed.run ... -m trainer.engines.distributed_rank --spec spec.json

Start the process group (backend from the device: gloo / NCCL / HCCL, with ``parallel.timeout_s`` as the
collective timeout), build the same model from the seed -- or, from an ``init_dir`` checkpoint (hub,
transformers or T-Rex format), build it on the meta device and let each rank read only the slices it owns
(``trainer.hub.sharded``) --, train under the configured layout with resume from the newest complete
checkpoint, print rank 0's metrics as ``TREX_METRICS`` lines, then ``TREX_RESULT`` (with the bytes each rank
read from ``init_dir``). With LoRA on a published FP8 checkpoint (``lora.base: auto``: QLoRA) every rank instead
holds the quantised base itself (``trainer.hub.frozen_base``), of the routed experts only its expert-parallel
rank's, and ``TREX_RESULT`` has the bytes each rank holds quantised. Nothing gathers the full weights: the launcher exports offline from the final DCP
checkpoint (``trainer.export.export_checkpoint``), tensor by tensor.
Any exception ends this rank at once with a non-zero status (the others may be blocked in a collective;
torchrun stops them).
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from trainer.checkpoint import seed_rngs
from trainer.data import load_packed
from trainer.engines.distributed import train_parallel
from trainer.export import build_model
from trainer.hub.dcp_source import write_model_card
from trainer.hub.frozen_base import (StageHeld, drop_expert_placeholders, drop_foreign, is_quantised, load_frozen_base,
                                     local_experts)
from trainer.hub.reader import CheckpointReader, check_args
from trainer.lora import apply_lora
from trainer.models.deepseek_v4.model import Transformer
from trainer.models.deepseek_v4.parallelize import stage_ids, stage_layers
from trainer.parallel.dims import Layout, init_distributed
from trainer.qbase import frozen_bytes
from trainer.torchrun import JobSpec, emit_metrics, peak_memory_all, read_spec, report, run_rank


def run(spec: JobSpec) -> dict:
    pc, cfg = spec.parallel, spec.train
    device = init_distributed(pc.backend, pc.timeout_s)
    seed_rngs(spec.seed)
    reader = None
    layout = Layout.from_config(pc, dist.get_world_size())
    quantised = bool(cfg.lora.rank and cfg.lora.base == "auto" and spec.init_dir and is_quantised(spec.init_dir))
    if quantised:  # QLoRA: this rank's copy of the quantised base: its pipeline stages' layers, its ep rank's experts
        dims, rank = layout.dims, dist.get_rank()
        experts = local_experts(spec.model.n_routed_experts, dims.ep, (rank // dims.tp) % dims.ep)
        part = stage_held(spec.model.num_layers, layout, rank // (dist.get_world_size() // dims.pp))
        model = load_frozen_base(spec.init_dir, spec.model, experts=experts, stage=part)
    elif spec.init_dir:
        reader = CheckpointReader(spec.init_dir)
        check_args(reader, spec.model)
        with torch.device("meta"):
            model = Transformer(spec.model, spec.vocab_size)
    else:
        model = build_model(spec.model, spec.vocab_size, spec.seed)
    if cfg.lora.rank:  # the adapters, made whole on every rank from the seed (the meta model's too), then sharded
        apply_lora(model, cfg.lora, spec.seed, device="cpu")
    if quantised:
        drop_expert_placeholders(model)
        drop_foreign(model, part)
    if dist.get_rank() == 0:
        write_model_card(spec.ckpt_dir, spec.model, spec.vocab_size, spec.tokenizer_dir)
    data = load_packed(spec.data)
    result = train_parallel(model, data, cfg, layout, spec.ckpt_dir, spec.seed, on_log=emit_metrics,
                            stop_after=spec.stop_after, device=device, init_reader=reader)
    if reader is not None:
        reader.close()
    read = [0] * dist.get_world_size()
    dist.all_gather_object(read, result.init_bytes)
    held_bytes = [0] * dist.get_world_size()  # the quantised base each rank holds (QLoRA), else 0
    dist.all_gather_object(held_bytes, frozen_bytes(model)["quantised"])
    return report(result, peak_memory_all(device), layout=layout.dims.describe(), init_bytes_read=read,
                  quantised_bytes=held_bytes)


def stage_held(num_layers: int, layout: Layout, pp_rank: int) -> StageHeld:
    """What pipeline rank ``pp_rank`` holds: its stages' layers, and whether it has the first / the last stage."""
    dims = layout.dims
    if dims.pp == 1:
        return StageHeld(frozenset(range(num_layers)), True, True)
    ranges = stage_layers(num_layers, dims.stages, layout.stage_layers)
    ids = stage_ids(dims, pp_rank, layout.schedule)
    return StageHeld(frozenset(i for s in ids for i in ranges[s]), 0 in ids, dims.stages - 1 in ids)


def main(argv: list[str] | None = None) -> int:
    return run_rank(lambda: run(read_spec(argv, "one rank of the native distributed engine (run under torchrun)")))


if __name__ == "__main__":
    sys.exit(main())
