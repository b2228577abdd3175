"""Layout planner: per-rank memory and pipeline bubble of a layout of the distributed engine on the DeepSeek-V4
model, without hardware (``trex plan``).

Parameters are counted on the meta device per decoder layer and class (``param_classes``), then placed the
way the engine places them (``parallelize.py``):

- routed experts: split over ``ep`` (whole experts) and ``tp`` (their width); not FSDP-sharded when ``ep > 1``
  (each expert shard lives on one rank per expert-parallel group), else sharded over ``dp_shard``;
- tensor-split weights (query heads, grouped output projection, sinks, shared expert, embedding rows):
  ``/ tp``, then FSDP over ``dp_shard``; everything else (norms, mHC, router, compressors, indexers, shared
  K=V head, LM head) replicated over tp, FSDP over ``dp_shard``.

Bytes per parameter on its rank: fp32 master weight 4 + fp32 gradient 4 + optimizer state (AdamW 8; Muon
4 for 2-D matrices) -- plus, under FSDP, the bf16 unsharded copy of the largest block (twice: prefetch).

Activations (bf16, per token per layer; the elements each block keeps for backward): mHC streams and mixes
``4 N D`` (``/ tp`` with sequence parallelism); attention ``2D + r_q + 3 H C / tp + C + G r_o / tp`` (+ compressor ``4 C`` for CSA, ``2C`` HCA, indexer
``n_I c_I``); MoE ``3 D + E + k (2 D + 3 I / tp) + 3 I_s / tp``. Selective recomputation keeps only the MoE input
(``moe``) or the block input ``N D`` (``block``, plus one block's full set while recomputing). A pipeline rank
holds ``min(m, pp)`` micro-batches in flight (1F1B; x ``1 + (pp-1)/(pp vpp)`` interleaved; all ``m`` with GPipe).
Bubble: ``(pp-1)/(vpp m + pp-1)`` (1F1B family), a third of it for the zero-bubble V schedules.

These are estimates for planning (fragmentation, communication buffers and the framework's workspace are
covered by ``reserve_gib``); they decide which layouts are worth trying, not exact peaks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from trainer.models.deepseek_v4 import parallelize as par
from trainer.models.deepseek_v4.model import Transformer
from trainer.parallel.dims import ParallelDims, bubble_fraction

GIB = 2**30
DEVICE_MEMORY_GIB = {"910b": 64, "910c": 64, "a100": 80, "h100": 80, "h200": 141, "cpu": 24}
TP_SPLIT = ("attn.wq_b.weight", "attn.wo_a", "attn.wo_b.weight", "attn.sinks", "ffn.shared.w1.weight",
            "ffn.shared.w2.weight", "ffn.shared.w3.weight")
EXPERTS = ("ffn.w_gate", "ffn.w_up", "ffn.w_down")


def _classify(rel: str) -> str:
    if rel.endswith(EXPERTS):
        return "expert"
    return "tp" if rel.endswith(TP_SPLIT) else "rep"


def param_classes(mcfg, vocab_size: int) -> dict:
    """Parameter counts: per decoder layer and for the MTP blocks {expert, tp, rep}; embed, lm_head, head."""
    with torch.device("meta"):
        model = Transformer(mcfg, vocab_size)
    layers = [{"expert": 0, "tp": 0, "rep": 0, "matrix": 0} for _ in range(mcfg.num_layers)]
    mtp = {"expert": 0, "tp": 0, "rep": 0, "matrix": 0}
    out = {"layers": layers, "mtp": mtp, "embed": 0, "lm_head": 0, "head": 0}
    for name, p in model.named_parameters():
        n = p.numel()
        parts = name.split(".")
        if parts[0] == "layers":
            bucket, rel = layers[int(parts[1])], ".".join(parts[2:])
        elif parts[0] == "mtp":
            bucket, rel = mtp, ".".join(parts[2:]).removeprefix("block.")
        else:
            key = {"embed": "embed", "lm_head": "lm_head"}.get(parts[0], "head")
            out[key] += n
            continue
        cls = _classify(rel)
        bucket[cls] += n
        if p.dim() in (2, 3) and not rel.endswith(("norm.weight", ".fn", ".ape")):
            bucket["matrix"] += n  # Muon's (one momentum buffer); experts included
    return out


@dataclass
class RankMemory:
    stage: int
    layers: int
    params: float            # parameters held (after TP/EP/FSDP)
    weights_gib: float
    grads_gib: float
    optimizer_gib: float
    fsdp_buffers_gib: float
    activations_gib: float
    total_gib: float = 0.0
    recompute_gib: float = 0.0


@dataclass
class Plan:
    layout: str
    dims: ParallelDims
    world: int
    device: str
    capacity_gib: float
    microbatches: int
    micro_batch_rows: int
    seq_len: int
    bubble: float
    worst: RankMemory
    feasible: bool
    reasons: list[str] = field(default_factory=list)


def _activation_elems_per_token(mcfg, kinds: tuple[str, str], tp: int, recompute: str, sp: bool = False) -> float:
    n, d, h, c = mcfg.hc_mult, mcfg.hidden_size, mcfg.num_heads, mcfg.head_dim
    attn_kind, _ = kinds
    seq_share = 1 / tp if sp else 1.0  # sequence parallel: the token-wise part holds T / tp tokens
    hc = 4 * n * d * seq_share
    attn = 2 * d + mcfg.q_lora_rank + 3 * h * c / tp + c + mcfg.o_groups * mcfg.o_lora_rank / tp
    if attn_kind == "compressed_sparse_attention":
        attn += 4 * c + mcfg.index_n_heads * mcfg.index_head_dim
    elif attn_kind == "heavily_compressed_attention":
        attn += 2 * c
    k, i = mcfg.num_experts_per_tok, mcfg.moe_intermediate_size
    moe = 3 * d + mcfg.n_routed_experts + k * (2 * d + 3 * i / tp) + 3 * i * mcfg.n_shared_experts / tp
    if recompute == "block":
        return n * d * seq_share
    if recompute == "moe":
        return hc + attn + d
    return hc + attn + moe


def _full_block_elems(mcfg, kinds, tp) -> float:
    return _activation_elems_per_token(mcfg, kinds, tp, "none")


def plan_layout(mcfg, vocab_size: int, dims: ParallelDims, seq_len: int, batch_size: int, device: str,
                schedule: str = "1f1b", microbatches: int = 0, stage_layers: list[int] | None = None,
                optimizer: str = "adamw", recompute: str = "none", reserve_gib: float = 4.0,
                capacity_gib: float | None = None, sequence_parallel: bool = False) -> Plan:
    counts = param_classes(mcfg, vocab_size)
    m = microbatches or max(1, batch_size // dims.dp)  # default: one row per micro-batch
    reasons: list[str] = []
    if batch_size % dims.dp or (batch_size // dims.dp) % m:
        reasons.append(f"global batch {batch_size} does not split into dp={dims.dp} x {m} micro-batches")
    rows = max(1, batch_size // dims.dp // m)
    try:
        dims.check_model(mcfg, batch_size if not reasons else dims.dp * m, m)
    except ValueError as e:
        reasons.append(str(e))
    ranges = par.stage_layers(mcfg.num_layers, dims.stages, stage_layers)
    opt_dense = 4 if optimizer == "muon" else 8
    in_flight = {"gpipe": m}.get(schedule, min(m, dims.pp))
    if schedule == "interleaved_1f1b":
        in_flight *= 1 + (dims.pp - 1) / (dims.pp * dims.vpp)
    capacity = capacity_gib or DEVICE_MEMORY_GIB[device]
    per_rank: dict[int, RankMemory] = {}
    for s, r in enumerate(ranges):
        rank = s % dims.pp if schedule not in ("zbv", "dualpipev") else min(s, 2 * dims.pp - 1 - s)
        blocks = [counts["layers"][i] for i in r]
        if s == dims.stages - 1:
            blocks = blocks + [counts["mtp"]] * mcfg.mtp_layers
        dense = sum(b["tp"] / dims.tp + b["rep"] for b in blocks)
        expert = sum(b["expert"] for b in blocks) / dims.ep / dims.tp
        matrix = sum(b["matrix"] for b in blocks) - expert * dims.ep * dims.tp  # non-expert matrices
        if s == 0:
            dense += counts["embed"] / dims.tp
        if s == dims.stages - 1:
            dense += counts["lm_head"] + counts["head"]
        dense_local = dense / dims.dp_shard
        expert_local = expert if dims.ep > 1 else expert / dims.dp_shard
        params = dense_local + expert_local
        # Muon: one fp32 momentum per matrix element (experts included); AdamW: two fp32 moments
        opt = (matrix / dims.dp_shard + expert_local) * opt_dense + (dense_local - matrix / dims.dp_shard) * 8
        biggest = max((b["tp"] / dims.tp + b["rep"] + (b["expert"] / dims.ep / dims.tp if dims.ep == 1 else 0)
                       for b in blocks), default=0)
        fsdp = 2 * 2 * biggest if dims.dp_shard > 1 else 0
        kinds = [(mcfg.attention_types[i], mcfg.moe_types[i]) for i in r]
        tokens = rows * seq_len
        sp = sequence_parallel and dims.tp > 1
        act = sum(_activation_elems_per_token(mcfg, k, dims.tp, recompute, sp) for k in kinds) * tokens * in_flight
        mem = RankMemory(stage=s, layers=len(r), params=params, weights_gib=params * 4 / GIB,
                         grads_gib=params * 4 / GIB, optimizer_gib=opt / GIB, fsdp_buffers_gib=fsdp / GIB,
                         activations_gib=act * 2 / GIB)
        mem.total_gib = mem.weights_gib + mem.grads_gib + mem.optimizer_gib + mem.fsdp_buffers_gib + \
            mem.activations_gib + reserve_gib
        mem.recompute_gib = (max(_full_block_elems(mcfg, k, dims.tp) for k in kinds) * tokens * 2 / GIB
                             if recompute != "none" and kinds else 0.0)  # one block re-run at a time per rank
        prev = per_rank.get(rank)
        if prev is not None:  # several stages on one rank: they add up
            for f in ("params", "weights_gib", "grads_gib", "optimizer_gib", "fsdp_buffers_gib", "activations_gib"):
                setattr(prev, f, getattr(prev, f) + getattr(mem, f))
            prev.total_gib += mem.total_gib - reserve_gib
            prev.layers += mem.layers
            prev.recompute_gib = max(prev.recompute_gib, mem.recompute_gib)
        else:
            per_rank[rank] = mem
    for mem in per_rank.values():
        mem.activations_gib += mem.recompute_gib
        mem.total_gib += mem.recompute_gib
    worst = max(per_rank.values(), key=lambda x: x.total_gib)
    if worst.total_gib > capacity:
        parts = {"weights+grads": worst.weights_gib + worst.grads_gib, "optimizer": worst.optimizer_gib,
                 "activations": worst.activations_gib}
        top = max(parts, key=parts.get)
        hint = {"weights+grads": "raise ep (experts) or pp, or shard more (dp_shard)",
                "optimizer": "raise ep/pp/dp_shard, or use Muon (one state) instead of AdamW (two)",
                "activations": "recompute (train.activation_checkpointing: block), fewer rows per micro-batch, "
                               "more micro-batches, or a shorter seq_len"}[top]
        reasons.append(f"pipeline rank of stage {worst.stage} needs {worst.total_gib:.1f} GiB > {capacity} GiB "
                       f"({top} {parts[top]:.1f} GiB is the largest part): {hint}")
    return Plan(layout=dims.describe(), dims=dims, world=dims.world_size, device=device, capacity_gib=capacity,
                microbatches=m, micro_batch_rows=rows, seq_len=seq_len,
                bubble=bubble_fraction(dims.pp, m, dims.vpp, schedule), worst=worst,
                feasible=not reasons, reasons=reasons)


# ------------------------------------------------------------------------------------------------ LoRA / QLoRA
BASE_BYTES = {"fp4": 0.5 + 1 / 32, "fp8": 1 + 1 / (128 * 128), "bf16": 2.0, "fp32": 4.0}
FP8_LINEARS = ("attn.wq_a.weight", "attn.wq_b.weight", "attn.wkv.weight", "attn.wo_b.weight",
               "attn.indexer.wq_b.weight", "ffn.shared.w1.weight", "ffn.shared.w2.weight", "ffn.shared.w3.weight")


def base_storage(rel: str, quantised: bool) -> str:
    """How ``trainer.hub.frozen_base`` keeps a frozen parameter: MXFP4 experts, FP8 linears, bf16 ``wo_a``, the
    rest float32 (``quantised=False``: a float32 base; bf16 where ``lora.base: bf16`` would copy)."""
    if not quantised:
        return "fp32"
    if rel.endswith(EXPERTS):
        return "fp4"
    if rel.endswith(FP8_LINEARS):
        return "fp8"
    return "bf16" if rel.endswith("attn.wo_a") else "fp32"


@dataclass
class LoRAPlan:
    world: int
    ep: int
    device: str
    capacity_gib: float
    rank: int
    micro_batch_rows: int
    seq_len: int
    base_experts_gib: float
    base_dense_gib: float
    adapter_params: float       # on the device
    adapter_gib: float          # fp32 weights + gradients + AdamW's two moments
    activations_gib: float
    dequant_gib: float          # the largest projection dequantised at once (one layer's local experts)
    reserve_gib: float
    total_gib: float
    quantised_file_gib: float   # the whole checkpoint's frozen base at its stored size
    feasible: bool
    reasons: list[str] = field(default_factory=list)


def plan_lora(mcfg, vocab_size: int, world: int, seq_len: int, rank: int, targets: list[str], device: str,
              recompute: str = "block", quantised: bool = True, rows: int = 1, reserve_gib: float = 4.0,
              capacity_gib: float | None = None) -> LoRAPlan:
    """Per-device memory of LoRA / QLoRA on ``world`` devices of one node: the routed experts (frozen base and
    their adapters) split over ``ep = world`` (whole experts), everything else replicated; micro-batches of
    ``rows`` rows (gradient accumulation for the rest of the batch); activations as ``plan_layout`` counts them
    (tp = 1, ``recompute``), plus one recomputed block and one dequantised projection at a time."""
    from trex.core.config import LORA_TARGETS

    reasons = []
    ep = world
    if mcfg.n_routed_experts % ep:
        reasons.append(f"{mcfg.n_routed_experts} routed experts do not split over ep={ep}")
    unknown = sorted(set(targets) - set(LORA_TARGETS))
    if unknown:
        reasons.append(f"unknown LoRA targets {unknown}")
    with torch.device("meta"):
        model = Transformer(mcfg, vocab_size)
    experts = dense = 0.0
    for name, p in model.named_parameters():
        parts = name.split(".")
        rel = ".".join(parts[2:]).removeprefix("block.") if parts[0] in ("layers", "mtp") else name
        nbytes = p.numel() * BASE_BYTES[base_storage(rel, quantised)]
        if rel.endswith(EXPERTS):
            experts += nbytes
        else:
            dense += nbytes
    from trainer.lora import DENSE, submodule_or_none

    adapter_dense = adapter_expert = 0
    for block in model.layers:
        for t in targets:
            if t in DENSE:
                m = submodule_or_none(block, DENSE[t][0])
                if m is not None:
                    adapter_dense += rank * (m.in_features + m.out_features)
            elif t.startswith("ffn.experts."):
                adapter_expert += mcfg.n_routed_experts * rank * (mcfg.hidden_size + mcfg.moe_intermediate_size)
    adapter_local = adapter_dense + adapter_expert / ep
    tokens = rows * seq_len
    kinds = list(zip(mcfg.attention_types, mcfg.moe_types))
    act = sum(_activation_elems_per_token(mcfg, k, 1, recompute) for k in kinds) * tokens * 2
    if recompute != "none":
        act += max(_full_block_elems(mcfg, k, 1) for k in kinds) * tokens * 2
    dequant = (mcfg.n_routed_experts // ep) * mcfg.hidden_size * mcfg.moe_intermediate_size * 2 if quantised else 0
    capacity = capacity_gib or DEVICE_MEMORY_GIB[device]
    plan = LoRAPlan(world=world, ep=ep, device=device, capacity_gib=capacity, rank=rank, micro_batch_rows=rows,
                    seq_len=seq_len, base_experts_gib=experts / ep / GIB, base_dense_gib=dense / GIB,
                    adapter_params=adapter_local, adapter_gib=adapter_local * 16 / GIB, activations_gib=act / GIB,
                    dequant_gib=dequant / GIB, reserve_gib=reserve_gib, total_gib=0.0,
                    quantised_file_gib=(experts + dense) / GIB, feasible=True, reasons=reasons)
    plan.total_gib = (plan.base_experts_gib + plan.base_dense_gib + plan.adapter_gib + plan.activations_gib
                      + plan.dequant_gib + reserve_gib)
    if plan.total_gib > capacity:
        reasons.append(f"{plan.total_gib:.1f} GiB per device > {capacity:g} GiB: more devices (ep), recompute, "
                       f"or a shorter seq_len")
    plan.feasible = not reasons
    return plan

