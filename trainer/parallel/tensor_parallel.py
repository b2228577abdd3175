"""Tensor parallelism: Megatron-style regions over DTensor-sharded parameters.

Parameters are ``DTensor``s on the ``tp`` mesh (so FSDP2 can shard them further and DCP can save and reshard
them); the computation uses their local shards and two autograd collectives:

- :func:`copy_to_tp` -- identity forward, all-reduce of the gradient backward: put before a computation that
  only uses this rank's slice of the weights, on an input every rank holds in full;
- :func:`reduce_from_tp` -- all-reduce forward, identity backward: after a computation whose output is this
  rank's partial sum.

A column-parallel linear splits its output features, a row-parallel one its input features; a vocabulary-
parallel embedding splits its rows. Activations between the regions are replicated, so every parameter that
is not split (norms, mHC, router, compressors, indexers) gets the same gradient on every tp rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DeviceMesh, DTensor, Replicate, Shard, distribute_tensor


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (differentiable), or the tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        dist.all_reduce(g, group=ctx.group)
        return g, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        y = x.contiguous().clone()
        dist.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(ctx, g):
        return g, None


def copy_to_tp(x: torch.Tensor, group) -> torch.Tensor:
    return _CopyToTP.apply(x, group) if group is not None and torch.is_grad_enabled() else x


def reduce_from_tp(x: torch.Tensor, group) -> torch.Tensor:
    if group is None:
        return x
    if not torch.is_grad_enabled():
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x
    return _ReduceFromTP.apply(x, group)


def shard_param(module: nn.Module, name: str, mesh: DeviceMesh, placements) -> None:
    """Replace ``module.<name>`` (the full tensor, equal on every rank) by a DTensor parameter."""
    old = getattr(module, name)
    dt = distribute_tensor(old.detach(), mesh, placements)
    setattr(module, name, nn.Parameter(dt, requires_grad=old.requires_grad))


class ColumnParallelLinear(nn.Linear):
    """Output features split over tp: ``y_local = x @ W_local^T``; the input's gradient is all-reduced."""

    tp_group = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(copy_to_tp(x, self.tp_group), local(self.weight))


class RowParallelLinear(nn.Linear):
    """Input features split over tp: partial products summed across the group. ``reduce`` selects how:
    ``"all"`` (all-reduce), ``"seq"`` (reduce-scatter along the sequence: sequence parallelism's exit) or
    ``"none"`` (the caller adds more partial sums before reducing once)."""

    tp_group = None
    reduce = "all"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, local(self.weight))
        if self.reduce == "seq":
            return reduce_scatter_seq(y, self.tp_group)
        return y if self.reduce == "none" else reduce_from_tp(y, self.tp_group)


class VocabParallelEmbedding(nn.Embedding):
    """Rows split over tp: each rank looks up the ids it holds, zeros the rest, and the group sums."""

    tp_group = None
    vocab_start = 0

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        w = local(self.weight)
        lo, hi = self.vocab_start, self.vocab_start + w.shape[0]
        outside = (ids < lo) | (ids >= hi)
        out = F.embedding((ids - lo).masked_fill(outside, 0), w)
        return reduce_from_tp(out.masked_fill(outside[..., None], 0.0), self.tp_group)


def parallelize_linear(lin: nn.Linear, style: str, mesh: DeviceMesh) -> None:
    """Turn ``lin`` into a column- or row-parallel linear in place (parameter names unchanged)."""
    if lin.bias is not None:
        raise ValueError("tensor-parallel linears here have no bias")
    cls, dim = {"colwise": (ColumnParallelLinear, 0), "rowwise": (RowParallelLinear, 1)}[style]
    shard_param(lin, "weight", mesh, [Shard(dim)])
    lin.__class__ = cls
    lin.tp_group = mesh.get_group()


def parallelize_embedding(emb: nn.Embedding, mesh: DeviceMesh) -> None:
    n, size, rank = emb.weight.shape[0], mesh.size(), mesh.get_local_rank()
    shard_param(emb, "weight", mesh, [Shard(0)])
    emb.__class__ = VocabParallelEmbedding
    emb.tp_group = mesh.get_group()
    emb.vocab_start = min(n, rank * -(-n // size))  # DTensor's uneven Shard(0): torch.chunk sizes


def replicate_param(module: nn.Module, name: str, mesh: DeviceMesh) -> None:
    shard_param(module, name, mesh, [Replicate()])


# --------------------------------------------------------------------------------- sequence parallel
def _all_gather_cat(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _check_divisible(x: torch.Tensor, group, dim: int) -> int:
    n = dist.get_world_size(group)
    if x.shape[dim] % n:
        raise ValueError(f"sequence length {x.shape[dim]} is not divisible by tp={n} (sequence parallel)")
    return n

class _GatherSeq(torch.autograd.Function):
    """All-gather along the sequence; backward keeps this rank's slice (the gradient arriving here is
    already complete and equal on every rank: the TP regions all-reduce it)."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        ctx.rank, ctx.n = dist.get_rank(group), dist.get_world_size(group)
        return _all_gather_cat(x, group, dim)

    @staticmethod
    def backward(ctx, g):
        return g.chunk(ctx.n, dim=ctx.dim)[ctx.rank].contiguous(), None, None


class _ScatterSeq(torch.autograd.Function):
    """Keep this rank's slice of a replicated tensor; backward all-gathers the slices' gradients."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return x.chunk(_check_divisible(x, group, dim), dim=dim)[dist.get_rank(group)].contiguous()

    @staticmethod
    def backward(ctx, g):
        return _all_gather_cat(g, ctx.group, ctx.dim), None, None


def gather_seq(x: torch.Tensor, group, dim: int = 1) -> torch.Tensor:
    return _GatherSeq.apply(x, group, dim)


def scatter_seq(x: torch.Tensor, group, dim: int = 1) -> torch.Tensor:
    return _ScatterSeq.apply(x, group, dim)


class _ReduceScatterSeq(torch.autograd.Function):
    """Sum partial results over the group and keep this rank's sequence slice (= ``scatter_seq`` of
    ``reduce_from_tp``, with half the traffic); backward all-gathers the slices' gradients."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        parts = [c.contiguous() for c in x.chunk(_check_divisible(x, group, dim), dim=dim)]
        out = torch.empty_like(parts[0])
        dist.reduce_scatter(out, parts, group=group)
        return out

    @staticmethod
    def backward(ctx, g):
        return _all_gather_cat(g, ctx.group, ctx.dim), None, None


def reduce_scatter_seq(x: torch.Tensor, group, dim: int = 1) -> torch.Tensor:
    return _ReduceScatterSeq.apply(x, group, dim)
