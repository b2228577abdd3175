"""The GRPO objective (against the hand-computed vectors of ../shared/reference/grpo-for-moe.md and a hand-computed
loss on a tiny batch) and the RL stage's rollout source in the training core: dropped groups, exact resume."""

from __future__ import annotations

import math

import pytest
import torch

from tests.trainer.helpers import tiny_model
from trainer.data import IGNORE
from trainer.rl import (GRPOObjective, aggregate, clipped_surrogate, grpo_objective, group_advantages, kl_k3,
                        overlong_penalty, policy_parameters, router_replay, token_logprobs)
from trainer.rollout import RLPrompt, RolloutSource
from trex.core.config import RLConfig


# -------------------------------------------------------------------------------------------- the math
def test_group_advantages_match_the_reference_vectors():
    adv, flat = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), 4)
    assert torch.allclose(adv, torch.tensor([0.866024, -0.866024, -0.866024, 0.866024]), atol=1e-6)
    assert not flat.any()
    adv, _ = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), 4, norm_std=False)  # Dr.GRPO
    assert adv.tolist() == [0.5, -0.5, -0.5, 0.5]
    adv, flat = group_advantages(torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0]), 4)
    assert flat.tolist() == [True, False] and adv[:4].tolist() == [0.0] * 4 and adv[4:].abs().min() > 0
    adv, _ = group_advantages(torch.tensor([1.0, 0.0]), 1)  # a group of one: A = r (verl)
    assert adv.tolist() == [1.0, 0.0]


def test_both_clips_and_the_dual_clip():
    def loss(ratio, a, c=None):
        logp = torch.tensor([math.log(ratio)], requires_grad=True)
        out, flags = clipped_surrogate(logp, torch.zeros(1), torch.tensor([a]), 0.2, 0.28, c)
        out.sum().backward()
        return float(out.detach()), float(logp.grad), {k: bool(v) for k, v in flags.items() if k != "ratio"}

    value, grad, flags = loss(1.4, 1.0)  # clip-higher: the clipped branch wins, no gradient
    assert (value, grad, flags) == (pytest.approx(-1.28), 0.0, {"low": False, "high": True})
    assert loss(1.1, 1.0)[0] == pytest.approx(-1.1) and loss(1.1, 1.0)[1] != 0.0  # unclipped: gradient flows
    value, grad, flags = loss(0.7, -1.0)
    assert (value, grad, flags) == (pytest.approx(0.8), 0.0, {"low": True, "high": False})
    assert loss(4.0, -1.0)[0] == pytest.approx(4.0)  # no dual-clip
    value, grad, flags = loss(4.0, -1.0, c=3.0)
    assert (value, grad, flags["dual"]) == (pytest.approx(3.0), 0.0, True)
    assert loss(0.7, -1.0, c=3.0)[2]["dual"] is False  # -A c = 3 > 0.8: the dual clip does not fire


def test_aggregations_overlong_and_kl():
    loss = torch.tensor([[1.0, 3.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    seq = torch.tensor([[0, 0, -1, -1], [1, 1, 1, 1]])
    expect = {"token-mean": 8 / 6, "seq-mean-token-sum": 4.0, "seq-mean-token-mean": 1.5, "seq-mean-token-sum-norm": 1.0}
    for mode, value in expect.items():
        total, count = aggregate(loss, mask, seq, mode, max_len=4)
        assert float(total) / count == pytest.approx(value), mode
    assert overlong_penalty(18432, 20480, 4096, 1.0) == pytest.approx(-0.5)
    assert overlong_penalty(16384, 20480, 4096, 1.0) == 0.0 and overlong_penalty(20480, 20480, 4096, 1.0) == -1.0
    assert overlong_penalty(20480, 20480, 0, 1.0) == 0.0
    assert float(kl_k3(torch.tensor(-1.0), torch.tensor(-1.0))) == 0.0
    d = 0.3
    assert float(kl_k3(torch.tensor(0.0), torch.tensor(d))) == pytest.approx(math.exp(d) - d - 1)


def _rl_batch(model, seq_len=12):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 97, (2, seq_len), generator=g)
    labels = torch.full_like(ids, IGNORE)
    labels[0, 4:9], labels[1, 2:11] = ids[0, 5:10], ids[1, 3:12]
    seq = torch.where(labels != IGNORE, torch.tensor([[0], [1]]), torch.tensor(-1))
    adv = torch.where(labels != IGNORE, torch.tensor([[1.5], [-0.5]]), torch.tensor(0.0))
    batch = {"input_ids": ids, "labels": labels, "doc_ids": torch.zeros_like(ids),
             "position_ids": torch.arange(seq_len).expand(2, -1), "advantages": adv, "seq_ids": seq}
    with torch.no_grad():
        logp, _ = token_logprobs(model, batch)
    return batch, logp


def test_the_objective_equals_a_hand_computed_grpo_loss():
    """Old log-probabilities shifted by known amounts per token: the loss is the clipped surrogate computed by hand
    from the model's own log-probabilities, token-mean and seq-mean-token-mean, with and without the KL term."""
    torch.manual_seed(0)
    model = tiny_model(seed=1).train()
    batch, logp = _rl_batch(model)
    mask = batch["labels"] != IGNORE
    shift = torch.linspace(0.5, -0.5, logp.numel()).view_as(logp)  # both clips fire somewhere
    batch["old_logp"] = (logp - shift) * mask  # ratio = exp(shift)
    batch["ref_logp"] = (logp + 0.1) * mask
    by_hand = []
    for i in range(2):
        for t in range(logp.shape[1]):
            if mask[i, t]:
                r, a = math.exp(float(shift[i, t])), float(batch["advantages"][i, t])
                tok = max(-a * r, -a * min(max(r, 0.8), 1.28))
                by_hand.append((i, tok + 0.05 * (math.exp(0.1) - 0.1 - 1)))
    cfg = RLConfig(clip_low=0.2, clip_high=0.28, kl_beta=0.05)
    total, count, stats = grpo_objective(model, batch, cfg)
    total = total - model.cfg.indexer_loss_weight * model.indexer_loss()  # (the indexers' own loss rides along)
    assert float(total.detach()) / count == pytest.approx(sum(v for _, v in by_hand) / len(by_hand), rel=1e-5)
    assert stats["tokens"] == len(by_hand) and stats["clip_low"] > 0 and stats["clip_high"] > 0
    cfg = RLConfig(clip_low=0.2, clip_high=0.28, kl_beta=0.05, loss_agg="seq-mean-token-mean")
    total, count, _ = grpo_objective(model, batch, cfg)
    total = total - model.cfg.indexer_loss_weight * model.indexer_loss()
    per_seq = [sum(v for j, v in by_hand if j == i) / sum(j == i for j, _ in by_hand) for i in (0, 1)]
    assert (float(total.detach()) / count, count) == (pytest.approx(sum(per_seq) / 2, rel=1e-5), 2)
    assert GRPOObjective(cfg).normaliser([batch]) == (2, 0)


def test_the_positive_example_lm_loss_adds_the_correct_samples_nll():
    """``pos_lm_coef`` (VAPO): the token-mean loss gains ``coef x -logp`` on the response tokens marked positive, and
    the gradient of the positive row's tokens moves by that NLL's."""
    torch.manual_seed(0)
    model = tiny_model(seed=1).train()
    batch, logp = _rl_batch(model)
    mask = batch["labels"] != IGNORE
    batch["old_logp"] = logp * mask
    batch["positive"] = mask.float() * torch.tensor([[1.0], [0.0]])  # row 0 was correct
    plain, count, _ = grpo_objective(model, batch, RLConfig())
    with_nll, count2, _ = grpo_objective(model, batch, RLConfig(pos_lm_coef=0.1))
    assert count == count2 == int(mask.sum())
    nll = float(-(logp * batch["positive"]).sum())
    assert float(with_nll - plain) / count == pytest.approx(0.1 * nll / count, rel=1e-5)


# ------------------------------------------------------------------------------------- the rollout source
def _parity_reward(rows, texts):
    """A deterministic stand-in for the sandbox: 1 when the completion's token ids sum to an even number."""
    even = [sum(int(x) for x in t.split(",") if x) % 2 == 0 for t in texts]
    return [{"reward": float(e), "correct": e} for e in even]


def _source(model, cfg, seed=0, reward=_parity_reward):
    prompts = [RLPrompt([1 + i, 5, 7 + i], {"id": i}) for i in range(6)]
    return RolloutSource(model, prompts, reward, cfg, end_ids={0}, pad_id=96,
                         decode=lambda ids: ",".join(map(str, ids)), seed=seed)


def test_a_rollout_marks_the_correct_samples_response_tokens_positive():
    model = tiny_model(seed=2).train()
    cfg = RLConfig(group_size=4, prompts_per_rollout=3, max_new_tokens=6, batch_size=4, pos_lm_coef=0.1,
                   drop_equal_groups=False)
    data, _ = _source(model, cfg).batch(0)
    pos, resp = data.extra["positive"], data.labels != IGNORE
    for i in range(len(data)):
        tokens = data.input_ids[i][data.doc_ids[i] >= 0].tolist()
        response = data.labels[i][resp[i]].tolist()[:-1] if data.labels[i][resp[i]][-1] == 0 else \
            data.labels[i][resp[i]].tolist()
        correct = _parity_reward([None], [",".join(map(str, response))])[0]["correct"]
        assert torch.equal(pos[i], resp[i].float() * float(correct)), (i, tokens)
    assert 0 < float(pos.sum()) < float(resp.sum())  # (the stand-in reward marked some rows correct, not all)
    assert "positive" not in _source(model, RLConfig(group_size=4, prompts_per_rollout=3, max_new_tokens=6,
                                                     batch_size=4)).batch(0)[0].extra


def test_a_rollout_counts_and_drops_uniform_groups():
    model = tiny_model(seed=2).train()
    cfg = RLConfig(group_size=4, prompts_per_rollout=3, max_new_tokens=6, batch_size=4, minibatches=2)
    src = _source(model, cfg)
    data, idx = src.batch(0)
    assert src.stats["groups"] == 3 and len(data) == 4 * (3 - src.stats["dropped_groups"])
    assert len(idx) == math.ceil(len(data) / 2)
    mask = data.labels != IGNORE
    assert (data.extra["seq_ids"][mask] >= 0).all() and (data.extra["advantages"][~mask] == 0).all()
    # the training forward's log-probabilities of the sampled tokens agree with the decoder's
    assert src.stats["logp_mismatch_max"] < 1e-4
    always = _source(model, cfg, reward=lambda rows, texts: [{"reward": 1.0} for _ in texts])
    data, _ = always.batch(0)
    assert always.stats["dropped_groups"] == 3 and float(data.extra["advantages"].abs().sum()) == 0.0


def test_replay_takes_learnable_prompts_again():
    """``replay``: prompts whose group had unequal rewards come back in the next rollouts (oldest first, half of the
    rollout's prompts at 0.5), uniform ones never; the rest are new from the seeded order."""
    model = tiny_model(seed=2).train()
    cfg = RLConfig(group_size=4, prompts_per_rollout=4, max_new_tokens=6, batch_size=4, replay=0.5)
    seen: list[list[int]] = []

    def reward(rows, texts):  # odd ids: always right (uniform); even ids: by parity (mixed, mostly)
        seen.append([r["id"] for r in rows[::4]])
        return [{"reward": 1.0 if r["id"] % 2 else float(e["reward"])} for r, e in zip(rows, _parity_reward(rows, texts))]

    src = RolloutSource(model, [RLPrompt([1 + i, 5, 7 + i], {"id": i}) for i in range(12)], reward, cfg, end_ids={0},
                        pad_id=96, decode=lambda ids: ",".join(map(str, ids)), seed=0)
    pools = []
    for k in range(4):
        src.batch(k)
        pools.append(list(src.replay))
        assert all(i % 2 == 0 for i in src.replay) and len(set(seen[-1])) == 4
        if k:
            want = [i for i in pools[k - 1]][:2]  # the two oldest learnable prompts, taken again
            assert seen[-1][:len(want)] == want and src.stats["replayed_prompts"] == len(want)
    assert sum(len(p) for p in pools) > 0  # (the stand-in reward made some group learnable)


@pytest.mark.parametrize("replay", [0.0, 0.5])
def test_rl_training_resumes_mid_rollout_on_the_same_trajectory(tmp_path, replay):
    """Killed after step 3 of a 2-update rollout cycle (its rollout and replay pool saved with the checkpoint), the
    run resumes and ends with the uninterrupted run's weights, bit for bit."""
    from trainer.engines import single

    cfg = RLConfig(steps=6, group_size=4, prompts_per_rollout=2, max_new_tokens=5, batch_size=8, minibatches=2,
                   lr=1e-3, ckpt_every=1, keep_last=3, log_every=1, replay=replay)

    def run(out, stop_after=None, model=None):
        torch.manual_seed(0)
        model = model or tiny_model(seed=4)
        policy_parameters(model)
        logs = []
        single.train(model, None, cfg, out, 0, on_log=lambda s, m: logs.append((s, m)), stop_after=stop_after,
                     objective=GRPOObjective(cfg), source=_source(model, cfg))
        return model, logs

    whole, logs = run(tmp_path / "a")
    assert {"reward_mean", "pass_rate", "dropped_groups", "clip_frac", "entropy", "approx_kl",
            "rollout_tokens_per_s", "update_tokens_per_s", "logp_mismatch_mean"} <= set(logs[-1][1])
    run(tmp_path / "b", stop_after=3)
    resumed, _ = run(tmp_path / "b")
    assert all(torch.equal(a, b) for a, b in zip(whole.state_dict().values(), resumed.state_dict().values()))
    assert not all(torch.equal(a, b) for a, b in zip(whole.state_dict().values(),
                                                      tiny_model(seed=4).state_dict().values()))


def test_router_replay_routes_the_update_as_the_rollout_routed():
    """The rollout records every fed token's expert choices; replayed, the training forward makes the same choices.
    After the routers drift (the expert bias moved, as updates move it), the free forward routes elsewhere and its
    log-probabilities leave the rollout's, while the replayed forward keeps them."""
    model = tiny_model(seed=5).train()
    cfg = RLConfig(group_size=2, prompts_per_rollout=3, max_new_tokens=6, batch_size=8, router_replay=True)
    src = _source(model, cfg)
    data, _ = src.batch(0)
    routes, mask = data.extra["routes"], data.labels != IGNORE
    assert routes.shape[2:] == (len(model.moe_layers()), model.cfg.num_experts_per_tok)
    assert (routes[mask] >= 0).all()  # every position that predicts a response token was routed in the rollout
    b = data.batch(torch.arange(len(data)))
    moes = model.moe_layers()
    for m in moes:
        m.record = True
    with torch.no_grad(), router_replay(model, b["routes"]):
        model.hidden(b["input_ids"], b["doc_ids"])
    for m in moes:
        m.record = False
    got, fed = torch.stack([m.recorded for m in moes], 2), routes >= 0
    assert torch.equal(got[fed], routes[fed])
    for m in moes:
        if not m.hash:
            m.expert_bias += torch.tensor([4.0, -4.0, 4.0, -4.0])
    with torch.no_grad():
        free, _ = token_logprobs(model, b)
        with router_replay(model, b["routes"]):
            replayed, _ = token_logprobs(model, b)
    rollout = data.extra["rollout_logp"]
    assert (replayed - rollout)[mask].abs().max() < 1e-4 < (free - rollout)[mask].abs().max()
