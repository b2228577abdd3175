"""The C++ dequantisers against the torch reference: every byte value, odd shapes (rows and columns off the
128-blocks), E8M0 and float32 scales (extremes included), bf16 and float32 outputs, NaN codes; bad inputs."""

import pytest
import torch

from kernels import cpp_build
from kernels.dequant import (dequant_fp8, dequant_fp8_cpp, dequant_fp8_reference, dequant_mxfp4, dequant_mxfp4_cpp,
                             dequant_mxfp4_reference)

needs_cpp = pytest.mark.skipif(cpp_build.load("dequant_cpu.cpp") is None, reason="no C++ compiler here")


def _fp4_case(seed, rows, cols):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (rows, cols // 2), generator=g, dtype=torch.uint8)
    codes.view(-1)[:256] = torch.arange(256, dtype=torch.uint8)[: codes.numel()]  # every byte value
    scale = torch.randint(0, 255, (rows, cols // 32), generator=g, dtype=torch.uint8)  # (255: NaN, left out)
    scale.view(-1)[:3] = torch.tensor([0, 127, 254], dtype=torch.uint8)[: scale.numel()]
    return codes.view(torch.int8), scale.view(torch.float8_e8m0fnu)


def _fp8_case(seed, rows, cols, scale_dtype):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (rows, cols), generator=g, dtype=torch.uint8)
    codes.view(-1)[:256] = torch.arange(256, dtype=torch.uint8)[: codes.numel()]
    shape = (-(-rows // 128), -(-cols // 128))
    if scale_dtype == torch.float32:
        scale = torch.rand(shape, generator=g) * 3 + 1e-3
    else:
        scale = torch.randint(100, 150, shape, generator=g, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    return codes.view(torch.float8_e4m3fn), scale


@needs_cpp
@pytest.mark.parametrize("rows,cols", [(1, 32), (37, 96), (130, 2048)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mxfp4_cpp_equals_the_reference(rows, cols, dtype):
    codes, scale = _fp4_case(rows + cols, rows, cols)
    got, want = dequant_mxfp4_cpp(codes, scale, dtype), dequant_mxfp4_reference(codes, scale, dtype)
    assert got.dtype == dtype and got.shape == (rows, cols)
    assert torch.equal(got.view(torch.int16) if dtype == torch.bfloat16 else got.view(torch.int32),
                       want.view(torch.int16) if dtype == torch.bfloat16 else want.view(torch.int32))


@needs_cpp
@pytest.mark.parametrize("rows,cols", [(1, 1), (37, 200), (129, 257), (256, 384)])
@pytest.mark.parametrize("scale_dtype", [torch.float8_e8m0fnu, torch.float32])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_cpp_equals_the_reference(rows, cols, scale_dtype, dtype):
    codes, scale = _fp8_case(rows * 7 + cols, rows, cols, scale_dtype)
    got, want = dequant_fp8_cpp(codes, scale, dtype), dequant_fp8_reference(codes, scale, dtype)
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    assert torch.isnan(got).any() == (codes.numel() > 127)  # the e4m3fn NaN codes (0x7f, 0xff) stay NaN


def test_a_strided_input_takes_the_reference_and_bad_inputs_are_named():
    codes, scale = _fp8_case(0, 64, 256, torch.float32)
    t = codes[:, ::2]
    torch.testing.assert_close(dequant_fp8(t, scale[:, :1]), dequant_fp8_reference(t, scale[:, :1], torch.float32),
                               equal_nan=True)
    with pytest.raises(ValueError, match="FP8 scale has shape"):
        dequant_fp8(codes, scale[:, :1])
    c4, s4 = _fp4_case(1, 4, 64)
    with pytest.raises(ValueError, match="MXFP4 scale"):
        dequant_mxfp4(c4, s4[:, :1])
    with pytest.raises(TypeError, match="bfloat16 or float32"):
        dequant_mxfp4(c4, s4, torch.float16)


@pytest.mark.parametrize("backend", ["cpp", "reference"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_out_receives_the_values_in_place(backend, dtype):
    """``out=`` (a view into a larger buffer, as the conversion's I/O buffer is) gets exactly the values a fresh
    result holds, and the bytes around it stay as they were."""
    if backend == "cpp" and cpp_build.load("dequant_cpu.cpp") is None:
        pytest.skip("no C++ compiler here")
    fp4 = dequant_mxfp4_cpp if backend == "cpp" else dequant_mxfp4_reference
    fp8 = dequant_fp8_cpp if backend == "cpp" else dequant_fp8_reference
    codes, scale = _fp4_case(5, 37, 96)
    buf = torch.full((37 * 96 + 11,), 7.0, dtype=dtype)
    got = fp4(codes, scale, dtype, buf[5:5 + 37 * 96].view(37, 96))
    assert got.data_ptr() == buf[5:].data_ptr()
    assert torch.equal(got, dequant_mxfp4_reference(codes, scale, dtype))
    assert (buf[:5] == 7).all() and (buf[5 + 37 * 96:] == 7).all()
    q, s = _fp8_case(3, 129, 257, torch.float8_e8m0fnu)
    out = torch.empty(129, 257, dtype=dtype)
    torch.testing.assert_close(fp8(q, s, dtype, out), dequant_fp8_reference(q, s, dtype), rtol=0, atol=0, equal_nan=True)
    assert fp8(q, s, dtype, out).data_ptr() == out.data_ptr()


def test_a_wrong_out_is_named():
    codes, scale = _fp4_case(1, 4, 64)
    with pytest.raises(ValueError, match=r"out must be a contiguous torch.bfloat16 tensor of shape \(4, 64\)"):
        dequant_mxfp4(codes, scale, torch.bfloat16, out=torch.empty(4, 63, dtype=torch.bfloat16))
    q, s = _fp8_case(2, 8, 8, torch.float32)
    with pytest.raises(ValueError, match="not contiguous"):
        dequant_fp8(q, s, torch.float32, out=torch.empty(8, 16)[:, ::2])
