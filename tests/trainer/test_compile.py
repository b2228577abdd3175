"""``train.<stage>.compile``: compiled decoder blocks train like the eager model, and a compiler failure falls
back to eager execution instead of failing the run."""

import logging

import pytest
import torch

from kernels import moe_chunk_math
from tests.trainer.helpers import random_docs, tiny_model, tiny_train_cfg
from trainer.data import pack
from trainer.engines.single import train
from trainer.models.deepseek_v4 import cpu_attention, training


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
    moe_chunk_math.fuse(None)  # (apply_compile fuses the CPU expert path's chunk math for the process,
    cpu_attention.fuse(None)  # and the attention core's sink-gradient row products)


def _run(tmp_path, compile_: bool, name: str, steps: int = 6, dtype: str = "fp32", **model_kw):
    data = pack(random_docs(24), 32, pad_id=0)  # several documents per row, padding at the ends
    model = tiny_model(**{"mtp_layers": 1, **model_kw})
    losses = []
    train(model, data, tiny_train_cfg(steps=steps, ckpt_every=100, log_every=1, compile=compile_, dtype=dtype),
          tmp_path / name, seed=0, on_log=lambda s, m: losses.append(m["loss"]))
    return model, losses


def test_compiled_blocks_train_like_the_eager_model(tmp_path, caplog):
    eager, eager_losses = _run(tmp_path, False, "eager")
    with caplog.at_level(logging.WARNING, logger=training.__name__):
        compiled, compiled_losses = _run(tmp_path, True, "compiled")
    # every graph compiled: none fell back to eager (dynamo's restarts, e.g. for the chunk math's float inputs,
    # are not compiler failures)
    assert "torch.compile failed" not in caplog.text
    assert all(getattr(b, "_compiled_call_impl", None) is not None for b in compiled.layers)
    assert compiled.mtp[0].block._compiled_call_impl is not None and compiled.hc_head._compiled_call_impl is not None
    assert getattr(compiled.mtp[0].mix, "_torchdynamo_orig_callable", None) is not None  # MTP's input: one region
    assert moe_chunk_math.fused()  # the CPU expert loop's element-wise work compiled with the blocks
    assert cpu_attention.fused()
    torch.testing.assert_close(torch.tensor(compiled_losses), torch.tensor(eager_losses), rtol=1e-4, atol=1e-5)
    # the trained models compute the same function (weights are compared through it: AdamW's normalised update
    # magnifies fp32 reassociation on parameters whose gradient is ~0)
    ids = torch.randint(0, 97, (2, 32), generator=torch.Generator().manual_seed(5))
    trained = tiny_model(mtp_layers=1)  # (eager: the compiled model's weights, no further compilation)
    trained.load_state_dict(compiled.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(trained.eval()(ids), eager.eval()(ids), rtol=1e-3, atol=1e-3)


def test_compiled_bf16_training_learns_like_the_eager_bf16_run(tmp_path, monkeypatch):
    """bf16 autocast, compiled: the attention core's blocks go through the materialised scores (compiled softmax
    passes, 16-bit probabilities) instead of the flash kernel that eager training calls; the run learns and its
    losses stay within bf16 rounding of the eager run's. (One CSA layer -- window and selected compressed
    entries -- without MTP: a cold compile of the three-layer model in bf16 took ~2 minutes.)"""
    one_layer = dict(mtp_layers=0, num_layers=1, layer_types=["compressed_sparse_attention"], mlp_layer_types=["moe"])
    calls = []
    apply = cpu_attention._SinkSoftmaxCPU.apply
    monkeypatch.setattr(cpu_attention._SinkSoftmaxCPU, "apply", lambda *a: calls.append(1) or apply(*a))
    _, eager_losses = _run(tmp_path, False, "eager", steps=12, dtype="bf16", **one_layer)
    assert not calls  # eager training keeps the flash kernel
    _, compiled_losses = _run(tmp_path, True, "compiled", steps=12, dtype="bf16", **one_layer)
    assert calls
    losses = torch.tensor(compiled_losses)
    assert torch.isfinite(losses).all() and losses[-3:].mean() < losses[:3].mean() - 0.2
    torch.testing.assert_close(losses, torch.tensor(eager_losses), rtol=2e-2, atol=2e-2)


def test_a_compiler_failure_falls_back_to_eager_and_only_the_eager_pieces_break_the_graph(tmp_path, monkeypatch,
                                                                                          caplog):
    """With inductor broken every graph runs as traced. Dynamo traces each block whole except the CPU attention
    core and the CPU expert loop (called eagerly on purpose): any other graph break (a kernel reference that
    calls ``storage_offset()``, a ``.item()``...) splits the blocks' graphs and compiles more of them."""
    from torch._dynamo.utils import counters

    def broken(*_a, **_k):
        raise RuntimeError("no C++ compiler here")

    monkeypatch.setattr("torch._inductor.compile_fx.compile_fx", broken)
    eager, eager_losses = _run(tmp_path, False, "eager")
    counters.clear()
    with caplog.at_level(logging.WARNING, logger=training.__name__):
        _, fallback_losses = _run(tmp_path, True, "fallback")
    assert "torch.compile failed for a graph (RuntimeError: no C++ compiler here)" in caplog.text
    assert fallback_losses == pytest.approx(eager_losses, rel=1e-6)
    reasons = [r for r in counters["graph_break"] if counters["graph_break"][r]]
    assert reasons, "the eager pieces break the graph: their absence means the counters are not read"
    unexpected = [r for r in reasons if not ("torch.compiler.disable" in r and (
        "_sink_attention_cpu" in r or "moe_experts_reference" in r))]
    assert not unexpected, unexpected
