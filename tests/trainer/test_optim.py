"""``trainer.optim``: AdamW runs fused only where every parameter is a plain CUDA tensor."""

from types import SimpleNamespace

import torch

from trainer.optim import adamw_fused


def test_adamw_is_fused_only_for_plain_cuda_parameters():
    cuda, cpu = SimpleNamespace(device=torch.device("cuda", 0)), torch.nn.Parameter(torch.zeros(2))
    assert adamw_fused([cuda, cuda])
    assert not adamw_fused([cuda, cpu])  # one CPU parameter: the fused kernel would refuse the group
    assert not adamw_fused([cpu])
    assert not adamw_fused([])


def test_sharded_parameters_keep_the_foreach_adamw(monkeypatch):
    import torch.distributed.tensor as dt

    class FakeDTensor(SimpleNamespace):
        pass

    monkeypatch.setattr(dt, "DTensor", FakeDTensor)
    assert not adamw_fused([FakeDTensor(device=torch.device("cuda", 0))])
