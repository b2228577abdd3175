"""The native DeepSeek-V4 equals transformers' DeepseekV4ForCausalLM with the same weights."""

import pytest
import torch
import torch.nn.functional as F

from tests.trainer.hf_parity_util import CONFIGS, VOCAB, from_hf, random_pair, to_hf


def _ids(seed: int, b: int = 2, t: int = 37) -> torch.Tensor:
    return torch.randint(0, VOCAB, (b, t), generator=torch.Generator().manual_seed(seed))


# the attention core's two paths (``Attention._attend``): "cpu" is ``cpu_attention.sink_attention_cpu``, by
# default in query blocks of 128 ("cpu-block8": blocks of 8 queries over only the key columns each block sees);
# "sdpa" is the portable path GPUs/NPUs take (one masked SDPA call, the sink as an extra channel), forced on CPU
PATHS = {"cpu": {}, "cpu-block8": {"CPU_QUERY_BLOCK": 8}, "sdpa": {"CPU_PATH": False}}


@pytest.fixture(params=sorted(PATHS))
def attention_path(request, monkeypatch):
    import trainer.models.deepseek_v4.cpu_attention as cpu_attention

    import trainer.models.deepseek_v4.attention as model_mod  # where Attention looks the CPU path up

    for attr, value in PATHS[request.param].items():
        monkeypatch.setattr(cpu_attention, attr, value)
    if request.param == "sdpa":  # the CPU path must not run at all
        def cpu_path_called(*args, **kwargs):
            raise AssertionError("sink_attention_cpu ran with CPU_PATH off")

        monkeypatch.setattr(model_mod, "sink_attention_cpu", cpu_path_called)
    return request.param


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logits_loss_and_gradients_match_transformers(name, attention_path):
    native, hf, cfg = random_pair(name, seed=len(name))
    ids = _ids(len(name))
    with torch.no_grad():
        a, b = native(ids), hf(input_ids=ids).logits
    assert ((a - b).abs().max() / b.abs().max()).item() <= 1e-4
    native.train(), hf.train()
    loss_a = F.cross_entropy(native(ids)[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
    loss_b = hf(input_ids=ids, labels=ids).loss
    assert abs(loss_a.item() - loss_b.item()) <= 1e-5
    loss_a.backward(), loss_b.backward()
    grads = to_hf({n: p.grad for n, p in native.named_parameters() if p.grad is not None and not n.startswith("mtp.")}, cfg)
    hf_grads = {n: p.grad for n, p in hf.named_parameters() if p.grad is not None}
    assert grads.keys() == hf_grads.keys()
    # relative, with an absolute floor for gradients that are pure fp32 rounding noise: e.g. hca_softmax_hash's
    # model.hc_head.hc_base has norm 5.4e-6, and the native and the HF fp32 gradients each differ from an fp64
    # computation by ~1e-9 (2e-4 and 1.4e-4 relative): no fp32 implementation meets 1e-4 on such a tensor
    for n, g in hf_grads.items():
        assert (grads[n] - g).norm().item() <= 1e-4 * g.norm().item() + 1e-8, n


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logits_through_flex_attention_match_transformers(name, monkeypatch):
    """The attention core through ``kernels.sink_attention``'s FlexAttention computation (block mask, sink via the
    log-sum-exp; CUDA's training path), here forward only and uncompiled: FlexAttention has no CPU backward in
    torch 2.13 (its forward and backward against the reference: tests/kernels/test_sink_attention.py on CUDA)."""
    from torch.nn.attention.flex_attention import flex_attention

    import trainer.models.deepseek_v4.attention as model_mod
    import trainer.models.deepseek_v4.cpu_attention as cpu_attention
    from kernels.sink_attention import flex_sink_attention

    monkeypatch.setattr(cpu_attention, "CPU_PATH", False)
    monkeypatch.setattr(model_mod, "sink_attention", lambda q, kv, s, m: flex_sink_attention(
        q, kv, s, m, flex=flex_attention, compile_mask=False))
    native, hf, _ = random_pair(name, seed=len(name))
    ids = _ids(len(name))
    with torch.no_grad():
        a, b = native(ids), hf(input_ids=ids).logits
    assert ((a - b).abs().max() / b.abs().max()).item() <= 1e-4


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_hf_native_hf_round_trip_is_bit_identical(name):
    native, hf, cfg = random_pair(name)
    hf_state = hf.state_dict()
    back = to_hf(from_hf(hf_state, cfg), cfg)
    assert back.keys() == hf_state.keys()
    assert all(torch.equal(back[k], hf_state[k]) for k in hf_state)
    reloaded = type(native)(cfg, VOCAB)
    reloaded.load_state_dict({**from_hf(hf_state, cfg), **{k: v for k, v in native.state_dict().items()
                                                            if k.startswith("mtp.")}})
    assert all(torch.equal(v, native.state_dict()[k]) for k, v in reloaded.state_dict().items())


def test_cached_decoding_equals_the_full_forward(attention_path):
    # index_topk >= entries: the indexer's top-k has no exact ties to break (ReLU scores can tie at zero, and
    # torch.topk, here as in transformers, then picks depending on how many entries follow)
    native, _, cfg = random_pair("mixed_sqrtsoftplus_mtp", index_topk=16)
    from trainer.models.deepseek_v4.model import DecodeCache

    ids = _ids(3, b=2, t=30)
    lens = [30, 21]  # row 1 is right-padded after 21 tokens
    with torch.no_grad():
        cache = DecodeCache(2, 40)
        prompt = ids[:, :12]
        pos = torch.arange(12).expand(2, -1)
        logits = [native(prompt, cache=cache, pos_bt=pos)]
        for p in range(12, 30):
            logits.append(native(ids[:, p:p + 1], cache=cache, pos_bt=torch.tensor([[p], [p]])))
        step = torch.cat(logits, dim=1)
        for r, n in enumerate(lens):
            full = native(ids[r:r + 1, :n])[0]
            assert torch.allclose(step[r, :n], full, atol=1e-5, rtol=1e-4)


def test_packed_documents_do_not_see_each_other(attention_path):
    native, _, cfg = random_pair("mixed_sqrtsoftplus_mtp", index_topk=16)  # no top-k ties, as above
    a, b = _ids(7, 1, 19)[0], _ids(8, 1, 14)[0]
    packed = torch.cat([a, b])[None]
    doc = torch.tensor([[0] * 19 + [1] * 14])
    with torch.no_grad():
        joint = native(packed, doc)[0]
        alone = native(a[None])[0]
    assert torch.allclose(joint[:19], alone, atol=1e-5, rtol=1e-4)
    # the second document's logits do not depend on the first one's tokens
    other = torch.cat([_ids(9, 1, 19)[0], b])[None]
    with torch.no_grad():
        assert torch.allclose(native(other, doc)[0, 19:], joint[19:], atol=1e-5, rtol=1e-4)
