"""Kernels that have not run on a GPU still compile for sm_90 (no GPU needed: triton ships ptxas).

The interpreter accepts code the compiler rejects (e.g. a kernel calling a plain Python helper), so the
router kernels (every scoring variant; they have since run on an H200) and the mHC expansion kernels (written
after the last GPU check: fp32 streams, a bf16 block output, 2 and 4 streams) are compiled here. In a subprocess:
triton.language must be imported without ``TRITON_INTERPRET`` for the compiler, and with it for the
interpreted tests of this session.
"""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import importlib
from kernels import registry, router
hc_expand = importlib.import_module("kernels.hc_expand")  # (the attribute kernels.hc_expand is the function)

def compile_(fn, signature, constants, helpers=()):
    kernel = registry.triton_jit(fn, helpers)
    triton.compile(ASTSource(kernel, {**signature, **{k: "constexpr" for k in constants}}, constants),
                   target=GPUTarget("cuda", 90, 32))

common = {"x_ptr": "*bf16", "N": "i32", "E": "i32", "scale": "fp32"}
for scoring in (0, 1, 2):
    compile_(router._router_fwd_kernel,
             {**common, "b_ptr": "*fp32", "s_ptr": "*bf16", "idx_ptr": "*i64", "w_ptr": "*bf16"},
             {"SCORING": scoring, "HAS_BIAS": True, "HAS_IDX": scoring == 2, "NORM": scoring != 1, "K": 6,
              "BN": 32, "EP": 128}, router._HELPERS)
    compile_(router._router_bwd_kernel,
             {**common, "idx_ptr": "*i64", "dw_ptr": "*bf16", "ds_ptr": "*bf16", "dx_ptr": "*bf16"},
             {"SCORING": scoring, "HAS_DS": scoring == 1, "NORM": scoring != 1, "K": 6, "BN": 32, "EP": 128},
             router._HELPERS)
hc = {"post_ptr": "*fp32", "comb_ptr": "*fp32", "y_ptr": "*bf16", "x_ptr": "*fp32", "N": "i32", "D": "i32"}
for np_, block_d in ((2, 1024), (4, 256)):
    compile_(hc_expand._hc_expand_fwd_kernel, {**hc, "out_ptr": "*fp32"}, {"NP": np_, "BLOCK_D": block_d})
    compile_(hc_expand._hc_expand_bwd_kernel,
             {**hc, "g_ptr": "*fp32", "dpost_ptr": "*fp32", "dcomb_ptr": "*fp32", "dy_ptr": "*bf16", "dx_ptr": "*fp32"},
             {"NP": np_, "BLOCK_D": block_d})
print("compiled")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_unproven_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    out = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0 and "compiled" in out.stdout, out.stderr[-3000:]
