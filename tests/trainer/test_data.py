"""``trainer/data.py``: packing strategies and the step -> batch order (with and without length grouping)."""

import pytest
import torch

from tests.trainer.helpers import random_docs, tiny_model, tiny_train_cfg
from trainer.data import BatchOrder, batch_indices, pack, row_lengths, trim_padding
from trainer.engines.single import train
from trainer.export import same_weights


def _rows_as_documents(p):
    """Every row's documents as (tokens, labels) lists, in row order."""
    out = []
    for r in range(len(p)):
        doc = p.doc_ids[r]
        for d in doc[doc >= 0].unique().tolist():
            sel = doc == d
            out.append((p.input_ids[r][sel].tolist(), p.labels[r][sel].tolist()))
    return out


def test_best_fit_holds_every_document_once_in_fewer_rows():
    docs = random_docs(200, seed=3) + [([7] * 40, [1] * 40)]  # one too long: truncated in both strategies
    in_order, best = pack(docs, 32, pad_id=0), pack(docs, 32, pad_id=0, strategy="best_fit")
    assert best.stats["tokens"] == in_order.stats["tokens"] and best.stats["loss_tokens"] == in_order.stats[
        "loss_tokens"]
    assert best.stats["truncated"] == in_order.stats["truncated"] == 1 and best.stats["strategy"] == "best_fit"
    assert len(best) < len(in_order) and best.stats["fill"] > in_order.stats["fill"]
    # the same documents (tokens and labels), each once, every row within seq_len
    assert sorted(_rows_as_documents(best)) == sorted(_rows_as_documents(in_order))
    assert int(row_lengths(best).max()) <= 32
    # a lower bound: no two rows could be merged
    lengths = sorted(row_lengths(best).tolist())
    assert lengths[0] + lengths[1] > 32
    again = pack(docs, 32, pad_id=0, strategy="best_fit")
    assert torch.equal(again.input_ids, best.input_ids) and torch.equal(again.doc_ids, best.doc_ids)


def test_unknown_packing_strategy_is_named():
    with pytest.raises(ValueError, match="unknown packing strategy 'zigzag'"):
        pack(random_docs(4), 32, pad_id=0, strategy="zigzag")


def test_batch_order_without_lengths_is_the_seeded_permutation_per_epoch():
    n, bs = 10, 4
    got = [batch_indices(n, bs, s, seed=3).tolist() for s in range(5)]  # 20 rows: two epochs
    perms = [torch.randperm(n, generator=torch.Generator().manual_seed(3 * 100003 + e)).tolist() for e in (0, 1)]
    assert sum(got, []) == perms[0] + perms[1]


def test_length_grouped_batches_visit_every_row_once_per_epoch_and_pad_less():
    data = pack(random_docs(400, seed=5), 20, pad_id=0)  # about one document per row, lengths 4..19
    lengths = row_lengths(data)
    n, bs = len(data), 8
    grouped, plain = BatchOrder(n, bs, 7, lengths), BatchOrder(n, bs, 7)
    steps = n // bs
    assert sorted(grouped.order(0)) == sorted(grouped.order(1)) == list(range(n))  # each epoch: every row once
    assert grouped.order(1) != grouped.order(0)
    assert torch.cat([grouped(s) for s in range(steps)]).tolist() == grouped.order(0)[:steps * bs]

    def fill(order):
        real = slots = 0
        for s in range(steps):
            b = trim_padding(data.batch(order(s)), 1)
            real, slots = real + int((b["doc_ids"] >= 0).sum()), slots + b["doc_ids"].numel()
        return real / slots

    assert fill(grouped) > 0.95 > fill(plain) + 0.1
    # a pure function of (step, seed): a new order (a resumed process) gives the same batches, any step first
    assert torch.equal(BatchOrder(n, bs, 7, lengths)(steps + 3), grouped(steps + 3))
    assert not torch.equal(BatchOrder(n, bs, 8, lengths)(0), grouped(0))
    with pytest.raises(ValueError, match="lengths has 3 entries"):
        BatchOrder(n, bs, 7, lengths[:3])


def test_grouped_training_resumes_bit_identically(tmp_path):
    data = pack(random_docs(48, seed=2), 20, pad_id=0, strategy="best_fit")
    cfg = tiny_train_cfg(steps=12, ckpt_every=4, group_by_length=True)
    straight = tiny_model()
    train(straight, data, cfg, tmp_path / "a", seed=1)
    train(tiny_model(), data, cfg, tmp_path / "b", seed=1, stop_after=8)
    resumed = tiny_model(seed=99)
    assert train(resumed, data, cfg, tmp_path / "b", seed=1).resumed_from == 8
    assert same_weights(straight, resumed)
