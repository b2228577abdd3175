"""Apply a layout to the single-device DeepSeek-V4 model: TP plans, expert parallelism, FSDP2, pipeline stages.

Everything here changes a :class:`Transformer` *in place*, keeping every parameter name, so checkpoints
(DCP) written under one layout load under another. Order: ``prune_to_stage`` (a copy per stage) ->
``apply_tp`` -> ``apply_experts`` -> ``apply_sequence_parallel`` -> ``apply_fsdp``.

TP plan (``parallel.tp``), per block (main layers and MTP):

=================================  ==================  ==========================================
module / parameter                 placement           why
=================================  ==================  ==========================================
``attn.wq_b``                      column (heads)      each rank owns ``H / tp`` query heads
``attn.sinks``                     Shard(0)            one sink logit per head
``attn.wo_a`` ``[G, H*C/G, r]``    Shard(0) (groups)   the grouped output projection follows heads
``attn.wo_b``                      row                 sums the groups' partial outputs
shared K=V head, compressors,      replicated          one head read by all heads: its gradient is
indexer, norms, mHC, router                            all-reduced (``Attention.shared_kv`` seam)
``ffn.shared.w1/w3`` / ``w2``      column / row        expert width split
``ffn.w_gate/w_up`` / ``w_down``   Shard(2) / Shard(1) routed experts' width split (+ EP Shard(0))
``embed``                          Shard(0) (vocab)    vocabulary-parallel lookup
``lm_head``                        Shard(0) (vocab)    vocabulary-parallel loss (``vocab_parallel.py``)
=================================  ==================  ==========================================
"""

from __future__ import annotations

import copy
import functools

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Replicate, Shard

from trainer.models.deepseek_v4.model import MoE, Transformer
from trainer.parallel.dims import LayoutError, ParallelDims
from trainer.parallel.expert_parallel import TokenDispatcher
from trainer.parallel.tensor_parallel import (
    copy_to_tp,
    gather_seq,
    parallelize_embedding,
    parallelize_linear,
    reduce_from_tp,
    shard_param,
)


def blocks(model: Transformer) -> list[nn.Module]:
    """The decoder blocks a (possibly pruned) model holds, main layers then MTP blocks."""
    layers = model.layers.values() if isinstance(model.layers, nn.ModuleDict) else model.layers
    return list(layers) + [m.block for m in (model.mtp or [])]


def moe_modules(model: nn.Module) -> list[tuple[str, MoE]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, MoE)]


# ------------------------------------------------------------------------------------------------- TP
def _mean_over_heads(p_bhtw: torch.Tensor, group, n_heads: int) -> torch.Tensor:
    return reduce_from_tp(p_bhtw.sum(1), group) / n_heads


def apply_tp(model: Transformer, tp_mesh: DeviceMesh) -> None:
    tp, group = tp_mesh.size(), tp_mesh.get_group()
    tied = model.cfg.tie_embeddings
    if model.embed is not None:
        parallelize_embedding(model.embed, tp_mesh)
    if model.lm_head is not None:  # vocabulary-parallel head: the loss is ``vocab_parallel_cross_entropy``
        if tied and model.embed is not None:
            model.lm_head.weight = model.embed.weight
        else:
            shard_param(model.lm_head, "weight", tp_mesh, [Shard(0)])
        n = model.lm_head.weight.shape[0]
        model.lm_head.tp_group = group
        model.lm_head.vocab_start = min(n, tp_mesh.get_local_rank() * -(-n // tp))
    for block in blocks(model):
        attn = block.attn
        _tp_linear(attn.wq_b, "colwise", tp_mesh)
        _tp_linear(attn.wo_b, "rowwise", tp_mesh)
        shard_param(attn, "wo_a", tp_mesh, [Shard(0)])
        shard_param(attn, "sinks", tp_mesh, [Shard(0)])
        n_heads = attn.h
        attn.h, attn.groups = attn.h // tp, attn.groups // tp
        attn.shared_kv = functools.partial(copy_to_tp, group=group)
        attn.mean_over_heads = functools.partial(_mean_over_heads, group=group, n_heads=n_heads)
        shared = block.ffn.shared
        if shared is not None:
            _tp_linear(shared.w1, "colwise", tp_mesh)
            _tp_linear(shared.w3, "colwise", tp_mesh)
            _tp_linear(shared.w2, "rowwise", tp_mesh)


def _tp_linear(lin: nn.Linear, style: str, tp_mesh: DeviceMesh) -> None:
    """A column- or row-parallel linear; its LoRA adapter (``trainer.lora.DenseLoRA``) split to match: a
    column-parallel one's ``b`` by rows, the rank-r product's gradient summed over tp; a row-parallel one's ``a``
    by columns, the rank-r product reduced before ``b``."""
    parallelize_linear(lin, style, tp_mesh)
    lora = getattr(lin, "lora", None)
    if lora is None:
        return
    group = tp_mesh.get_group()
    if style == "colwise":
        shard_param(lora, "b", tp_mesh, [Shard(0)])
        lora.tp_z = functools.partial(copy_to_tp, group=group)
    else:
        shard_param(lora, "a", tp_mesh, [Shard(1)])
        lora.tp_z = functools.partial(reduce_from_tp, group=group)


SP_PARAMS = (".attn_hc.", ".ffn_hc.", ".attn_norm.", ".ffn_norm.")


def _attention_region(fn, group):
    """Attention on the whole sequence gathered from the slices; ``wo_b`` reduce-scatters back into them."""
    return lambda x, *a, **k: fn(gather_seq(x, group), *a, **k)


def _moe_region(fn, group, dispatcher):
    """The MoE on the whole sequence; the dispatcher reduce-scatters routed + shared partial sums into slices."""
    def run(x, *a, **k):
        full = gather_seq(x, group)
        dispatcher.token_shape = tuple(full.shape[:2])
        return fn(full, *a, **k)
    return run


def apply_sequence_parallel(model: Transformer, tp_mesh: DeviceMesh) -> None:
    """Sequence parallelism (after ``apply_tp``): between the TP regions -- the mHC streams, their mixing and
    the norms, token-wise work on ``hc_mult x D`` per token, V4's largest activation -- each tp rank keeps
    ``T / tp`` tokens. Attention and MoE gather the sequence on entry and keep their slice on exit; the stage
    forward slices after the embedding and gathers before the head. The norm and mHC weights then see only
    their slice's tokens: the engine sums their gradients over tp (``sequence_parallel_params``).
    MTP blocks run on the whole sequence."""
    group = tp_mesh.get_group()
    layers = model.layers.values() if isinstance(model.layers, nn.ModuleDict) else model.layers
    for block in layers:
        block.attn.wo_b.reduce = "seq"  # leave attention through a reduce-scatter (not all-reduce + slice)
        block.attn.forward = _attention_region(block.attn.forward, group)
        dispatcher = block.ffn.experts
        if not isinstance(dispatcher, TokenDispatcher):
            raise ValueError("sequence parallelism needs the TP token dispatcher (apply_experts first)")
        dispatcher.seq_scatter = True
        if block.ffn.shared is not None:
            block.ffn.shared.w2.reduce = "none"  # its partial sum joins the routed experts' one reduce-scatter
        block.ffn.forward = _moe_region(block.ffn.forward, group, dispatcher)
    model.sp_group = group


TP_PARTIAL_LORA = ("a_gate", "a_up", "b_down")  # replicated over tp, each rank's gradient a partial sum


def tp_partial_params(model: nn.Module) -> list[nn.Parameter]:
    """Under tp: the routed experts' LoRA factors that are not split along the experts' width (``a_gate``, ``a_up``,
    ``b_down``): every tp rank sees only its width slice's share of their gradients, which the engine sums."""
    return [getattr(m.lora, n) for _, m in moe_modules(model) if m.lora is not None
            for n in TP_PARTIAL_LORA if n in m.lora._parameters]


def sequence_parallel_params(model: nn.Module) -> list[nn.Parameter]:
    """The replicated weights used on sequence slices (their gradients are partial sums over tp ranks)."""
    return [p for n, p in model.named_parameters() if n.startswith("layers.") and any(s in n for s in SP_PARAMS)]


# ------------------------------------------------------------------------------------------------- EP
def expert_params(model: nn.Module) -> list[nn.Parameter]:
    """The routed experts' parameters (sharded over ``ep``): their weights and their LoRA factors."""
    return [p for _, m in moe_modules(model)
            for p in (*m.expert_weights(), *(m.lora.parameters() if m.lora is not None else ())) if p is not None]


def apply_experts(model: Transformer, mesh: DeviceMesh, dims: ParallelDims) -> None:
    """Shard the routed experts over ``ep`` (dim 0) and ``tp`` (their width) and install the dispatcher."""
    if dims.ep == 1 and dims.tp == 1:
        return
    if dims.ep > 1 and dims.tp > 1:
        sub, lead = mesh["ep", "tp"], [Shard(0)]
    else:
        sub, lead = (mesh["ep"], [Shard(0)]) if dims.ep > 1 else (mesh["tp"], [])
    width = [Shard(2)] if dims.tp > 1 else []
    down = [Shard(1)] if dims.tp > 1 else []
    ep_group = mesh["ep"].get_group() if dims.ep > 1 else None
    tp_group = mesh["tp"].get_group() if dims.tp > 1 else None
    for _, moe in moe_modules(model):
        if moe.frozen_experts is None:  # (a quantised frozen base holds its rank's experts already: QLoRA)
            shard_param(moe, "w_gate", sub, lead + width)
            shard_param(moe, "w_up", sub, lead + width)
            shard_param(moe, "w_down", sub, lead + down)
        if moe.lora is not None:  # per-expert LoRA factors: whole experts per ep rank, like the weights; under
            for name, _ in list(moe.lora.named_parameters()):  # tp, split along the experts' width with them
                split = {"b_gate": 2, "b_up": 2, "a_down": 1}.get(name)
                tp_place = ([Shard(split)] if split else [Replicate()]) if dims.tp > 1 else []
                if lead or tp_place:
                    shard_param(moe.lora, name, sub, lead + tp_place)
        moe.experts = TokenDispatcher(moe, ep_group, tp_group)


# ----------------------------------------------------------------------------------------------- FSDP
def apply_fsdp(model: Transformer, mesh: DeviceMesh, dims: ParallelDims, param_dtype: torch.dtype | None,
               reshard_after_forward: bool = True, reduce_dtype: torch.dtype = torch.float32) -> None:
    """FSDP2 over ``dp_shard`` (HSDP with ``dp_replicate``): one unit per block, the rest at the root.
    With ``param_dtype`` (bf16 training) parameters are gathered in it and gradients reduced in ``reduce_dtype``
    (fp32 by default; bf16 halves the bytes, as DeepSpeed's bf16 mode does).

    Expert weights under EP are already split over the data-parallel ranks: FSDP leaves them alone and the
    engine sums their gradients over ``dp_mod_ep``. Gradients are *summed* (divide factor 1): the engine's
    objective is already normalised by the global token count.
    """
    if dims.dp == 1:
        return
    dp_mesh = mesh["dp_replicate", "dp_shard"] if dims.dp_replicate > 1 else mesh["dp_shard"]
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype) if param_dtype else \
        MixedPrecisionPolicy()
    ignored = set(expert_params(model)) if dims.ep > 1 else None
    units = []
    for block in blocks(model):
        units.append(fully_shard(block, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward,
                                 ignored_params=ignored))
    units.append(fully_shard(model, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward,
                             ignored_params=ignored))
    for unit in units:
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no PREMUL_SUM)


# ------------------------------------------------------------------------------------------- pipeline
def stage_layers(num_layers: int, stages: int, explicit: list[int] | None) -> list[range]:
    """Decoder layers of every stage: ``explicit`` counts, or an even split (earlier stages take the rest)."""
    if explicit is not None:
        if len(explicit) != stages or sum(explicit) != num_layers or min(explicit) < 0:
            raise LayoutError(f"parallel.pp_layers={explicit} must have pp*vpp={stages} entries summing to "
                              f"model.num_layers={num_layers}")
        counts = explicit
    else:
        base, extra = divmod(num_layers, stages)
        counts = [base + (1 if s < extra else 0) for s in range(stages)]
    out, start = [], 0
    for c in counts:
        out.append(range(start, start + c))
        start += c
    return out


def stage_ids(dims: ParallelDims, pp_rank: int, schedule: str) -> list[int]:
    """Stages a pipeline rank holds: loop order (``r, r+pp, ...``) or V order for zbv/dualpipev."""
    if schedule in ("zbv", "dualpipev"):
        if dims.vpp != 2:
            raise LayoutError(f"parallel.pp_schedule={schedule} needs parallel.vpp=2 (a V of two stages per rank)")
        return [pp_rank, 2 * dims.pp - 1 - pp_rank]
    return [pp_rank + v * dims.pp for v in range(dims.vpp)]


def prune_to_stage(model: Transformer, layers: range, first: bool, last: bool) -> Transformer:
    """A copy holding only this stage's layers (same parameter names) and, on the first/last stage, the
    embedding / the head (final mHC collapse, norm, LM head, MTP)."""
    part = copy.deepcopy(model)
    part.layers = nn.ModuleDict({str(i): part.layers[i] for i in layers})
    if not first:
        part.embed = None
    if not last:
        part.hc_head = part.norm = part.lm_head = None
        part.mtp = nn.ModuleList()
    elif part.cfg.tie_embeddings and not first:
        raise LayoutError("model.tie_embeddings with pp > 1 is not supported (the embedding and the LM head "
                          "would live on different stages)")
    part.stage_first, part.stage_last = first, last
    return part


def world_info() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
