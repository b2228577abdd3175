"""Training a tiny DeepSeek-V4 for 4 steps with every kernel forced to each available backend gives the
reference backend's losses: on CUDA the compiled Triton kernels against the reference ops on the same GPU, on
CPU the Triton kernels in the interpreter."""

import torch

from kernels import registry
from tests.trainer.helpers import random_docs, tiny_model, tiny_train_cfg
from trainer.data import pack
from trainer.engines.single import train

STEPS = 4  # each kernel's own tests cover fwd/bwd on random inputs; this one, the training loop through all of them


def _losses(tmp_path, name: str, device: str) -> list[float]:
    torch.manual_seed(0)
    # one CSA layer (compressor, indexer, sliding part), a top-k MoE and mHC: every op, few interpreted launches
    model = tiny_model(seed=3, num_layers=1, layer_types=["compressed_sparse_attention"], mlp_layer_types=["moe"])
    model.to(device)
    data = pack(random_docs(16, seed=5), 16, 0)
    losses = []
    train(model, data, tiny_train_cfg(steps=STEPS, batch_size=2, seq_len=16, log_every=1, ckpt_every=100),
          tmp_path / name, seed=0, on_log=lambda step, m: losses.append(m["loss"]))
    return losses


def test_training_steps_under_each_backend_match_the_reference(tmp_path, triton_device):
    with registry.use_backends("reference"):
        ref = _losses(tmp_path, "reference", triton_device)
    registry.clear_choices()
    with registry.use_backends("triton", hc_pre="reference"):  # (hc_pre has no Triton kernel: the reference
        tri = _losses(tmp_path, "triton", triton_device)         # composes the Triton sinkhorn and hc_mixes)
    picked = {k.split("/")[0] for k, v in registry.choices().items() if v == "triton"}
    every = {"rms_norm", "rope", "swiglu", "sinkhorn", "moe_experts", "fused_linear_cross_entropy",
             "router"}
    assert every <= picked, registry.choices()
    assert len(ref) == len(tri) == STEPS
    # same math in another order of floating-point operations: fp32 round-off, compounded over the steps
    torch.testing.assert_close(torch.tensor(tri), torch.tensor(ref), rtol=1e-4, atol=1e-5)


def test_training_steps_with_the_cpp_kernels_match_the_reference(tmp_path):
    with registry.use_backends("reference"):
        ref = _losses(tmp_path, "reference", "cpu")
    registry.clear_choices()
    with registry.use_backends("cpp"):
        cpp = _losses(tmp_path, "cpp", "cpu")
    assert {k for k, v in registry.choices().items() if v == "cpp"} == {"hc_pre/cpu"}, registry.choices()
    torch.testing.assert_close(torch.tensor(cpp), torch.tensor(ref), rtol=1e-4, atol=1e-5)
