"""Kernel tests: Triton kernels run in the CPU interpreter here (no GPU), compiled on CUDA when there is one.

``TRITON_INTERPRET=1`` must be set before triton JITs anything; kernels are JITted lazily on first use
(``kernels.registry.triton_jit``), so setting it at conftest import is early enough. It only affects
``@triton.jit`` functions (Inductor's CPU backend does not use Triton), so it is harmless to the other
test directories collected in the same session; the model never picks Triton on CPU unless forced.
"""

from __future__ import annotations

import importlib.util
import os
import zlib

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kernels import registry  # noqa: E402

# bf16 kernels round once to bf16 (the interpreter truncates instead of rounding to nearest: <= 1 ulp = 2^-7)
TOL = {torch.float32: dict(rtol=2e-5, atol=2e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def case_generator(*case) -> torch.Generator:
    """A generator seeded by the test case (stable across runs and processes)."""
    return torch.Generator().manual_seed(zlib.crc32(repr(case).encode()))


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, scale: bool = True) -> None:
    """Compare at ``dtype``'s tolerance; the absolute part scales with ``expected``'s magnitude when ``scale``
    (gradients summed over many terms)."""
    actual, expected = actual.detach(), expected.detach()
    assert not torch.isnan(actual).any(), "NaN in a kernel output: an element was not written"
    tol = dict(TOL[dtype])
    if scale:
        tol["atol"] = tol["atol"] * max(1.0, float(expected.abs().max()))
    torch.testing.assert_close(actual.float(), expected.float(), **tol)


@pytest.fixture
def triton_device():
    """The device the Triton backend runs on in this session, with kernel outputs poisoned (NaN-filled)."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed (pip install '.[test]')")
    device = "cuda" if torch.cuda.is_available() and not registry.triton_interpret() else "cpu"
    if not registry.is_available("triton", device):
        pytest.skip(f"the triton backend is unavailable on {device} (on CPU it needs TRITON_INTERPRET=1)")
    with registry.poison_outputs():
        yield device


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Every kernel test module runs on one intra-op thread. Tiny ops: intra-op threads only add barrier latency (tens of ms each on a shared, loaded CPU)."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(autouse=True)
def _restore_overrides():
    old = registry.overrides()
    yield
    registry.set_overrides(old)
