import pytest
import torch

from tests.trainer.helpers import tiny_model
from trainer.generate import generate
from trainer.models.deepseek_v4.model import KVCache, document_mask


@pytest.mark.parametrize("scoring", ["sigmoid", "softmax", "sqrtsoftplus"])
def test_forward_shapes_and_backward(scoring):
    m = tiny_model(scoring_func=scoring)
    ids = torch.randint(0, 97, (3, 11))
    logits = m(ids)
    assert logits.shape == (3, 11, 97) and torch.isfinite(logits).all()
    logits.sum().backward()
    assert all(p.grad is not None for n, p in m.named_parameters()), "every parameter gets a gradient"


def test_packed_documents_do_not_attend_across_boundaries():
    m = tiny_model().eval()
    a, b = torch.randint(0, 97, (1, 6)), torch.randint(0, 97, (1, 5))
    other = torch.randint(0, 97, (1, 6))
    doc = torch.tensor([[0] * 6 + [1] * 5])
    pos = torch.tensor([list(range(6)) + list(range(5))])
    out1 = m(torch.cat([a, b], 1), pos, document_mask(doc))
    out2 = m(torch.cat([other, b], 1), pos, document_mask(doc))
    alone = m(b)
    torch.testing.assert_close(out1[:, 6:], out2[:, 6:])
    torch.testing.assert_close(out1[:, 6:], alone, rtol=1e-5, atol=1e-5)


def test_kv_cache_matches_full_recompute():
    m = tiny_model().eval()
    ids = torch.randint(0, 97, (2, 9))
    full = m(ids)
    cache = KVCache()
    step = [m(ids[:, :5], cache=cache)]
    for t in range(5, 9):
        pos = torch.full((2, 1), t)
        step.append(m(ids[:, t:t + 1], pos, torch.ones(2, 1, 1, t + 1, dtype=torch.bool), cache))
    torch.testing.assert_close(torch.cat(step, 1), full, rtol=1e-5, atol=1e-5)


def test_batched_left_padded_generation_equals_one_by_one():
    m = tiny_model(seed=3)
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12], [13, 14, 15]]
    batched = generate(m, prompts, 10, end_ids={0}, pad_id=1)
    single = [generate(m, [p], 10, end_ids={0}, pad_id=1)[0] for p in prompts]
    assert batched == single
    sampled = generate(m, prompts, 10, end_ids={0}, pad_id=1, temperature=0.8, top_p=0.9, seed=1)
    assert sampled == generate(m, prompts, 10, end_ids={0}, pad_id=1, temperature=0.8, top_p=0.9, seed=1)


def test_moe_routing_and_aux_free_bias_update():
    m = tiny_model()
    moe = m.moe_layers()[0]
    x = torch.randn(50, 32)
    idx, w = moe.route(x)
    assert idx.shape == (50, 2) and torch.allclose(w.sum(-1), torch.ones(50))
    m.train()
    m(torch.randint(0, 97, (4, 16)))
    assert moe.load_e.sum() == 4 * 16 * 2
    load = moe.load_e.clone()
    stats = m.update_expert_bias()
    assert "moe0_max_over_mean" in stats and moe.load_e.sum() == 0
    expected = m.cfg.bias_update_rate * torch.sign(load.mean() - load)
    torch.testing.assert_close(moe.expert_bias, expected)


def test_param_count_active_less_than_total():
    c = tiny_model().num_params()
    assert c["active"] < c["total"]
