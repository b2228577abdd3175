"""Dequantisation of the published DeepSeek-V4 weights to bf16 / float32 (op ``dequant_mxfp4``, op ``dequant_fp8``).

- ``dequant_mxfp4(codes [R, C/2], scale [R, C/32], dtype) -> [R, C]``: two E2M1 codes a byte (low nibble first;
  sign bit 3, magnitude index into ``{0, .5, 1, 1.5, 2, 3, 4, 6}``), an E8M0 scale per 32 values;
- ``dequant_fp8(codes [R, C] e4m3fn, scale [ceil(R/128), ceil(C/128)] E8M0 or float32, dtype) -> [R, C]``: one
  scale per 128 x 128 block.

Each value is ``float32(code value) * float32(scale)`` rounded once to ``dtype`` (exact for E8M0 scales). ``out``: a
contiguous ``[R, C]`` tensor of ``dtype`` to write into (e.g. a view of a reused, aligned I/O buffer: the
conversion writes the output file from it, ``trainer/hub/direct.py``) instead of a fresh one.
Backends: ``reference`` (torch, whole-tensor float32 intermediates: the spec) and ``cpp`` (``dequant_cpu.cpp``:
one pass over the codes writing the output, rows over OpenMP threads; contiguous CPU tensors, else the
reference). The conversion of a published checkpoint (``trainer/hub/quant.py``) runs on them.
"""

from __future__ import annotations

import ctypes

import torch

from kernels import cpp_build
from kernels.registry import get, register

SOURCE = "dequant_cpu.cpp"
E2M1_16 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
_E8M0_256 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e8m0fnu).float()
_FP8_256 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
_OUT = (torch.bfloat16, torch.float32)


def _check_mxfp4(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> None:
    if codes.dtype not in (torch.int8, torch.uint8) or codes.dim() != 2:
        raise TypeError(f"MXFP4 codes must be int8 / uint8 [R, C/2]; got {codes.dtype} {tuple(codes.shape)}")
    r, c = codes.shape[0], 2 * codes.shape[1]
    if scale.shape != (r, c // 32) or c % 32:
        raise ValueError(f"MXFP4 scale has shape {tuple(scale.shape)}, expected {(r, c // 32)}")
    if dtype not in _OUT:
        raise TypeError(f"dequantise to bfloat16 or float32, not {dtype}")


def _check_fp8(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> None:
    if codes.dtype != torch.float8_e4m3fn or codes.dim() != 2:
        raise TypeError(f"FP8 codes must be float8_e4m3fn [R, C]; got {codes.dtype} {tuple(codes.shape)}")
    r, c = codes.shape
    want = (-(-r // 128), -(-c // 128))
    if tuple(scale.shape) != want:
        raise ValueError(f"FP8 scale has shape {tuple(scale.shape)}, expected {want}")
    if dtype not in _OUT:
        raise TypeError(f"dequantise to bfloat16 or float32, not {dtype}")


def _check_out(out: torch.Tensor | None, shape: tuple[int, int], dtype: torch.dtype) -> None:
    if out is not None and (tuple(out.shape) != shape or out.dtype != dtype or not out.is_contiguous()):
        raise ValueError(f"out must be a contiguous {dtype} tensor of shape {shape}; got {out.dtype} "
                         f"{tuple(out.shape)}{'' if out.is_contiguous() else ' (not contiguous)'}")


def _into(values: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    return values if out is None else out.copy_(values)


@register("dequant_mxfp4", "reference")
def dequant_mxfp4_reference(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                            out: torch.Tensor | None = None) -> torch.Tensor:
    b = codes.view(torch.uint8).long()
    table = E2M1_16.to(codes.device)
    vals = torch.stack([table[b & 15], table[b >> 4]], -1).flatten(-2)
    return _into((vals * scale.float().repeat_interleave(32, 1)).to(dtype), out)


@register("dequant_fp8", "reference")
def dequant_fp8_reference(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                          out: torch.Tensor | None = None) -> torch.Tensor:
    r, c = codes.shape
    s = scale.float().repeat_interleave(128, 0)[:r].repeat_interleave(128, 1)[:, :c]
    return _into((codes.float() * s).to(dtype), out)


def _lib() -> ctypes.CDLL:
    return cpp_build.require(SOURCE)


def _suffix(dtype: torch.dtype) -> str:
    return "bf16" if dtype == torch.bfloat16 else "f32"


_P, _I64, _I = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


@register("dequant_mxfp4", "cpp")
def dequant_mxfp4_cpp(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    if not (codes.is_cpu and codes.is_contiguous() and scale.is_contiguous() and scale.dtype == torch.float8_e8m0fnu
            and (out is None or out.is_cpu)):
        return dequant_mxfp4_reference(codes, scale, dtype, out)
    r, c = codes.shape[0], 2 * codes.shape[1]
    out = torch.empty(r, c, dtype=dtype) if out is None else out
    fn = getattr(_lib(), f"trex_dequant_mxfp4_{_suffix(dtype)}")
    fn(_P(codes.data_ptr()), _P(scale.data_ptr()), _P(E2M1_16.data_ptr()), _P(_E8M0_256.data_ptr()), _I64(r),
       _I64(c), _P(out.data_ptr()), _I(torch.get_num_threads()))
    return out


@register("dequant_fp8", "cpp")
def dequant_fp8_cpp(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    if not (codes.is_cpu and codes.is_contiguous() and (out is None or out.is_cpu)):
        return dequant_fp8_reference(codes, scale, dtype, out)
    r, c = codes.shape
    s = scale.float().contiguous()  # (1/16384 of the weight)
    out = torch.empty(r, c, dtype=dtype) if out is None else out
    fn = getattr(_lib(), f"trex_dequant_fp8_{_suffix(dtype)}")
    fn(_P(codes.data_ptr()), _P(s.data_ptr()), _P(_FP8_256.data_ptr()), _I64(r), _I64(c), _P(out.data_ptr()),
       _I(torch.get_num_threads()))
    return out


def dequant_mxfp4(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """``[R, C]`` in ``dtype`` from MXFP4 bytes ``[R, C/2]`` and E8M0 scales ``[R, C/32]`` (into ``out`` if given)."""
    _check_mxfp4(codes, scale, dtype)
    _check_out(out, (codes.shape[0], 2 * codes.shape[1]), dtype)
    return get("dequant_mxfp4", codes.device.type)(codes, scale, dtype, out)


def dequant_fp8(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """``[R, C]`` in ``dtype`` from FP8 codes and their 128 x 128 block scales (E8M0 or float32) (into ``out`` if
    given)."""
    _check_fp8(codes, scale, dtype)
    _check_out(out, tuple(codes.shape), dtype)
    return get("dequant_fp8", codes.device.type)(codes, scale, dtype, out)
