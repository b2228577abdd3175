"""The RL stage's data source: rollouts of the policy, their rewards and advantages, served to the training core.

:class:`RolloutSource` is what :func:`trainer.core.fit` asks for each step's rows (the protocol of
:class:`trainer.core.StaticSource`), so the RL stage trains with the same step, optimizer, schedule, checkpoints
and logging as CPT and SFT. Every ``ppo_epochs x minibatches`` steps it makes a rollout:

1. ``prompts_per_rollout`` prompts (a seeded order over the prompt set, a function of the rollout's index),
   ``group_size`` samples each, decoded by the sampler (``trainer.sampler``: by default
   :func:`trainer.generate.decode_rows`, the continuous-batching decoder ``trex serve`` runs, on the policy
   itself; or a vLLM engine given the policy's weights before each rollout) with each sampled token's
   log-probability (the behaviour policy);
2. rewards from the ``reward`` callable the task passes in (the attested sandbox: ``eval.rewards``; the trainer
   imports nothing of ``eval``), plus the overlong penalty; group-normalised advantages; groups whose rewards
   are all equal left out and counted;
3. one row per sample (prompt + response), labels on the response and its end token, per token the advantage,
   the rollout's log-probability and the policy's own, recomputed by the training forward before any update
   (``old_logp``: the ratios' denominator), and, with a KL term, the frozen reference's.

Each step then trains on a minibatch of that rollout (a seeded permutation per pass). The rollout in progress is
part of every checkpoint (:meth:`state_dict`), so a run killed mid-rollout-cycle resumes the same trajectory.
The rollout's seeds are a function of (seed, rollout, prompt, sample).
"""

from __future__ import annotations

import math
import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable

import torch

from trainer.data import IGNORE, BatchOrder, Packed
from trainer.generate import Row
from trainer.models.deepseek_v4.training import discard_expert_load
from trainer.rl import group_advantages, mean_std, overlong_penalty, router_replay, token_logprobs
from trainer.sampler import NativeSampler, Sampler

# (prompt rows, completions) -> per sample {"reward": float, "correct": bool, ...}: the task builds it (eval.rewards)
RewardFn = Callable[[list[dict], list[str]], list[dict]]
EXTRA = ("advantages", "old_logp", "rollout_logp", "seq_ids", "ref_logp", "routes", "positive")


@dataclass
class RLPrompt:
    ids: list[int]  # the chat prompt's tokens, ending with the generation prompt
    row: dict  # what the reward needs: the problem's data files, its optimum and status


class RolloutBatch(Packed):
    """A rollout's rows with their per-token RL tensors (``batch`` hands them to the objective)."""

    def __init__(self, base: Packed, extra: dict[str, torch.Tensor]):
        super().__init__(base.input_ids, base.labels, base.doc_ids, base.position_ids, base.stats)
        self.extra = extra

    def batch(self, idx: torch.Tensor) -> dict[str, torch.Tensor]:
        return {**super().batch(idx), **{k: v[idx] for k, v in self.extra.items()}}

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"input_ids": self.input_ids, "labels": self.labels, "doc_ids": self.doc_ids,
                "position_ids": self.position_ids, **self.extra}

    @classmethod
    def from_tensors(cls, t: dict[str, torch.Tensor], stats: dict) -> "RolloutBatch":
        base = Packed(t["input_ids"], t["labels"], t["doc_ids"], t["position_ids"], stats)
        return cls(base, {k: t[k] for k in EXTRA if k in t})


class RolloutSource:
    """Rollouts of ``model`` on ``prompts``, rewarded by ``reward``, served as minibatches (module docstring)."""

    def __init__(self, model, prompts: list[RLPrompt], reward: RewardFn, cfg, end_ids: set[int], pad_id: int,
                 decode: Callable[[list[int]], str], seed: int, ref_model=None, sampler: Sampler | None = None):
        limit = model.cfg.max_seq_len
        self.prompts = [p for p in prompts if len(p.ids) + 1 < limit]
        if not self.prompts:
            raise ValueError(f"no RL prompt fits under max_seq_len {limit} (of {len(prompts)})")
        self.model, self.reward, self.cfg, self.ref_model = model, reward, cfg, ref_model
        self.end_ids, self.pad_id, self.decode, self.seed = set(end_ids), pad_id, decode, seed
        self.sampler = sampler or NativeSampler(model, self.end_ids, pad_id, cfg.rollout_batch)
        self.per_rollout = cfg.ppo_epochs * cfg.minibatches
        self.order = BatchOrder(len(self.prompts), min(cfg.prompts_per_rollout, len(self.prompts)), seed)
        self.replay: list[int] = []  # prompts whose last group had unequal rewards, oldest first (cfg.replay)
        self.replayed = 0
        self.k: int | None = None  # the rollout in use
        self.current: RolloutBatch | None = None
        self.stats: dict[str, float] = {}
        self.t_ready = time.perf_counter()

    # ------------------------------------------------------------------------------------------ the source
    def batch(self, step: int) -> tuple[RolloutBatch, torch.Tensor]:
        k, offset = divmod(step, self.per_rollout)
        if self.k != k:
            self._rollout(k)
        epoch, mb = divmod(offset, self.cfg.minibatches)
        n = len(self.current)
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(self._seed(k, 1_000_000 + epoch)))
        size = math.ceil(n / self.cfg.minibatches)
        self.t_ready = time.perf_counter()
        return self.current, perm[mb * size:(mb + 1) * size]

    def state_dict(self) -> dict | None:
        if self.current is None:
            return None
        return {"k": self.k, "tensors": self.current.tensors(), "batch_stats": self.current.stats,
                "stats": dict(self.stats), "replay": list(self.replay)}

    def load_state_dict(self, state: dict | None) -> None:
        if state:
            self.k, self.stats = int(state["k"]), dict(state["stats"])
            self.replay = [int(i) for i in state.get("replay", [])]
            self.current = RolloutBatch.from_tensors(state["tensors"], state["batch_stats"])

    def metrics(self, sums) -> dict[str, float]:
        """The step's objective statistics (means over its response tokens) and its rollout's."""
        st, out = sums.stats, dict(self.stats)
        n = st.get("tokens", 0.0)
        if n:
            low, high = st.get("clip_low", 0.0), st.get("clip_high", 0.0)
            out |= {"clip_frac_low": low / n, "clip_frac_high": high / n, "clip_frac": (low + high) / n,
                    "entropy": st["entropy"] / n, "approx_kl": st["approx_kl_old"] / n, "ratio_mean": st["ratio"] / n}
            if "clip_dual" in st:
                out["clip_frac_dual"] = st["clip_dual"] / n
            if "kl_ref" in st:
                out["kl"] = st["kl_ref"] / n
        dt = time.perf_counter() - self.t_ready
        out["update_tokens_per_s"] = sums.seen / max(dt, 1e-9)
        return out

    # ----------------------------------------------------------------------------------------- a rollout
    def _seed(self, k: int, j: int) -> int:
        return (self.seed * 1_000_003 + k * 7_919 + j) % (2**63 - 1)

    def _choose(self, k: int) -> list[int]:
        """Rollout ``k``'s prompts: up to ``replay x prompts_per_rollout`` of the replay pool (oldest first, taken out
        of it), then new ones from the seeded order (none twice in a rollout)."""
        n = len(self.order(k))
        again = self.replay[:round(self.cfg.replay * n)]
        self.replay, self.replayed = self.replay[len(again):], len(again)
        fresh = [int(i) for i in self.order(k) if int(i) not in again]
        return again + fresh[:n - len(again)]

    def _remember(self, chosen: list[int], flat: torch.Tensor) -> None:
        """Prompts whose group had unequal rewards join the pool's end (the newest), a uniform group leaves it."""
        for i, uniform in zip(chosen, flat.tolist()):
            if i in self.replay:
                self.replay.remove(i)
            if not uniform:
                self.replay.append(i)

    def _rollout(self, k: int) -> None:
        cfg, g = self.cfg, self.cfg.group_size
        index = self._choose(k) if cfg.replay > 0 else [int(i) for i in self.order(k)]
        chosen = [self.prompts[i] for i in index]
        rows = [Row(p.ids, cfg.max_new_tokens, cfg.temperature, cfg.top_p, self._seed(k, i * g + j), logprobs=[],
                    routes=[] if cfg.router_replay else None) for i, p in enumerate(chosen) for j in range(g)]
        t0 = time.perf_counter()
        synced = self.sampler.sync(self.model, k * self.per_rollout)  # (the weights after the previous rollout's steps)
        sync_s = time.perf_counter() - t0
        self.sampler.sample(rows)
        rollout_s = time.perf_counter() - t0 - sync_s
        texts = [self.decode(r.tokens) for r in rows]
        t1 = time.perf_counter()
        infos = self.reward([p.row for p in chosen for _ in range(g)], texts)
        reward_s = time.perf_counter() - t1
        rewards = [float(info["reward"]) + overlong_penalty(len(r.tokens), cfg.max_new_tokens, cfg.overlong_buffer,
                                                             cfg.overlong_penalty) for r, info in zip(rows, infos)]
        adv, flat = group_advantages(torch.tensor(rewards, dtype=torch.float64), g, cfg.norm_adv_std, cfg.adv_eps)
        if cfg.replay > 0:
            self._remember(index, flat)
        keep = [i for i in range(len(rows)) if not (cfg.drop_equal_groups and bool(flat[i // g]))]
        if not keep:  # every group was uniform: nothing to learn from this rollout (zero advantages, no update)
            keep = list(range(len(rows)))
        self.current = self._rows([chosen[i // g] for i in keep], [rows[i] for i in keep], adv[keep].float(),
                                  [bool(infos[i].get("correct")) for i in keep])
        self.k = k
        generated = sum(len(r.tokens) + (r.end_token is not None) for r in rows)
        mean, std = mean_std(rewards)
        lengths = [len(r.tokens) for r in rows]
        self.stats = {"rollout": float(k), "reward_mean": mean, "reward_std": std,
                      "pass_rate": sum(bool(i.get("correct")) for i in infos) / len(infos),
                      "dropped_groups": float(flat.sum()), "groups": float(len(chosen)),
                      **({"replayed_prompts": float(self.replayed), "replay_pool": float(len(self.replay))}
                         if cfg.replay > 0 else {}),
                      "response_length_mean": sum(lengths) / len(lengths), "response_length_max": float(max(lengths)),
                      "truncated_ratio": sum(r.finish_reason == "length" for r in rows) / len(rows),
                      "side_effect_ratio": sum(bool(i.get("side_effects")) for i in infos) / len(infos),
                      "rollout_tokens_per_s": generated / max(rollout_s, 1e-9), "rollout_s": rollout_s,
                      "reward_s": reward_s, "sync_s": sync_s, "sync_mb": synced / 2**20,
                      **self._mismatch()}

    def _rows(self, prompts: list[RLPrompt], rows: list[Row], adv: torch.Tensor, correct: list[bool]) -> RolloutBatch:
        seqs = [p.ids + r.tokens + ([r.end_token] if r.end_token is not None else []) for p, r in zip(prompts, rows)]
        width = min(self.model.cfg.max_seq_len, -(-max(len(s) for s in seqs) // 32) * 32)
        m = len(seqs)
        t = {"input_ids": torch.full((m, width), self.pad_id, dtype=torch.long),
             "labels": torch.full((m, width), IGNORE, dtype=torch.long),
             "doc_ids": torch.full((m, width), -1, dtype=torch.long),
             "position_ids": torch.zeros((m, width), dtype=torch.long),
             "advantages": torch.zeros((m, width)), "rollout_logp": torch.zeros((m, width)),
             "seq_ids": torch.full((m, width), -1, dtype=torch.long)}
        for i, (p, r, s) in enumerate(zip(prompts, rows, seqs)):
            n, start = len(s), len(p.ids) - 1  # position start + j predicts response token j
            resp = len(s) - len(p.ids)
            t["input_ids"][i, :n] = torch.tensor(s)
            t["doc_ids"][i, :n] = 0
            t["position_ids"][i, :n] = torch.arange(n)
            t["labels"][i, start:start + resp] = torch.tensor(s[len(p.ids):], dtype=torch.long)
            t["advantages"][i, start:start + resp] = adv[i]
            t["rollout_logp"][i, start:start + resp] = torch.tensor(r.logprobs[:resp])
            t["seq_ids"][i, start:start + resp] = i
        stats = {"sequences": m, "tokens": int((t["doc_ids"] >= 0).sum()), "loss_tokens": int((t["labels"] != IGNORE).sum())}
        batch = RolloutBatch(Packed(t["input_ids"], t["labels"], t["doc_ids"], t["position_ids"], stats),
                             {k: t[k] for k in ("advantages", "rollout_logp", "seq_ids")})
        if self.cfg.pos_lm_coef > 0:  # the correct samples' response tokens (the positive-example LM loss)
            batch.extra["positive"] = (t["seq_ids"] >= 0).float() * torch.tensor(correct, dtype=torch.float32)[:, None]
        if self.cfg.router_replay:  # every fed token's expert choices; the last token, never fed, routes afresh
            moes, k = len(self.model.moe_layers()), self.model.cfg.num_experts_per_tok
            routes = torch.full((m, width, moes, k), -1, dtype=torch.long)
            for i, r in enumerate(rows):
                fed = torch.cat(r.routes)[:width]
                routes[i, :len(fed)] = fed
            batch.extra["routes"] = routes
        batch.extra["old_logp"] = self._logprobs(self.model, batch)
        if self.cfg.kl_beta > 0:
            batch.extra["ref_logp"] = self._logprobs(self.ref_model, batch)
        return batch

    @torch.no_grad()
    def _logprobs(self, model, batch: RolloutBatch) -> torch.Tensor:
        """Each response token's log-probability under ``model``'s training forward (no gradient), micro-batch by
        micro-batch; the expert load this forward counted is dropped (it is not an update's)."""
        out = torch.zeros(batch.labels.shape)
        device = next(model.parameters()).device
        autocast = torch.autocast(device.type, dtype=torch.bfloat16) if self.cfg.dtype == "bf16" else nullcontext()
        for s in range(0, len(batch), self.cfg.batch_size):
            idx = torch.arange(s, min(s + self.cfg.batch_size, len(batch)))
            b = {k: v.to(device) for k, v in Packed.batch(batch, idx).items()}
            replay = b.get("routes") if model is self.model else None  # (the reference routes afresh, as verl)
            with autocast, router_replay(model, replay):
                logp, _ = token_logprobs(model, b, self.cfg.temperature)
            out[idx] = logp.float().cpu()
        discard_expert_load(model)
        return out

    def _mismatch(self) -> dict[str, float]:
        """How far the training forward's log-probabilities are from the decoder's for the same tokens."""
        mask = self.current.labels != IGNORE
        diff = (self.current.extra["old_logp"] - self.current.extra["rollout_logp"]).abs()[mask]
        if diff.numel() == 0:
            return {}
        return {"logp_mismatch_mean": float(diff.mean()), "logp_mismatch_max": float(diff.max())}
