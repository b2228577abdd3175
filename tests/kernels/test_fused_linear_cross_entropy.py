import math

import pytest
import torch

from kernels import get, registry
from kernels.fused_linear_cross_entropy import (fused_linear_cross_entropy, fused_linear_cross_entropy_chunked,
                                                fused_linear_cross_entropy_triton, linear_cross_entropy_naive)
from tests.kernels.conftest import assert_close, case_generator


def _leaf(t):
    return t.detach().clone().requires_grad_()


def _case(n, v, d, dtype, ignore_frac, case):
    g = case_generator(*case)
    h = torch.randn(n, d, generator=g).to(dtype)
    w = (torch.randn(v, d, generator=g) / d ** 0.5 * 3).to(dtype)
    labels = torch.randint(0, v, (n,), generator=g)
    labels[torch.rand(n, generator=g) < ignore_frac] = -100
    return h, w, labels, g


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduction", ["sum", "mean", "none"])
@pytest.mark.parametrize("n,v,d,chunks", [(37, 101, 19, (8, 16)), (5, 64, 8, (64, 4096)), (64, 257, 33, (7, 50))])
@pytest.mark.parametrize("z_loss", [0.0, 1e-2])
def test_matches_naive_fwd_bwd(dtype, reduction, n, v, d, chunks, z_loss):
    h, w, labels, g = _case(n, v, d, dtype, 0.3, ("flce", dtype, reduction, n, z_loss))
    h1, w1, h2, w2 = _leaf(h), _leaf(w), _leaf(h.float()), _leaf(w.float())
    with registry.poison_outputs():
        loss = fused_linear_cross_entropy(h1, w1, labels, reduction=reduction, chunk_tokens=chunks[0],
                                          chunk_vocab=chunks[1], z_loss=z_loss)
        ref = linear_cross_entropy_naive(h2, w2, labels, reduction=reduction, z_loss=z_loss)  # fp32 truth
        assert loss.dtype == torch.float32 and loss.shape == ref.shape
        gout = torch.randn(ref.shape, generator=g) if reduction == "none" else torch.tensor(0.7)
        loss.backward(gout)
        ref.backward(gout)
    assert_close(loss, ref, dtype)
    assert h1.grad.dtype == dtype and w1.grad.dtype == dtype
    assert_close(h1.grad, h2.grad, dtype)
    assert_close(w1.grad, w2.grad, dtype)
    assert (h1.grad[labels == -100] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("n,v,d,chunk,ignore", [(37, 101, 19, 8, 0.3), (5, 4099, 8, 64, 0.0), (30, 257, 33, 7, 1.0)])
@pytest.mark.parametrize("z_loss", [0.0, 1e-2])
def test_triton_matches_naive_fwd_bwd(triton_device, dtype, reduction, n, v, d, chunk, ignore, z_loss):
    """Grad-in-forward Triton path: odd vocabularies (one partial block; V > one 4096 block), uneven token
    chunks, ignored tokens (all of them in the last case), z-loss; fp32 naive loss as the truth."""
    h, w, labels, g = _case(n, v, d, dtype, ignore, ("flce-triton", dtype, reduction, n, z_loss))
    h1, w1 = _leaf(h.to(triton_device)), _leaf(w.to(triton_device))
    h2, w2 = _leaf(h.float()), _leaf(w.float())
    loss = fused_linear_cross_entropy_triton(h1, w1, labels.to(triton_device), reduction=reduction,
                                             chunk_tokens=chunk, z_loss=z_loss)
    ref = linear_cross_entropy_naive(h2, w2, labels, reduction=reduction, z_loss=z_loss)
    gout = torch.tensor(0.7)
    loss.backward(gout.to(triton_device))
    ref.backward(gout)
    assert loss.dtype == torch.float32 and h1.grad.dtype == dtype and w1.grad.dtype == dtype
    if ignore == 1.0 and reduction == "mean":  # 0/0, as F.cross_entropy; gradients zero (the naive z-loss: NaN)
        assert math.isnan(loss.item()) and not h1.grad.any() and not w1.grad.any()
        return
    assert_close(loss.cpu(), ref, dtype)
    assert_close(h1.grad.cpu(), h2.grad, dtype)
    assert_close(w1.grad.cpu(), w2.grad, dtype)
    assert (h1.grad.cpu()[labels == -100] == 0).all()


def test_triton_falls_back_for_per_token_losses(triton_device):
    h, w, labels, _ = _case(9, 30, 6, torch.float32, 0.2, ("none",))
    out = fused_linear_cross_entropy_triton(h.to(triton_device), w.to(triton_device), labels.to(triton_device),
                                            reduction="none")
    torch.testing.assert_close(out.cpu(), linear_cross_entropy_naive(h, w, labels, reduction="none"))


def test_bf16_matches_the_trainers_loss_exactly_enough():
    """bf16 logits (as ``lm_head`` makes them), softmax in fp32: the trainer's ``F.cross_entropy`` sum."""
    h, w, labels, _ = _case(50, 300, 16, torch.bfloat16, 0.5, ("trainer",))
    ref = torch.nn.functional.cross_entropy((h @ w.t()).float(), labels, ignore_index=-100, reduction="sum")
    loss = fused_linear_cross_entropy(h, w, labels, chunk_tokens=16, chunk_vocab=64)
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("h_dtype", [torch.bfloat16, torch.float32])
def test_under_autocast_a_16_bit_hidden_state_and_an_fp32_weight_train(h_dtype):
    """Autocast's mixed operands (the MTP head's bf16 hidden state, the fp32 LM head): the backward runs
    outside autocast and must not multiply a bf16 tensor with an fp32 one; loss and gradients match the
    naive loss under the same autocast."""
    h, w, labels, _ = _case(41, 203, 24, torch.float32, 0.3, ("autocast", h_dtype))
    h = h.to(h_dtype)
    (h1, w1), (h2, w2) = (_leaf(h), _leaf(w)), (_leaf(h), _leaf(w))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused = fused_linear_cross_entropy(h1, w1, labels, chunk_tokens=16, chunk_vocab=64)
        naive = linear_cross_entropy_naive(h2, w2, labels)
    fused.backward()
    naive.backward()
    torch.testing.assert_close(fused, naive, rtol=1e-4, atol=1e-3)
    assert h1.grad.dtype == h_dtype and w1.grad.dtype == torch.float32
    torch.testing.assert_close(h1.grad, h2.grad, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(w1.grad, w2.grad, rtol=2e-2, atol=2e-2)


def test_only_one_input_needs_grad():
    h, w, labels, _ = _case(9, 30, 6, torch.float32, 0.2, ("one",))
    h1 = _leaf(h)
    fused_linear_cross_entropy(h1, w, labels, chunk_tokens=4, chunk_vocab=8).backward()
    h2 = _leaf(h)
    linear_cross_entropy_naive(h2, w, labels).backward()
    assert_close(h1.grad, h2.grad, torch.float32)
    w1, w2 = _leaf(w), _leaf(w)
    fused_linear_cross_entropy(h, w1, labels, reduction="mean", chunk_tokens=4, chunk_vocab=8).backward()
    linear_cross_entropy_naive(h, w2, labels, reduction="mean").backward()
    assert_close(w1.grad, w2.grad, torch.float32)


def test_all_tokens_ignored():
    h, w, _, _ = _case(6, 20, 4, torch.float32, 0.0, ("ignored",))
    labels = torch.full((6,), -100)
    h1, w1 = _leaf(h), _leaf(w)
    loss = fused_linear_cross_entropy(h1, w1, labels)
    assert loss.item() == 0.0
    loss.backward()
    assert (h1.grad == 0).all() and (w1.grad == 0).all()
    assert math.isnan(fused_linear_cross_entropy(h, w, labels, reduction="mean").item())  # as F.cross_entropy
    assert (fused_linear_cross_entropy(h, w, labels, reduction="none") == 0).all()


def test_custom_ignore_index_and_bad_labels():
    h, w, labels, _ = _case(8, 20, 4, torch.float32, 0.0, ("ignore",))
    labels[:3] = 7
    torch.testing.assert_close(fused_linear_cross_entropy(h, w, labels, ignore_index=7, chunk_vocab=6),
                               linear_cross_entropy_naive(h, w, labels, ignore_index=7))
    labels[5] = 20
    with pytest.raises(IndexError):
        fused_linear_cross_entropy(h, w, labels)
    with pytest.raises(ValueError):
        fused_linear_cross_entropy(h, w, labels, reduction="max")


def test_large_logits_are_stable():
    h, w, labels, _ = _case(12, 40, 8, torch.float32, 0.0, ("big",))
    w = w * 200  # logits in the thousands: the online logsumexp must not overflow
    loss = fused_linear_cross_entropy(h, w, labels, reduction="none", chunk_vocab=7)
    assert torch.isfinite(loss).all()
    torch.testing.assert_close(loss, linear_cross_entropy_naive(h, w, labels, reduction="none"), rtol=1e-5, atol=1e-3)


def test_registry_picks_the_chunked_torch_path():
    assert get("fused_linear_cross_entropy", "cpu") is fused_linear_cross_entropy_chunked
