"""Expert parallelism: the token dispatcher.

Each of the ``ep`` ranks of an expert-parallel group holds ``E / ep`` consecutive experts (a ``DTensor``
sharded on dim 0 over the ``ep`` mesh; under tensor parallelism also split along the expert width). One MoE
forward on a rank:

1. permute its token copies by global expert (``kernels.permute``); tokens per expert ``counts_e``;
2. exchange the counts (``all_to_all_single``, the only host sync) -> how many rows come from every source
   rank for every local expert;
3. all-to-all the rows with uneven splits (asynchronous: the shared expert runs while it is in flight);
4. the local experts on the received rows (``MoE.routed``: ``kernels.moe_experts``, or with adapters the LoRA
   composition, with unit weights: gather, grouped GEMMs,
   SwiGLU, scatter back into arrival order);
5. all-to-all the results back, then un-permute with the routing weights (``kernels.unpermute``).

Both all-to-alls are differentiable (the backward is the reverse exchange). With tensor parallelism, the
routed inputs and weights enter a ``copy_to_tp`` region and the combined output leaves through
``reduce_from_tp`` (each tp rank computes a slice of every expert's width).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from kernels import permute, unpermute
from trainer.parallel.tensor_parallel import copy_to_tp, local, reduce_from_tp, reduce_scatter_seq


class TokenDispatcher:
    """Routed + shared experts of one MoE layer under EP (``ep_group``) and/or TP (``tp_group``)."""

    def __init__(self, moe, ep_group=None, tp_group=None):
        self.moe, self.ep_group, self.tp_group = moe, ep_group, tp_group
        self.seq_scatter = False  # sequence parallel: leave through one reduce-scatter (see apply_sequence_parallel)
        self.ep = dist.get_world_size(ep_group) if ep_group is not None else 1
        self.n_experts = moe.cfg.n_routed_experts  # global

    def __call__(self, x_nd: torch.Tensor, idx_nk: torch.Tensor, w_nk: torch.Tensor) -> torch.Tensor:
        moe = self.moe
        x_in, w_in = copy_to_tp(x_nd, self.tp_group), copy_to_tp(w_nk, self.tp_group)
        # expert shards are not FSDP-managed: under FSDP's bf16 compute they are cast here, like autocast would
        dtype = x_in.dtype if x_in.dtype != torch.float32 or torch.is_autocast_enabled(x_in.device.type) else None
        wg, wu, wd = (None if w is None else local(w) if dtype is None else local(w).to(dtype)
                      for w in moe.expert_weights())  # (None: a quantised frozen base's local experts)
        if self.ep == 1:
            y = moe.routed(x_in, idx_nk, w_in, wg, wu, wd)
            shared = moe.shared(x_nd) if moe.shared is not None else None
        else:
            y, shared = self._dispatch(x_in, x_nd, idx_nk, w_in, wg, wu, wd)
        if self.seq_scatter:  # routed and shared partial sums reduced once, straight into sequence slices
            y = y if shared is None else y + shared
            b, t = self.token_shape
            return reduce_scatter_seq(y.view(b, t, -1), self.tp_group).reshape(-1, y.shape[-1])
        y = reduce_from_tp(y, self.tp_group)
        return y if shared is None else y + shared

    def _dispatch(self, x_in, x_nd, idx_nk, w_in, wg, wu, wd):
        ep, e = self.ep, self.n_experts
        e_local = e // ep
        x_sorted, counts_e, order_m = permute(x_in, idx_nk, e)
        counts_recv = torch.empty_like(counts_e)
        dist.all_to_all_single(counts_recv, counts_e, group=self.ep_group)  # [src, local expert]
        send = counts_e.view(ep, e_local).sum(1).tolist()
        recv_se = counts_recv.view(ep, e_local)
        recv = recv_se.sum(1).tolist()
        rows = funcol.all_to_all_single_autograd(x_sorted, recv, send, self.ep_group)
        shared = self.moe.shared(x_nd) if self.moe.shared is not None else None  # overlaps the exchange
        rows = funcol.wait_tensor(rows) if isinstance(rows, funcol.AsyncCollectiveTensor) else rows
        expert_r = torch.repeat_interleave(torch.arange(e_local, device=rows.device).repeat(ep), recv_se.reshape(-1))
        ones = torch.ones(rows.shape[0], 1, dtype=w_in.dtype, device=rows.device)
        out = self.moe.routed(rows, expert_r[:, None], ones, wg, wu, wd)  # arrival order, unit weights
        back = funcol.all_to_all_single_autograd(out, send, recv, self.ep_group)
        back = funcol.wait_tensor(back) if isinstance(back, funcol.AsyncCollectiveTensor) else back
        return unpermute(back, order_m, w_in, x_nd.shape[0]), shared
