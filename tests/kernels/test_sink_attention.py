"""kernels.sink_attention: the masked-SDPA reference against the definition, and the FlexAttention (``triton``)
backend against the reference.

FlexAttention has no CPU backward in torch 2.13 and compiles only inference there (without the log-sum-exp the
sink needs), so on CPU the flex computation is checked forward, with the uncompiled ``flex_attention`` (the
dense math FlexAttention is defined by); on a CUDA machine the compiled backend is checked forward and backward.
"""

from __future__ import annotations

import pytest
import torch

from kernels import registry, sink_attention
from kernels.sink_attention import flex_sink_attention, sink_attention_reference, sink_attention_triton
from tests.kernels.conftest import assert_close, case_generator


def definition(q_bhtc, kv_bsc, sinks_h, mask_bts):
    """Softmax over ``[visible logits, sink]`` per query row, the sink's value zero (fp64 math)."""
    c = q_bhtc.shape[-1]
    logits = torch.einsum("bhtc,bsc->bhts", q_bhtc.double(), kv_bsc.double()) * c ** -0.5
    logits = logits.masked_fill(~mask_bts[:, None], float("-inf"))
    sink = sinks_h.double().view(1, -1, 1, 1).expand(*logits.shape[:3], 1)
    p = torch.cat([logits, sink], -1).softmax(-1)[..., :-1]
    return torch.einsum("bhts,bsc->bhtc", p, kv_bsc.double())


def masks(kind: str, b: int, t: int, g: torch.Generator) -> torch.Tensor:
    """[B, T, S]: a causal window (sliding), plus random selected / all complete compressed entries, with one
    query that sees nothing (a padding row of a packed batch)."""
    pos = torch.arange(t)
    m = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - 37)
    m = m[None].expand(b, t, t)
    if kind != "sliding":
        w = t // 4 + 3
        extra = torch.rand(b, t, w, generator=g) < (0.3 if kind == "csa" else 1.0)
        m = torch.cat([m, extra & (torch.arange(w)[None, None] < (pos[None, :, None] + 1) // 4)], -1)
    m = m.clone()
    m[0, t // 2] = False
    return m


def inputs(kind, b, h, t, c, dtype, case):
    g = case_generator("sink", kind, b, h, t, c, str(dtype), case)
    mask = masks(kind, b, t, g)
    q = torch.randn(b, h, t, c, generator=g).to(dtype)
    kv = torch.randn(b, mask.shape[-1], c, generator=g).to(dtype)
    sinks = torch.randn(h, generator=g)
    return q, kv, sinks, mask


def grads(fn, q, kv, sinks, mask, dout):
    q, kv, sinks = (x.detach().clone().requires_grad_() for x in (q, kv, sinks))
    out = fn(q, kv, sinks, mask)
    out.backward(dout)
    return [out, q.grad, kv.grad, sinks.grad]


@pytest.mark.parametrize("kind", ["sliding", "csa", "hca"])
@pytest.mark.parametrize("b,h,t,c", [(2, 3, 45, 16), (1, 5, 130, 33)])
def test_reference_is_the_definition(kind, b, h, t, c):
    q, kv, sinks, mask = inputs(kind, b, h, t, c, torch.float32, "def")
    dout = torch.randn(q.shape, generator=case_generator("dout", kind, t))
    got = grads(sink_attention_reference, q, kv, sinks, mask, dout)
    want = grads(lambda *a: definition(*a).float(), q, kv, sinks, mask, dout)
    for x, y in zip(got, want):
        assert_close(x, y, torch.float32)
    assert got[0][0, :, t // 2].abs().max() == 0  # a query that sees nothing outputs zero (only the sink)


def test_model_attention_core_is_the_op(monkeypatch):
    """Off the CPU path, the model's attention core is ``kernels.sink_attention``."""
    import types

    from trainer.models.deepseek_v4 import cpu_attention
    from trainer.models.deepseek_v4.attention import Attention

    monkeypatch.setattr(cpu_attention, "CPU_PATH", False)
    q, kv, sinks, mask = inputs("csa", 2, 3, 45, 16, torch.float32, "model")
    host = types.SimpleNamespace(sinks=sinks)
    assert torch.equal(Attention._attend(host, q.transpose(1, 2), kv, mask), sink_attention(q, kv, sinks, mask))


@pytest.mark.parametrize("kind", ["sliding", "csa", "hca"])
@pytest.mark.parametrize("b,h,t,c", [(2, 3, 45, 16), (1, 2, 300, 24)])
def test_flex_forward_is_the_reference(kind, b, h, t, c):
    """The flex computation (block mask, sink through the log-sum-exp), uncompiled on CPU, forward only."""
    from torch.nn.attention.flex_attention import flex_attention

    q, kv, sinks, mask = inputs(kind, b, h, t, c, torch.float32, "flex")
    with torch.no_grad():
        got = flex_sink_attention(q, kv, sinks, mask, flex=flex_attention, compile_mask=False)
        assert_close(got, sink_attention_reference(q, kv, sinks, mask), torch.float32)
        with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast's dtype, as SDPA gets under autocast
            low = flex_sink_attention(q, kv, sinks, mask, flex=flex_attention, compile_mask=False)
        assert low.dtype == torch.bfloat16
        assert_close(low, got, torch.bfloat16)


def test_flex_traces_as_one_graph():
    """The traced form (what ``torch.compile`` sees inside a compiled block) has no graph break."""
    from torch.nn.attention.flex_attention import flex_attention

    q, kv, sinks, mask = inputs("csa", 1, 2, 256, 16, torch.float32, "trace")

    def fn(q, kv, sinks, mask):
        return flex_sink_attention(q, kv, sinks, mask, flex=flex_attention, compile_mask=False)

    torch._dynamo.reset()
    with torch.no_grad():
        explained = torch._dynamo.explain(fn)(q, kv, sinks, mask)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1


def test_triton_backend_off_cuda_or_without_autograd_is_the_reference():
    q, kv, sinks, mask = inputs("hca", 2, 3, 45, 16, torch.float32, "fallback")
    want = sink_attention_reference(q, kv, sinks, mask)
    assert torch.equal(sink_attention_triton(q, kv, sinks, mask), want)  # CPU tensors
    with torch.no_grad():
        assert torch.equal(sink_attention_triton(q, kv, sinks, mask), want)
    assert registry.backends("sink_attention") == ["reference", "triton"]
    assert registry.select("sink_attention", "cpu") == "reference"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlexAttention's compiled kernel and backward need CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["sliding", "csa", "hca"])
def test_flex_is_the_reference_on_cuda(kind, dtype):
    q, kv, sinks, mask = (x.cuda() for x in inputs(kind, 2, 3, 300, 64, dtype, "cuda"))
    dout = torch.randn(q.shape, generator=case_generator("dout-cuda", kind)).to("cuda", dtype)
    got = grads(sink_attention_triton, q, kv, sinks, mask, dout)
    want = grads(sink_attention_reference, q, kv, sinks, mask, dout)
    for x, y in zip(got, want):
        assert_close(x, y, dtype)


def test_model_through_flex_is_the_model_through_its_cpu_path(monkeypatch):
    """The whole tiny V4 (sliding, CSA with its indexer's selection, HCA) on a packed batch -- two documents and
    padding (doc -1: rows that see nothing) -- with the attention core through the flex computation (uncompiled,
    forward) gives the hidden states of the CPU path: the masks the model builds mean to FlexAttention's block
    mask what they mean to the CPU kernel."""
    from torch.nn.attention.flex_attention import flex_attention

    from tests.trainer.helpers import tiny_model
    from trainer.models.deepseek_v4 import attention, cpu_attention

    model = tiny_model().eval()
    g = case_generator("model-flex")
    for m in model.modules():  # (the sinks start at zero)
        if isinstance(m, attention.Attention):
            m.sinks.data.copy_(torch.randn(m.sinks.shape, generator=g))
    ids = torch.randint(0, model.embed.num_embeddings, (2, 40), generator=g)
    doc = torch.tensor([[0] * 17 + [1] * 23, [0] * 29 + [-1] * 11])
    with torch.no_grad():
        want = model.hidden(ids, doc)
        monkeypatch.setattr(cpu_attention, "CPU_PATH", False)
        monkeypatch.setattr(attention, "sink_attention", lambda q, kv, s, m: flex_sink_attention(
            q, kv, s, m, flex=flex_attention, compile_mask=False))
        got = model.hidden(ids, doc)
    assert_close(got, want, torch.float32)
