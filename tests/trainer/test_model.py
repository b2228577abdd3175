import pytest
import torch

from tests.trainer.helpers import tiny_model
from trainer.generate import generate


@pytest.mark.parametrize("scoring", ["sigmoid", "softmax", "sqrtsoftplus"])
def test_forward_shapes_and_backward(scoring):
    m = tiny_model(scoring_func=scoring, mtp_layers=1)
    ids = torch.randint(0, 97, (3, 21))
    logits, mtp = m.forward_train(ids)
    assert logits.shape == (3, 21, 97) and torch.isfinite(logits).all()
    assert len(mtp) == 1 and mtp[0].shape == (3, 20, 97)
    (logits.sum() + mtp[0].sum()).backward()
    # the lightning indexer only selects entries (a discrete top-k): as in transformers, the LM loss gives it
    # no gradient; everything else must get one
    missing = [n for n, p in m.named_parameters() if p.grad is None and ".indexer." not in n]
    assert not missing, missing


def test_batched_generation_equals_one_by_one_and_sampling_is_seeded():
    m = tiny_model(seed=3, index_topk=16)  # no indexer top-k ties (see test_hf_parity)
    prompts = [[5, 6, 7, 8, 9, 10, 3, 4, 5, 6, 7], [11, 12], [13, 14, 15, 16, 17]]
    batched = generate(m, prompts, 20, end_ids={0}, pad_id=1)
    single = [generate(m, [p], 20, end_ids={0}, pad_id=1)[0] for p in prompts]
    assert batched == single and all(len(o) > 0 for o in batched)
    sampled = generate(m, prompts, 10, end_ids={0}, pad_id=1, temperature=0.8, top_p=0.9, seed=1)
    assert sampled == generate(m, prompts, 10, end_ids={0}, pad_id=1, temperature=0.8, top_p=0.9, seed=1)
    # greedy decoding equals arg-max of the full forward, token by token
    seq = prompts[0] + batched[0]
    with torch.no_grad():
        full = m(torch.tensor([seq]))[0]
    assert full[len(prompts[0]) - 1:-1].argmax(-1).tolist() == batched[0]


def test_stop_callback_ends_a_row():
    m = tiny_model(seed=3)
    free = generate(m, [[5, 6, 7]], 12, end_ids=set(), pad_id=1)[0]
    stopped = generate(m, [[5, 6, 7]], 12, end_ids=set(), pad_id=1, stop=lambda ids: len(ids) >= 4)[0]
    assert stopped == free[:4]


def test_moe_routing_and_aux_free_bias_update():
    m = tiny_model()
    moe = m.moe_layers()[1]  # a top-k layer (layer 0 is hash-routed)
    x = torch.randn(50, 32)
    idx, w = moe.route(x, None)
    assert idx.shape == (50, 2) and torch.allclose(w.sum(-1), torch.full((50,), m.cfg.routed_scaling_factor))
    hash_moe = m.moe_layers()[0]
    ids = torch.randint(0, 97, (50,))
    hidx, _ = hash_moe.route(x, ids)
    assert torch.equal(hidx, hash_moe.tid2eid[ids])  # hash routing: a fixed expert set per token id
    m.train()
    m(torch.randint(0, 97, (4, 16)))
    assert moe.load_e.sum() == 4 * 16 * 2
    load = moe.load_e.clone()
    stats = m.update_expert_bias()
    assert "moe1_max_over_mean" in stats and "moe1_entropy" in stats and moe.load_e.sum() == 0
    expected = m.cfg.bias_update_rate * torch.sign(load.mean() - load)
    torch.testing.assert_close(moe.expert_bias, expected)
    assert torch.count_nonzero(hash_moe.expert_bias) == 0


def test_param_count_active_less_than_total():
    c = tiny_model().num_params()
    assert c["active"] < c["total"]


@pytest.mark.parametrize("kind", ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"])
@pytest.mark.parametrize("offset,query_block", [(5, 128), (8, 128), (13, 128), (13, 4)])
def test_a_packed_document_is_computed_as_if_alone(kind, offset, query_block, monkeypatch):
    """Positions restart and compressed blocks align at every document start, so packing changes nothing:
    logits, MTP logits and the gradients of a document's loss equal those of the document alone. (The
    indexer keeps every entry here: its top-k, like transformers', breaks exact score ties arbitrarily.)"""
    import trainer.models.deepseek_v4.cpu_attention as model_mod

    monkeypatch.setattr(model_mod, "CPU_QUERY_BLOCK", query_block)  # 4: blocked CPU attention across documents
    m = tiny_model(layer_types=[kind] * 3, mtp_layers=1, sliding_window=64, index_topk=64)
    g = torch.Generator().manual_seed(offset)
    a, b, c = (torch.randint(0, 97, (1, n), generator=g) for n in (offset, 29, 11))
    ids = torch.cat([a, b, c], 1)
    doc = torch.cat([torch.full_like(a, 0), torch.full_like(b, 1), torch.full_like(c, 2)], 1)
    logits, mtp = m.forward_train(ids, doc)
    alone, alone_mtp = m.forward_train(b, torch.zeros_like(b))
    torch.testing.assert_close(logits[:, offset:offset + 29], alone, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mtp[0][:, offset:offset + 28], alone_mtp[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits[:, offset + 29:], m(c), rtol=1e-5, atol=1e-5)
    logits[:, offset:offset + 29].logsumexp(-1).sum().backward()
    packed_grads = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    m.zero_grad()
    alone.logsumexp(-1).sum().backward()
    for n, p in m.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(packed_grads[n], p.grad, rtol=1e-4, atol=1e-6, msg=n)


def test_the_layers_of_a_forward_share_one_mask_per_kind(monkeypatch):
    """The masks of a packed forward are built once and shared by its layers (equal to building them per layer);
    the next forward (a new packing) builds its own."""
    from trainer.models.deepseek_v4 import packing as packing_mod

    built = []
    real = packing_mod.local_mask

    def counting(*args, **kwargs):
        built.append(args[1:3])
        return real(*args, **kwargs)

    monkeypatch.setattr(packing_mod, "local_mask", counting)
    m = tiny_model(layer_types=["sliding_attention", "heavily_compressed_attention", "sliding_attention"],
                   mtp_layers=1)
    ids = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(0))
    doc = (torch.arange(24) >= 10).long().expand(2, 24)
    logits, _ = m.forward_train(ids, doc)
    assert len(built) == 2  # one for the trunk's three layers, one for the MTP block (its own, shorter packing)
    monkeypatch.setattr(packing_mod.Packing, "_memo", lambda self, key, build: build())  # every layer its own
    unshared, _ = m.forward_train(ids, doc)
    assert len(built) == 2 + (2 + 4)  # (build_masks' two eager builds, then one per attention layer)
    assert torch.equal(logits, unshared)


def test_compiled_code_reads_the_masks_built_before_it(monkeypatch):
    """``Packing.build_masks`` builds the shared masks eagerly; traced code then reads them (compiled CPU code
    writes bool tensors element by element) and builds, without storing, only a mask not built before."""
    from trainer.models.deepseek_v4.packing import Packing

    doc = (torch.arange(24) >= 10).long().expand(2, 24)
    pos = torch.arange(24).expand(2, 24)
    packing = Packing(doc, rates=(4,))
    packing.build_masks(pos, window=8)
    assert set(packing._masks) == {("local", 24, 8), ("window", 4), ("window_bias", 4)}
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert packing.local_mask(pos, 24, 8) is packing._masks[("local", 24, 8)]
    assert packing.window_mask(4) is packing._masks[("window", 4)]
    bias = packing.window_bias(4)  # the indexer's additive form: 0 visible, -inf hidden, float32
    assert bias is packing._masks[("window_bias", 4)] and bias.dtype == torch.float32
    assert torch.equal(bias == 0, packing.window_mask(4)) and torch.isneginf(bias[~packing.window_mask(4)]).all()
    wider = packing.local_mask(pos, 24, 12)
    assert ("local", 24, 12) not in packing._masks and wider.sum() > packing._masks[("local", 24, 8)].sum()


@pytest.mark.parametrize("autocast", [False, True])
def test_grouped_output_projection_equals_the_batched_product(autocast):
    """``grouped_out_proj`` (one ``mm`` per group for 16-bit CPU tensors, ``einsum`` otherwise) computes
    ``[B, T, G, in] x [G, in, r]`` as the batched product does, forward and backward, on odd shapes."""
    from trainer.models.deepseek_v4.attention import grouped_out_proj

    torch.manual_seed(0)
    x = torch.randn(3, 7, 3, 10, requires_grad=True)
    w = torch.randn(3, 10, 5, requires_grad=True)
    go = torch.randn(3, 7, 15)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        got = grouped_out_proj(x, w)
        want = torch.einsum("btgi,gir->btgr", x, w).flatten(2)
    assert got.shape == want.shape == (3, 7, 15) and got.dtype == want.dtype
    tol = {"rtol": 2e-2, "atol": 2e-2} if autocast else {"rtol": 1e-5, "atol": 1e-5}
    torch.testing.assert_close(got.float(), want.float(), **tol)
    gx, gw = torch.autograd.grad(got, (x, w), go.to(got.dtype))
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        ref = torch.einsum("btgi,gir->btgr", x2, w2).flatten(2)
    rx, rw = torch.autograd.grad(ref, (x2, w2), go.to(ref.dtype))
    torch.testing.assert_close(gx, rx, **tol)
    torch.testing.assert_close(gw, rw, **tol)


def test_the_group_products_backward_is_autograds_bit_for_bit():
    """``_GroupMMs`` (16-bit CPU: one ``mm`` per group, the input's gradient written as one ``cat``) against
    autograd through the same per-group products: the same values and gradients, bit for bit, in bf16."""
    from trainer.models.deepseek_v4.attention import _GroupMMs

    torch.manual_seed(1)
    x = torch.randn(37, 3, 10, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(3, 10, 6, dtype=torch.bfloat16, requires_grad=True)
    go = torch.randn(37, 18, dtype=torch.bfloat16)
    got = _GroupMMs.apply(x, w)
    gx, gw = torch.autograd.grad(got, (x, w), go)
    want = torch.cat([x[:, k] @ w[k] for k in range(3)], dim=-1)
    rx, rw = torch.autograd.grad(want, (x, w), go)
    assert torch.equal(got, want) and torch.equal(gx, rx) and torch.equal(gw, rw)


def _indexer_kl_definition(scores_btw, attn_btw, allowed_btw):
    """KL(target || softmax of the selected scores) summed over queries, with bool masks (the code before
    2026-12-05): masked fills, a NaN row of nothing selected zeroed."""
    target = attn_btw.float().masked_fill(~allowed_btw, 0.0)
    total = target.sum(-1, keepdim=True)
    target = target / total.masked_fill(total == 0, 1.0)
    logp = torch.log_softmax(scores_btw.float().masked_fill(~allowed_btw, float("-inf")), dim=-1)
    return (torch.xlogy(target, target) - target * logp.masked_fill(~allowed_btw, 0.0)).sum()


@pytest.mark.parametrize("mask_dtype", [torch.float32, torch.bool])
def test_indexer_kl_with_a_float_selection_is_the_masked_definition(mask_dtype):
    """``indexer_kl`` takes the selection as 0/1 floats (or bools): value and score gradient of the definition,
    a query that selected nothing and one whose heads put no weight on its selection adding nothing."""
    from trainer.models.deepseek_v4.attention import indexer_kl

    g = torch.Generator().manual_seed(3)
    scores = torch.randn(2, 9, 11, generator=g)
    attn = torch.rand(2, 9, 11, generator=g)
    chosen = torch.rand(2, 9, 11, generator=g) > 0.5
    chosen[0, 2] = False
    attn[1, 4] = attn[1, 4] * ~chosen[1, 4]  # weight only outside the selection
    scores = scores.masked_fill(torch.rand(2, 9, 11, generator=g) > 0.8, float("-inf"))  # not visible
    chosen = chosen & (scores > float("-inf"))  # (the indexer selects only visible entries)
    s_new, s_ref = (scores.clone().requires_grad_() for _ in range(2))
    got = indexer_kl(s_new, attn, chosen.to(mask_dtype))
    want = _indexer_kl_definition(s_ref, attn, chosen)
    got.backward()
    want.backward()
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(s_new.grad, s_ref.grad)
    assert torch.isfinite(s_new.grad).all() and s_new.grad[0, 2].abs().sum() == 0


def test_softmax_over_the_selection_is_the_masked_softmax():
    """``softmax_over``: each head's softmax over its query's selected entries (float selection), 0 elsewhere
    and over a query that selected nothing -- the masked softmax with NaN rows zeroed."""
    from trainer.models.deepseek_v4.attention import softmax_over

    g = torch.Generator().manual_seed(4)
    logits = torch.randn(2, 3, 7, 10, generator=g).bfloat16()
    chosen = torch.rand(2, 7, 10, generator=g) > 0.6
    chosen[1, 5] = False
    want = logits.float().masked_fill(~chosen[:, None], float("-inf")).softmax(-1).nan_to_num(0.0)
    got = softmax_over(logits, chosen.float())
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert got[1, :, 5].abs().sum() == 0


_SHARD_OF_COMPILED = r"""
import os, sys, tempfile
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from trainer.models.deepseek_v4.layers import shard_of
dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tempfile.mkdtemp(), "s"), 1), rank=0, world_size=1)
try:
    w = torch.nn.Parameter(distribute_tensor(torch.randn(4, 3), init_device_mesh("cpu", (1,)), [Shard(0)]))
    x = torch.randn(2, 4)
    y = torch.compile(lambda x, w: x @ shard_of(w), backend="eager", fullgraph=True)(x, w)
    assert type(y) is torch.Tensor and torch.equal(y, x @ w.to_local())
    y.sum().backward()
    assert isinstance(w.grad, DTensor) and torch.allclose(w.grad.to_local(), x.sum(0)[:, None].expand(4, 3))
finally:
    dist.destroy_process_group()
print("ok")
"""


def test_shard_of_takes_the_local_shard_of_a_dtensor_parameter_under_compile():
    """Tensor-parallel parameters are DTensors and the model's math runs on their local shards (``shard_of``):
    under torch.compile too -- a ``hasattr(t, "to_local")`` test came out False while dynamo traced, and compiled
    TP training failed on mixed Tensor / DTensor products. (A subprocess: the process group stays out of this one.)"""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, "-c", _SHARD_OF_COMPILED], cwd=root, capture_output=True, text=True,
                       timeout=300, env={**__import__("os").environ, "PYTHONPATH": str(root)})
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]
