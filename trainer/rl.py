"""The GRPO family's objective: group-normalised advantages, the clipped surrogate (clip-higher, dual-clip), loss
aggregation, the KL to a frozen reference, the overlong penalty. Pure tensor functions plus :func:`grpo_objective`,
the objective the training core's engine calls on a rollout batch (``trainer/rollout.py`` makes those).

Definitions follow verl and TRL (docs/rl.md cites them; ``tests/trainer/test_rl.py`` checks the hand-computed
vectors of ../shared/reference/grpo-for-moe.md):

- advantage ``A_i = (r_i - mean_g) / (std_g + eps)`` with the unbiased (n-1) std of the group ``g`` (``norm_std``
  off: ``r_i - mean_g``, Dr.GRPO); a group of one: ``A = r``; every token of the response carries ``A_i``;
- ratio ``rho_t = exp(clamp(logp - logp_old, -20, 20))``; per-token loss
  ``L_t = max(-A rho_t, -A clip(rho_t, 1 - eps_low, 1 + eps_high))`` and, where ``A < 0``, ``min(L_t, -A c)``
  (dual-clip, ``c > 1``; None: off);
- aggregation over the response tokens of the whole step batch: ``token-mean`` (sum / tokens),
  ``seq-mean-token-mean``, ``seq-mean-token-sum``, ``seq-mean-token-sum-norm`` (/ the length limit);
- KL (``beta > 0``): k3 ``exp(d) - d - 1`` with ``d = logp_ref - logp``, added per token before aggregation.
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import torch

from trainer.data import IGNORE

AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
LOG_RATIO_CLAMP = 20.0


def group_advantages(rewards: torch.Tensor, group_size: int, norm_std: bool = True, eps: float = 1e-6
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages of rewards laid out group after group (``[n_groups * group_size]``), and per group whether all
    its rewards are equal (such a group teaches nothing: its advantages are 0)."""
    r = rewards.double().view(-1, group_size)
    mean = r.mean(1, keepdim=True)
    if group_size == 1:
        adv = r.clone()  # verl: a group of one has mean 0, std 1
    elif norm_std:
        adv = (r - mean) / (r.std(1, unbiased=True, keepdim=True) + eps)
    else:
        adv = r - mean
    flat = (r == r[:, :1]).all(1) & (group_size > 1)  # (a group of one keeps A = r: it has nothing to compare)
    adv[flat] = 0.0
    return adv.view(-1).to(rewards.dtype), flat


def overlong_penalty(length: int, max_len: int, buffer: int, factor: float) -> float:
    """DAPO's soft overlong punishment: 0 up to ``max_len - buffer`` tokens, then falling linearly to ``-factor`` at
    ``max_len`` (``buffer`` 0: off)."""
    if buffer <= 0:
        return 0.0
    expected = max_len - buffer
    return min(-(length - expected) / buffer * factor, 0.0)


def clipped_surrogate(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, clip_low: float,
                      clip_high: float, clip_c: float | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token policy loss and, per token, which clip is active (``low``: ``A < 0`` below ``1 - eps_low``;
    ``high``: ``A > 0`` above ``1 + eps_high``; ``dual``: the dual-clip bound) and the ratio."""
    ratio = torch.exp((logp - old_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    flags = {"low": (adv < 0) & (ratio < 1.0 - clip_low), "high": (adv > 0) & (ratio > 1.0 + clip_high),
             "ratio": ratio.detach()}
    if clip_c is not None:
        bound = -adv * clip_c
        dual = (adv < 0) & (loss > bound)
        loss = torch.where(adv < 0, torch.minimum(loss, bound), loss)
        flags["dual"] = dual
    return loss, flags


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """The k3 estimator of KL(pi || pi_ref) per token: ``exp(d) - d - 1``, ``d = logp_ref - logp`` (clamped)."""
    d = (ref_logp - logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.exp(d) - d - 1.0


def aggregate(loss_bt: torch.Tensor, mask_bt: torch.Tensor, seq_bt: torch.Tensor, mode: str, max_len: int
              ) -> tuple[torch.Tensor, int]:
    """``(sum, count)`` whose ratio over the whole step batch is the ``mode`` aggregate: micro-batches add their
    sums and counts, the engine divides once. ``seq_bt``: each token's sequence id (-1: not a response token)."""
    if mode not in AGGREGATIONS:
        raise ValueError(f"unknown loss aggregation {mode!r}; one of {list(AGGREGATIONS)}")
    masked = loss_bt * mask_bt
    if mode == "token-mean":
        return masked.sum(), int(mask_bt.sum())
    ids = seq_bt[mask_bt > 0]
    if ids.numel() == 0:
        return masked.sum() * 0.0, 0
    uniq, inverse = torch.unique(ids, return_inverse=True)
    per_seq = torch.zeros(len(uniq), dtype=loss_bt.dtype, device=loss_bt.device).index_add(0, inverse,
                                                                                           masked[mask_bt > 0])
    if mode == "seq-mean-token-mean":
        tokens = torch.bincount(inverse, minlength=len(uniq)).to(loss_bt.dtype)
        per_seq = per_seq / tokens
    elif mode == "seq-mean-token-sum-norm":
        per_seq = per_seq / max_len
    return per_seq.sum(), len(uniq)


def token_logprobs(model, batch: dict[str, torch.Tensor], temperature: float = 1.0
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probabilities [B, T] of each position's label under ``model``'s distribution at ``temperature`` (the one
    the rollout sampled from; 0 where the label is ignored) and each position's entropy. The LM head runs over the
    whole vocabulary at once: RL batches are a few thousand tokens (a chunked head is future work for a 129k
    vocabulary)."""
    h = model.norm(model.hidden(batch["input_ids"], batch["doc_ids"]))
    logits = model.lm_head(h).float() / (temperature if temperature > 0 else 1.0)
    logp_all = torch.log_softmax(logits, dim=-1)
    labels = batch["labels"]
    safe = labels.clamp_min(0)
    logp = logp_all.gather(-1, safe.unsqueeze(-1)).squeeze(-1) * (labels != IGNORE)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def grpo_objective(model, batch: dict[str, torch.Tensor], cfg) -> tuple[torch.Tensor, int, dict[str, float]]:
    """The GRPO loss of one micro-batch of a rollout batch as ``(sum, count, stats)`` (see :func:`aggregate`).

    ``batch`` holds, beside the packed rows, per token: ``advantages``, ``old_logp`` (the policy that sampled,
    recomputed by the training forward before the updates), ``seq_ids``, with ``cfg.kl_beta > 0`` ``ref_logp`` and
    with ``cfg.pos_lm_coef > 0`` ``positive`` (1 on the response tokens of correct samples, 0 elsewhere). ``stats`` are sums over response tokens (clip counts, KL, entropy, ratio) for the step's log."""
    logp, entropy = token_logprobs(model, batch, cfg.temperature)
    mask = (batch["labels"] != IGNORE).to(logp.dtype)
    loss, flags = clipped_surrogate(logp, batch["old_logp"], batch["advantages"], cfg.clip_low, cfg.clip_high,
                                    cfg.clip_c)
    kl = None
    if cfg.kl_beta > 0:
        kl = kl_k3(logp, batch["ref_logp"])
        loss = loss + cfg.kl_beta * kl
    if cfg.pos_lm_coef > 0:  # VAPO: imitate the correct samples too (``positive``: 1 on their response tokens)
        loss = loss - cfg.pos_lm_coef * logp * batch["positive"]
    total, count = aggregate(loss, mask, batch["seq_ids"], cfg.loss_agg, cfg.max_new_tokens)
    aux = model.indexer_loss()  # the CSA indexers keep following their attention (their inputs are detached)
    if aux is not None:
        total = total + model.cfg.indexer_loss_weight * aux
    n = float(mask.sum())
    stats = {"tokens": n, "clip_low": float((flags["low"] * mask).sum()), "clip_high": float((flags["high"] * mask).sum()),
             "ratio": float((flags["ratio"] * mask).sum()), "entropy": float((entropy.detach() * mask).sum()),
             "approx_kl_old": float(((batch["old_logp"] - logp.detach()) * mask).sum())}
    if "dual" in flags:
        stats["clip_dual"] = float((flags["dual"] * mask).sum())
    if kl is not None:
        stats["kl_ref"] = float((kl.detach() * mask).sum())
    return total, count, stats


@contextmanager
def router_replay(model, routes_btlk: torch.Tensor | None):
    """Within the block every routed MoE layer of ``model`` uses the recorded expert choices ``routes_btlk``
    ([B, T, MoE layers, k], aligned with the forward's tokens; -1: the router's own choice) instead of its router's:
    the rollout's routes replayed in the training forward (R3). The combine weights come from the live router at
    those experts. ``None``: nothing replayed."""
    if routes_btlk is None:
        yield
        return
    moes = model.moe_layers()
    if routes_btlk.shape[2] != len(moes):
        raise ValueError(f"router replay: routes for {routes_btlk.shape[2]} MoE layers, the model has {len(moes)}")
    for i, m in enumerate(moes):
        m.replay_nk = routes_btlk[:, :, i, :].reshape(-1, routes_btlk.shape[-1])
    try:
        yield
    finally:
        for m in moes:
            m.replay_nk = None


def policy_parameters(model) -> None:
    """What the RL stage trains: the model but its MTP heads, which sampling never uses (they keep their SFT
    weights and are frozen, so every trained parameter gets a gradient and optimizer state)."""
    for p in model.mtp.parameters():
        p.requires_grad_(False)


class GRPOObjective:
    """The RL stage's objective for the engine (the protocol of
    ``trainer.models.deepseek_v4.training.CrossEntropy``): :func:`grpo_objective` per micro-batch, normalised by
    the response tokens (``token-mean``) or the responses (the ``seq-mean-*`` modes) of the whole step batch."""

    def __init__(self, cfg):
        self.cfg = cfg

    def normaliser(self, batches: list[dict[str, torch.Tensor]]) -> tuple[int, int]:
        if self.cfg.loss_agg == "token-mean":
            return sum(int((b["labels"] != IGNORE).sum()) for b in batches), 0
        seqs = torch.cat([b["seq_ids"][b["labels"] != IGNORE] for b in batches])
        return int(torch.unique(seqs).numel()), 0

    def __call__(self, model, batch: dict[str, torch.Tensor]):
        with router_replay(model, batch.get("routes")):  # (present with train.rl.router_replay)
            total, count, stats = grpo_objective(model, batch, self.cfg)
        return total, count, None, 0, stats


def mean_std(values: list[float]) -> tuple[float, float]:
    if not values:
        return 0.0, 0.0
    mean = sum(values) / len(values)
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
