import pytest
import torch

from kernels import get
from kernels.router import route, route_npu, route_reference, route_triton, select_experts
from tests.kernels.conftest import assert_close, case_generator

VOCAB = 50


def _moe(kind: str, scoring: str, dtype: torch.dtype, case, e: int = 8, k: int = 3):
    """The model's MoE layer with random weights and a non-zero expert bias."""
    from tests.trainer.helpers import TINY
    from trainer.models.deepseek_v4.args import ModelArgs
    from trainer.models.deepseek_v4.model import MoE

    cfg = ModelArgs(**{**TINY, "n_routed_experts": e, "num_experts_per_tok": k, "scoring_func": scoring,
                         "swiglu_limit": 1.5})
    moe = MoE(cfg, kind, VOCAB)
    g = case_generator(*case)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        moe.expert_bias.copy_(torch.randn(e, generator=g) * 0.2)
        if moe.hash:
            moe.tid2eid.copy_(torch.rand(VOCAB, e, generator=g).argsort(-1)[:, :k])
    return moe.to(dtype), cfg, g


@pytest.mark.parametrize("scoring", ["sigmoid", "softmax", "sqrtsoftplus"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["moe", "hash_moe"])
def test_route_is_the_models(scoring, dtype, kind):
    moe, cfg, g = _moe(kind, scoring, dtype, ("route", scoring, dtype, kind))
    x = torch.randn(29, cfg.hidden_size, generator=g).to(dtype).requires_grad_()
    ids = torch.randint(0, VOCAB, (29,), generator=g)
    idx_m, w_m = moe.route(x, ids if moe.hash else None)
    logits = moe.gate(x)
    w, idx, scores = route(logits, moe.expert_bias, cfg.num_experts_per_tok, scoring, cfg.routed_scaling_factor,
                           indices_nk=moe.tid2eid[ids] if moe.hash else None)
    assert torch.equal(idx, idx_m) and idx.dtype == torch.int64
    assert torch.equal(w, w_m)
    assert torch.equal(scores, moe.scores(x))
    gw = torch.randn(w.shape, generator=g).to(dtype)
    (dx_m,) = torch.autograd.grad(w_m, x, gw)
    (dx,) = torch.autograd.grad(w, x, gw)
    assert torch.equal(dx, dx_m)


def test_bias_steers_selection_only():
    g = case_generator("bias")
    logits = torch.randn(40, 6, generator=g)
    bias = torch.zeros(6)
    bias[4] = 10.0  # expert 4 always chosen, yet its weight is its unbiased score
    w, idx, scores = route(logits, bias, 2, "sigmoid", 2.5)
    assert (idx == 4).any(-1).all()
    raw = scores.gather(1, idx)
    torch.testing.assert_close(w, raw / raw.sum(-1, keepdim=True) * 2.5)
    w_nonorm, idx2, _ = route(logits, bias, 2, "sigmoid", 2.5, norm_topk=False)
    assert torch.equal(idx2, idx)
    torch.testing.assert_close(w_nonorm, raw * 2.5)


def _group_limited_brute(biased, k, n_groups, topk_groups):
    n, e = biased.shape
    per = e // n_groups
    out = []
    for row in biased.tolist():
        groups = [row[i * per:(i + 1) * per] for i in range(n_groups)]
        gscore = [sum(sorted(gr, reverse=True)[:2]) if per >= 2 else max(gr) for gr in groups]
        keep = sorted(range(n_groups), key=lambda i: -gscore[i])[:topk_groups]
        allowed = [j for i in keep for j in range(i * per, (i + 1) * per)]
        out.append(sorted(sorted(allowed, key=lambda j: -row[j])[:k]))
    return torch.tensor(out)


@pytest.mark.parametrize("e,n_groups,topk_groups,k", [(16, 4, 2, 4), (12, 3, 1, 2), (6, 6, 3, 3), (8, 1, 1, 8)])
def test_group_limited_topk(e, n_groups, topk_groups, k):
    g = case_generator("groups", e, n_groups, topk_groups, k)
    logits = torch.randn(23, e, generator=g, dtype=torch.float64)
    bias = torch.randn(e, generator=g, dtype=torch.float64) * 0.1
    w, idx, scores = route(logits, bias, k, "sigmoid", 1.0, n_groups=n_groups, topk_groups=topk_groups)
    expect = _group_limited_brute(scores + bias, k, n_groups, topk_groups)
    assert torch.equal(idx.sort(-1).values, expect)
    torch.testing.assert_close(w.sum(-1), torch.ones(23, dtype=torch.float64))


def test_select_experts_masks_other_groups():
    biased = torch.tensor([[9.0, 8.0, 0.0, 0.1, 7.0, 7.5]])  # groups of 2: scores 17, 0.1, 14.5
    assert sorted(select_experts(biased, 3, n_groups=3, topk_groups=2)[0].tolist()) == [0, 1, 5]


@pytest.mark.parametrize("kw", [dict(scoring="tanh"), dict(n_groups=3), dict(topk_groups=3, n_groups=2),
                                dict(k=5, n_groups=4, topk_groups=1)])
def test_route_validates(kw):
    args = dict(k=2, scoring="sigmoid", n_groups=1, topk_groups=1) | kw
    with pytest.raises(ValueError):
        route(torch.randn(3, 8), None, args["k"], args["scoring"], 1.0, n_groups=args["n_groups"],
              topk_groups=args["topk_groups"])


def test_registry_and_npu_fallback_without_torch_npu():
    assert get("router", "cpu") is route_reference
    g = case_generator("npu")
    logits = torch.randn(5, 8, generator=g)
    # sqrtsoftplus is not an npu_moe_gating_top_k norm_type: the NPU backend must not even import torch_npu
    expect = route_reference(logits, None, 2, "sqrtsoftplus", 1.5)
    for a, b in zip(route_npu(logits, None, 2, "sqrtsoftplus", 1.5), expect):
        assert_close(a, b, torch.float32)


def _by_index(idx, *ts):
    """Rows reordered by expert index (backends may list a token's experts in another order)."""
    order = idx.argsort(-1)
    return [t.gather(1, order) for t in (idx, *ts)]


@pytest.mark.parametrize("scoring", ["sigmoid", "softmax", "sqrtsoftplus"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,e,k,hashed,bias,norm", [(29, 7, 2, False, True, True), (70, 33, 6, False, False, True),
                                                     (5, 130, 3, False, True, False), (17, 16, 4, True, True, True)])
def test_triton_matches_reference(triton_device, scoring, dtype, n, e, k, hashed, bias, norm):
    g = case_generator("route-triton", scoring, dtype, n, e, k, hashed)
    logits = (torch.randn(n, e, generator=g) * 2).to(dtype)
    bias_e = torch.randn(e, generator=g) * 0.3 if bias else None
    given = torch.rand(n, e, generator=g).argsort(-1)[:, :k] if hashed else None
    g_ne, gs = torch.randn(n, e, generator=g).to(dtype), torch.randn(n, e, generator=g).to(dtype)
    x_ref, x_tri = logits.clone().requires_grad_(), logits.to(triton_device).requires_grad_()
    w_r, i_r, s_r = route_reference(x_ref, bias_e, k, scoring, 1.7, norm, indices_nk=given)
    w_t, i_t, s_t = route_triton(x_tri, None if bias_e is None else bias_e.to(triton_device), k, scoring, 1.7, norm,
                                 indices_nk=None if given is None else given.to(triton_device))
    assert i_t.dtype == torch.int64 and w_t.dtype == dtype and s_t.dtype == dtype
    i_t = i_t.cpu()
    assert_close(s_t.cpu(), s_r, dtype)
    # exact ties (frequent among bf16 scores) may be broken differently: then the picks must be as good
    same = (_by_index(i_t)[0] == _by_index(i_r)[0]).all(-1)
    biased = s_r.float() + (0 if bias_e is None else bias_e)
    assert torch.equal(biased.gather(1, i_t).sort(-1).values, biased.gather(1, i_r).sort(-1).values)
    assert same.float().mean() >= (1.0 if dtype == torch.float32 else 0.8), f"{int((~same).sum())} of {n} differ"
    assert_close(_by_index(i_t, w_t.cpu())[1][same], _by_index(i_r, w_r)[1][same], dtype)
    # the same upstream gradient for each (token, expert) pair, whatever order a backend lists them in
    (d_ref,) = torch.autograd.grad([w_r, s_r], x_ref, [g_ne.gather(1, i_r), gs])
    (d_tri,) = torch.autograd.grad([w_t, s_t], x_tri, [g_ne.gather(1, i_t).to(triton_device), gs.to(triton_device)])
    assert_close(d_tri.cpu()[same], d_ref[same], dtype)


def test_triton_group_limited_runs_the_reference(triton_device):
    g = case_generator("route-groups")
    logits = torch.randn(9, 16, generator=g)
    expect = route_reference(logits, None, 4, "sigmoid", 1.0, n_groups=4, topk_groups=2)
    got = route_triton(logits.to(triton_device), None, 4, "sigmoid", 1.0, n_groups=4, topk_groups=2)
    # the same experts and weights; torch.topk on CUDA may list a token's experts in another order than on CPU
    i_g, w_g = _by_index(got[1].cpu(), got[0].cpu())
    i_e, w_e = _by_index(expect[1], expect[0])
    assert torch.equal(i_g, i_e)
    torch.testing.assert_close(w_g, w_e)
