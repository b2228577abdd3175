"""The mHC "pre" step: the ``N`` residual streams' mixing weights and their collapse into one hidden state.

``hc_pre(x_btnd, fn_mk, base_m, scale, iters, eps, norm_eps) -> (post_btn, comb_btnn, h_btd)`` is
``HyperConnection.forward`` (``M = (2 + N) * N`` rows of ``fn``, ``scale`` = (pre, post, comb))::

    mixes   = rms_norm(x.flatten(-2)) @ fn^T                       # hc_mixes, fp32
    pre     = sigmoid(mixes[:N] * scale[0] + base[:N]) + eps
    post    = 2 * sigmoid(mixes[N:2N] * scale[1] + base[N:2N])      # fp32
    comb    = sinkhorn(mixes[2N:] * scale[2] + base[2N:], iters, eps)  # fp32, doubly stochastic
    h       = sum_n pre_n * x_n                                    # in x's dtype

and ``hc_head(x_btnd, fn_nk, base_n, scale, eps, norm_eps) -> h_btd`` is ``HyperHead``'s (``M = N``: pre only).

Backends: ``reference`` (the composition of ``hc_mixes`` and ``sinkhorn`` above, each with its own backend;
compiled code traces it) and ``cpp`` (CPU, ``kernels/hc_pre_cpu.cpp``, a ``torch.library`` custom op so
compiled code calls it without a graph break): one pass over each token's streams in the forward (row
statistics, the ``M`` dot products and the collapse while the token's ``N * D`` values sit in L1; the Sinkhorn
iterations of 16 tokens side by side, one vector lane each) and one in the backward (``dx``, ``dfn``, ``dbase``,
``dscale``, the Sinkhorn backward from each block's states recomputed), where inductor's code made ~4 passes over
the streams plus three memory-bound GEMMs with 8 columns. fp32 and bf16 streams; anything else (fp16, fp64,
``N > 8``, ``2 * iters - 1 > 256``) runs the reference.
The backward sums ``dx`` in fp32 and rounds once (the reference adds the collapse's and the mixes' bf16
gradients). :func:`hc_pre_formula` is the definition.
"""

from __future__ import annotations

import ctypes

import torch

from kernels import cpp_build
from kernels.hc_mixes import hc_mixes
from kernels.registry import get, register
from kernels.sinkhorn import sinkhorn

SOURCE = "hc_pre_cpu.cpp"
MAX_N = 8  # the C++ kernel's stream limit (kMaxN)
MAX_STEPS = 256  # its Sinkhorn step limit (kMaxSteps): 2 * iters - 1 <= 256


def hc_pre_formula(x_btnd: torch.Tensor, fn_mk: torch.Tensor, base_m: torch.Tensor, scale: torch.Tensor,
                   iters: int, eps: float, norm_eps: float):
    """The definition: ``(post, comb, h)``, or ``(None, None, h)`` for the head (``fn`` has ``N`` rows)."""
    n = x_btnd.shape[-2]
    mixes = hc_mixes(x_btnd.flatten(-2), fn_mk, norm_eps)
    if fn_mk.shape[0] == n:
        pre = torch.sigmoid(mixes * scale[0].float() + base_m.float()) + eps
        post = comb = None
    else:
        pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = base_m.split([n, n, n * n])
        s_pre, s_post, s_comb = scale.unbind(0)
        pre = torch.sigmoid(pre_w * s_pre + pre_b) + eps
        post = 2 * torch.sigmoid(post_w * s_post + post_b)
        comb = sinkhorn(comb_w.unflatten(-1, (n, n)) * s_comb + comb_b.view(n, n), iters, eps)
    h = (pre.unsqueeze(-1) * x_btnd).sum(dim=-2).to(x_btnd.dtype)
    return post, comb, h


register("hc_pre", "reference")(hc_pre_formula)  # (compiled: traced, each sub-op by its own choice)


# ----------------------------------------------------------------------------------------------- cpp
_F = ctypes.c_float
_I64 = ctypes.c_int64
_I = ctypes.c_int
_P = ctypes.c_void_p


def _lib() -> ctypes.CDLL:
    return cpp_build.require(SOURCE)


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


def _suffix(x: torch.Tensor) -> str:
    return "bf16" if x.dtype == torch.bfloat16 else "f32"


@torch.library.custom_op("trex::hc_pre_cpu", mutates_args=())
def _hc_pre_cpu(x_btnd: torch.Tensor, fn_mk: torch.Tensor, base_m: torch.Tensor, scale: torch.Tensor, iters: int,
                eps: float, norm_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                      torch.Tensor]:
    """``(post, comb, h, mixes [B*T, M], rstd [B*T])``; ``post`` / ``comb`` hold 0 streams for the head."""
    x = x_btnd.contiguous()
    *lead, n, d = x.shape
    m, tokens = fn_mk.shape[0], x.numel() // (n * d)
    head = m == n
    post = x.new_empty(*lead, 0 if head else n, dtype=torch.float32)
    comb = x.new_empty(*lead, *((0, 0) if head else (n, n)), dtype=torch.float32)
    h = x.new_empty(*lead, d)
    mixes = x.new_empty(tokens, m, dtype=torch.float32)
    rstd = x.new_empty(tokens, dtype=torch.float32)
    fwd = getattr(_lib(), f"trex_hc_pre_fwd_{_suffix(x)}")
    fwd(_P(_ptr(x)), _P(_ptr(fn_mk)), _P(_ptr(base_m)), _P(_ptr(scale)), _I64(tokens), _I(n), _I64(d), _I(m),
        _I(iters), _F(eps), _F(norm_eps), _P(_ptr(mixes)), _P(_ptr(rstd)), _P(_ptr(post)), _P(_ptr(comb)),
        _P(_ptr(h)), _I(torch.get_num_threads()))
    return post, comb, h, mixes, rstd


@_hc_pre_cpu.register_fake
def _(x_btnd, fn_mk, base_m, scale, iters, eps, norm_eps):
    *lead, n, d = x_btnd.shape
    m, head = fn_mk.shape[0], fn_mk.shape[0] == n
    tokens = x_btnd.numel() // (n * d)
    f32 = torch.float32
    return (x_btnd.new_empty(*lead, 0 if head else n, dtype=f32),
            x_btnd.new_empty(*lead, *((0, 0) if head else (n, n)), dtype=f32),
            x_btnd.new_empty(*lead, d), x_btnd.new_empty(tokens, m, dtype=f32), x_btnd.new_empty(tokens, dtype=f32))


@torch.library.custom_op("trex::hc_pre_cpu_backward", mutates_args=())
def _hc_pre_cpu_backward(x_btnd: torch.Tensor, fn_mk: torch.Tensor, base_m: torch.Tensor, scale: torch.Tensor,
                         mixes: torch.Tensor, rstd: torch.Tensor, g_post: torch.Tensor, g_comb: torch.Tensor,
                         g_h: torch.Tensor, iters: int, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                             torch.Tensor]:
    """``(dx, dfn, dbase, dscale)`` (``dscale`` has 3 entries; the head uses the first)."""
    x = x_btnd.contiguous()
    *lead, n, d = x.shape
    m, tokens = fn_mk.shape[0], x.numel() // (n * d)
    g_h = g_h.to(x.dtype).contiguous()
    g_post = g_post.float().contiguous()
    g_comb = g_comb.float().contiguous()
    dx = torch.empty_like(x)
    dfn = fn_mk.new_empty(fn_mk.shape, dtype=torch.float32)
    dbase = fn_mk.new_empty(m, dtype=torch.float32)
    dscale = fn_mk.new_empty(3, dtype=torch.float32)
    bwd = getattr(_lib(), f"trex_hc_pre_bwd_{_suffix(x)}")
    bwd(_P(_ptr(x)), _P(_ptr(fn_mk)), _P(_ptr(base_m)), _P(_ptr(scale)), _P(_ptr(mixes)), _P(_ptr(rstd)),
        _P(_ptr(g_post)), _P(_ptr(g_comb)), _P(_ptr(g_h)), _I64(tokens), _I(n), _I64(d), _I(m), _I(iters), _F(eps),
        _P(_ptr(dx)), _P(_ptr(dfn)), _P(_ptr(dbase)), _P(_ptr(dscale)), _I(torch.get_num_threads()))
    return dx, dfn, dbase, dscale


@_hc_pre_cpu_backward.register_fake
def _(x_btnd, fn_mk, base_m, scale, mixes, rstd, g_post, g_comb, g_h, iters, eps):
    m = fn_mk.shape[0]
    f32 = torch.float32
    return (torch.empty_like(x_btnd, memory_format=torch.contiguous_format), fn_mk.new_empty(fn_mk.shape, dtype=f32),
            fn_mk.new_empty(m, dtype=f32), fn_mk.new_empty(3, dtype=f32))


def _setup_context(ctx, inputs, output):
    x_btnd, fn_mk, base_m, scale, iters, eps, _norm_eps = inputs
    post, comb, _h, mixes, rstd = output
    ctx.save_for_backward(x_btnd, fn_mk, base_m, scale, mixes, rstd)
    ctx.iters, ctx.eps, ctx.n_scale = iters, eps, scale.shape[0]
    ctx.post_shape, ctx.comb_shape = post.shape, comb.shape


def _backward(ctx, g_post, g_comb, g_h, _g_mixes, _g_rstd):
    x_btnd, fn_mk, base_m, scale, mixes, rstd = ctx.saved_tensors
    if g_post is None:
        g_post = mixes.new_zeros(ctx.post_shape)
    if g_comb is None:
        g_comb = mixes.new_zeros(ctx.comb_shape)
    if g_h is None:
        g_h = torch.zeros_like(x_btnd[..., 0, :])
    dx, dfn, dbase, dscale = _hc_pre_cpu_backward(x_btnd, fn_mk, base_m, scale, mixes, rstd, g_post, g_comb, g_h,
                                                  ctx.iters, ctx.eps)
    return dx, dfn, dbase, dscale[:ctx.n_scale], None, None, None


_hc_pre_cpu.register_autograd(_backward, setup_context=_setup_context)


def _cpp_supported(x_btnd: torch.Tensor, fn_mk: torch.Tensor, iters: int) -> bool:
    n = x_btnd.shape[-2] if x_btnd.dim() >= 2 else 0
    m = fn_mk.shape[0]
    return (x_btnd.device.type == "cpu" and x_btnd.dtype in (torch.float32, torch.bfloat16) and 1 <= n <= MAX_N
            and x_btnd.numel() > 0 and m in (n, (2 + n) * n) and fn_mk.shape[-1] == x_btnd.shape[-2:].numel()
            and (m == n or 1 <= 2 * iters - 1 <= MAX_STEPS))


@register("hc_pre", "cpp")  # (compiled: the custom op, opaque to inductor, no graph break)
def hc_pre_cpp(x_btnd: torch.Tensor, fn_mk: torch.Tensor, base_m: torch.Tensor, scale: torch.Tensor, iters: int,
               eps: float, norm_eps: float):
    if not _cpp_supported(x_btnd, fn_mk, iters):
        return hc_pre_formula(x_btnd, fn_mk, base_m, scale, iters, eps, norm_eps)
    f32 = torch.float32
    post, comb, h, _mixes, _rstd = _hc_pre_cpu(x_btnd, fn_mk.to(f32).contiguous(), base_m.to(f32).contiguous(),
                                               scale.to(f32).contiguous(), int(iters), float(eps), float(norm_eps))
    return (None, None, h) if fn_mk.shape[0] == x_btnd.shape[-2] else (post, comb, h)


# ----------------------------------------------------------------------------------------------- public
def hc_pre(x_btnd: torch.Tensor, fn_mk: torch.Tensor, base_m: torch.Tensor, scale: torch.Tensor, iters: int,
           eps: float, norm_eps: float):
    """``(post [B, T, N] fp32, comb [B, T, N, N] fp32, h [B, T, D])`` from the streams ``x [B, T, N, D]``."""
    return get("hc_pre", x_btnd.device.type)(x_btnd, fn_mk, base_m, scale, iters, eps, norm_eps)


def hc_head(x_btnd: torch.Tensor, fn_nk: torch.Tensor, base_n: torch.Tensor, scale: torch.Tensor, eps: float,
            norm_eps: float) -> torch.Tensor:
    """The final collapse ``h [B, T, D]`` of the streams (``HyperHead``: ``fn`` has ``N`` rows, pre only)."""
    return get("hc_pre", x_btnd.device.type)(x_btnd, fn_nk, base_n, scale, 1, eps, norm_eps)[2]
