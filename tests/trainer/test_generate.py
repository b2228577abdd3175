"""The decoder's parts: batched sampling, the cache's in-place compaction, rows moving into freed slots."""

import math

import pytest
import torch

from tests.trainer.helpers import tiny_model
from trainer.generate import DecodeBatch, Row, compact_order, generate, sample_tokens
from trainer.models.deepseek_v4.packing import DecodeCache


def _gens(seeds):
    return [torch.Generator().manual_seed(s) for s in seeds]


def test_a_sampled_token_depends_on_its_row_only():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(7, 53, generator=g) * 3
    temps, top_ps, seeds = [0.7, 0.0, 1.3, 0.7, 1.0, 0.0, 0.4], [1.0, 1.0, 0.8, 0.3, 1.0, 0.5, 0.9], range(7)
    together = sample_tokens(logits, temps, top_ps, _gens(seeds)).tolist()
    alone = [int(sample_tokens(logits[j:j + 1], [temps[j]], [top_ps[j]], _gens([seeds[j]]))[0]) for j in range(7)]
    assert together == alone
    assert together[1] == int(logits[1].argmax()) and together[5] == int(logits[5].argmax())  # greedy rows


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.6, 1.0), (1.0, 0.7)])
def test_sampling_follows_the_tempered_nucleus(temperature, top_p):
    """20,000 draws of one row: the frequencies are the tempered softmax's, cut to the top-p nucleus (tokens whose
    preceding mass exceeds top_p never drawn), within 5 standard errors; greedy at temperature 0."""
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
    n = 20_000
    gens = _gens(range(1000, 1000 + n))
    drawn = sample_tokens(logits.expand(n, -1), [temperature] * n, [top_p] * n, gens)
    p = torch.softmax(logits.double() / temperature, -1)
    before = p.cumsum(-1) - p  # (logits sorted descending: the mass of the more likely tokens)
    p = torch.where(before > top_p, 0.0, p) if top_p < 1 else p
    p = p / p.sum()
    freq = torch.bincount(drawn, minlength=len(logits)).double() / n
    for k in range(len(logits)):
        if p[k] == 0:
            assert freq[k] == 0, k
        else:
            assert abs(freq[k] - p[k]) < 5 * math.sqrt(p[k] * (1 - p[k]) / n), (k, float(freq[k]), float(p[k]))


def test_sampling_draws_one_number_from_each_rows_generator():
    """Each sampled row advances its own generator by one draw (so a row's stream does not depend on the batch
    size or vocabulary), greedy rows not at all."""
    logits = torch.randn(3, 11)
    gens = _gens([1, 2, 3])
    sample_tokens(logits, [0.8, 0.0, 0.8], [1.0, 1.0, 0.5], gens)
    fresh = _gens([1, 2, 3])
    torch.rand(1, dtype=torch.float64, generator=fresh[0])
    torch.rand(1, dtype=torch.float64, generator=fresh[2])
    for got, want in zip(gens, fresh):
        assert torch.equal(got.get_state(), want.get_state())


def test_compact_order_moves_only_rows_past_the_kept_count():
    assert compact_order([0, 1, 2]) == [0, 1, 2]
    assert compact_order([0, 2, 3, 5]) == [0, 5, 2, 3]  # slot 1 freed: the last row moves in
    assert compact_order([3, 4]) == [3, 4]
    assert compact_order([1, 4, 6]) == [4, 1, 6]


@pytest.mark.parametrize("rows_b", [[0, 3, 2], [2, 0, 1, 3], [3], [1, 2, 3]])
def test_cache_keep_copies_the_moved_rows_in_place(rows_b):
    cache = DecodeCache(4, 6)
    vals = torch.arange(4 * 6 * 3, dtype=torch.float32).view(4, 6, 3)
    cache.length = 6
    cache.write("kv", torch.arange(6).expand(4, -1), vals)
    base = cache.buffers["kv"].data_ptr()
    cache.keep(torch.tensor(rows_b))
    assert cache.batch == len(rows_b) and cache.buffers["kv"].data_ptr() == base  # no new buffer
    assert torch.equal(cache.buffers["kv"], vals[rows_b])
    cache.length = 6  # writes go on into the kept rows
    cache.write("kv", torch.full((len(rows_b), 1), 5), torch.full((len(rows_b), 1, 3), -1.0))
    assert (cache.buffers["kv"][:, 5] == -1).all() and torch.equal(cache.buffers["kv"][:, :5], vals[rows_b, :5])


def test_a_row_moved_into_a_freed_slot_decodes_as_alone():
    """The first rows finish early (a stop callback), the last ones move into their slots mid-decoding: every row's
    tokens are still those it decodes alone."""
    m = tiny_model(seed=3, index_topk=16)
    prompts = [[5, 6, 7], [11, 12, 13, 14], [8, 9], [15, 16, 17, 18, 19], [20, 21, 22]]
    stops = [lambda ids: len(ids) >= 2, lambda ids: len(ids) >= 5, None, None, None]
    params = [(0.0, 1.0), (0.9, 0.9), (0.0, 1.0), (1.1, 1.0), (0.7, 0.8)]
    alone = [generate(m, [p], 14, {0}, 1, t, tp, 40 + i, stop=s)[0]
             for i, (p, (t, tp), s) in enumerate(zip(prompts, params, stops))]
    rows = [Row(p, 14, t, tp, 40 + i, stop=s) for i, (p, (t, tp), s) in enumerate(zip(prompts, params, stops))]
    batch = DecodeBatch(m, {0}, 1)
    batch.add(rows)
    order = []
    while batch.rows:
        batch.step()
        order.append([rows.index(r) for r in batch.rows])
    assert [r.tokens for r in rows] == alone
    assert any(o[:1] == [4] or o[1:2] == [4] for o in order if len(o) < 5)  # the last row took a freed slot
