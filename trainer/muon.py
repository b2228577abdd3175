"""Muon for sharded and stacked weights (the optimizer DeepSeek-V4 was trained with).

The update of ``torch.optim.Muon`` -- Nesterov momentum, Newton-Schulz orthogonalisation of each weight
matrix (:func:`newton_schulz`), the learning-rate adjustment, decoupled weight decay --
applied to parameters ``torch.optim.Muon`` cannot take:

- DTensors (FSDP2 shards, tensor-parallel slices): the orthogonalisation needs whole matrices, so the
  momentum-corrected update is all-gathered across the dimensions that split a matrix, orthogonalised, and
  each rank keeps its own slice again (every rank computes the same full update; momentum stays sharded);
- stacked expert weights ``[E, D, I]``: every expert's ``[D, I]`` matrix is orthogonalised on its own (an
  expert-parallel ``Shard(0)`` is kept: each rank handles its own experts).

The matrices of one step are orthogonalised in batches of equal shape (:func:`orthogonalise`): a tiny model has
dozens of small matrices, whose one-by-one Newton-Schulz iterations cost more in per-call overhead than in
arithmetic.

On plain 2-D tensors the result equals ``torch.optim.Muon`` (tested).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, DEFAULT_NS_STEPS, EPS, _adjust_lr


def newton_schulz(g_ab: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float,
                  dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Approximate orthogonalisation ``U V^T`` of ``g = U S V^T`` by the quintic iteration
    ``X <- a X + (b A + c A^2) X`` with ``A = X X^T``, from ``X = g / ||g||_F`` (wide orientation).

    In bf16 (``torch.optim.Muon``'s precision: the same result) or fp32 (reproducible to rounding across
    layouts, for equivalence tests). ``g`` may be a batch ``[N, a, b]`` of same-shape matrices, each
    orthogonalised on its own (one batched GEMM per product instead of one small GEMM per matrix)."""
    a, b, c = coefficients
    x = g_ab.to(dtype)
    tall = x.shape[-2] > x.shape[-1]
    if tall:
        x = x.mT
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
    mm, addmm = (torch.bmm, torch.baddbmm) if x.ndim == 3 else (torch.mm, torch.addmm)
    for _ in range(steps):
        gram = mm(x, x.mT)
        x = addmm(x, addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.mT if tall else x


def orthogonalise(updates: list[torch.Tensor], coefficients: tuple[float, float, float], steps: int, eps: float,
                  dtype: torch.dtype) -> list[torch.Tensor]:
    """:func:`newton_schulz` of every matrix of ``updates`` (2-D, or stacked ``[E, D, I]``: one matrix per
    expert), matrices of one shape batched together; results in the order and shapes of ``updates``."""
    groups: dict[tuple[int, int], list[tuple[int, int]]] = {}
    mats = [u if u.ndim == 3 else u[None] for u in updates]
    for i, m in enumerate(mats):
        for e in range(m.shape[0]):
            groups.setdefault(tuple(m.shape[1:]), []).append((i, e))
    out = [torch.empty(m.shape, dtype=dtype, device=m.device) for m in mats]
    for where in groups.values():
        ortho = newton_schulz(torch.stack([mats[i][e] for i, e in where]), coefficients, steps, eps, dtype)
        for (i, e), o in zip(where, ortho.unbind(0)):
            out[i][e] = o
    return [o if u.ndim == 3 else o[0] for o, u in zip(out, updates)]


def _whole_matrices(t: torch.Tensor) -> torch.Tensor:
    """``t`` with every matrix complete on this rank (a stacked tensor keeps its Shard(0) over experts)."""
    if not isinstance(t, DTensor):
        return t
    keep = [pl if (t.ndim == 3 and isinstance(pl, Shard) and pl.dim == 0) else Replicate() for pl in t.placements]
    return t.redistribute(t.device_mesh, keep).to_local()


class ShardedMuon(torch.optim.Optimizer):
    def __init__(self, params, lr: float = 1e-3, weight_decay: float = 0.1, momentum: float = 0.95,
                 nesterov: bool = True, ns_coefficients: tuple[float, float, float] = (DEFAULT_A, DEFAULT_B, DEFAULT_C),
                 eps: float = EPS, ns_steps: int = DEFAULT_NS_STEPS, adjust_lr_fn: str | None = None,
                 ns_dtype: torch.dtype = torch.bfloat16):
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                        ns_coefficients=ns_coefficients, eps=eps, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn,
                        ns_dtype=ns_dtype)
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                if p.ndim not in (2, 3):
                    raise ValueError(f"Muon takes 2-D matrices or stacked [E, D, I] weights, not shape {tuple(p.shape)}")

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            mom, lr = group["momentum"], group["lr"]
            params, wholes = [], []
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(g)
                buf = state["momentum_buffer"]
                buf.lerp_(g, 1 - mom)
                update = g.lerp(buf, mom) if group["nesterov"] else buf
                params.append(p)
                wholes.append(_whole_matrices(update))
            orthos = orthogonalise(wholes, group["ns_coefficients"], group["ns_steps"], group["eps"],
                                   group["ns_dtype"])
            for p, ortho in zip(params, orthos):
                if isinstance(p, DTensor):
                    keep = [pl if (p.ndim == 3 and isinstance(pl, Shard) and pl.dim == 0) else Replicate()
                            for pl in p.placements]
                    ortho = DTensor.from_local(ortho.to(p.dtype), p.device_mesh, keep, run_check=False,
                                               shape=p.shape, stride=p.stride())
                    ortho = ortho.redistribute(p.device_mesh, p.placements)
                adjusted = _adjust_lr(lr, group["adjust_lr_fn"], p.shape[-2:])
                p.mul_(1 - lr * group["weight_decay"])
                p.add_(ortho.to(p.dtype) if not isinstance(ortho, DTensor) else ortho, alpha=-adjusted)
        return loss

