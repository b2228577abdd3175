// The mHC "pre" step on a CPU: the C++ backend of kernels/hc_pre.py (which holds the definition, the build and the
// tests' reference). Tokens are walked in blocks of TB = 16: per token t, with the N streams x_t [N*D] read once
// into fp32 (bf16 or fp32 streams), the statistics, dot products and collapse; then the block's Sinkhorn
// projections side by side, one vector lane per token:
//
//   r      = rsqrt(mean(x^2) + norm_eps)                     mixes_m = r * <x, fn_m>        (m < M)
//   pre_n  = sigmoid(mixes_n * s0 + b_n) + eps               post_n  = 2 sigmoid(mixes_{N+n} * s1 + b_{N+n})
//   comb   = sinkhorn(mixes_{2N+..} * s2 + b_{2N+..})        h_d     = sum_n pre_n x_{n,d}
//
// (M == N: the final head, pre only.) The backward recomputes pre / post / the Sinkhorn states from the saved
// mixes and r and writes dx per token, accumulating dfn / dbase / dscale in per-thread fp32 buffers. Threads:
// OpenMP, the runtime torch itself loaded (same soname), ``nthreads`` from torch.get_num_threads().
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#include <omp.h>

namespace {

constexpr int kMaxN = 8;          // streams (Sinkhorn matrices up to 8 x 8)
constexpr int kMaxSteps = 256;    // Sinkhorn normalisation steps kept for the backward (2 * iters - 1)

inline float bf16_to_f32(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {  // round to nearest even, NaN stays NaN (as torch)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

inline void load(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }
inline void load(const uint16_t* src, float* dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(src[i]);
}
inline void store(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }
inline void store(const float* src, uint16_t* dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = f32_to_bf16(src[i]);
}

inline float sigmoid(float z) { return 1.0f / (1.0f + std::exp(-z)); }

constexpr int TB = 16;  // tokens whose Sinkhorn iterations run side by side (one vector lane each)
constexpr int VL = 16;  // lanes of the partial sums in the dot products (independent FMA chains)

// GCC / Clang vector extensions: 16 floats, lowered to what the target has (one AVX-512 register, two AVX2 or
// four NEON ones); loops over them keep several independent accumulators so FMA latency is hidden.
typedef float vf __attribute__((vector_size(VL * sizeof(float))));

inline vf vload(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(vf));
  return v;
}
inline void vstore(float* p, vf v) { std::memcpy(p, &v, sizeof(vf)); }
inline float hsum(vf v) {
  float s = 0.f;
  for (int l = 0; l < VL; ++l) s += v[l];
  return s;
}

// <a, b> over n floats
inline float dot(const float* a, const float* b, int64_t n) {
  vf s0 = {0.f}, s1 = {0.f}, s2 = {0.f}, s3 = {0.f};
  int64_t i = 0;
  for (; i + 4 * VL <= n; i += 4 * VL) {
    s0 += vload(a + i) * vload(b + i);
    s1 += vload(a + i + VL) * vload(b + i + VL);
    s2 += vload(a + i + 2 * VL) * vload(b + i + 2 * VL);
    s3 += vload(a + i + 3 * VL) * vload(b + i + 3 * VL);
  }
  for (; i + VL <= n; i += VL) s0 += vload(a + i) * vload(b + i);
  float s = hsum((s0 + s1) + (s2 + s3));
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// out[j] = <x, w_j> for the m rows of w [m, k], eight rows per pass over x
void dots(const float* x, const float* w, int m, int64_t k, float* out) {
  int j0 = 0;
  for (; j0 + 8 <= m; j0 += 8) {
    vf acc[8];
    for (int j = 0; j < 8; ++j) acc[j] = vf{0.f};
    int64_t i = 0;
    for (; i + VL <= k; i += VL) {
      const vf xv = vload(x + i);
      for (int j = 0; j < 8; ++j) acc[j] += xv * vload(w + (j0 + j) * k + i);
    }
    for (int j = 0; j < 8; ++j) {
      float s = hsum(acc[j]);
      for (int64_t r = i; r < k; ++r) s += x[r] * w[(j0 + j) * k + r];
      out[j0 + j] = s;
    }
  }
  for (; j0 < m; ++j0) out[j0] = dot(x, w + j0 * k, k);
}

// acc[i] += sum_c coef[c * coef_stride] * src[c * src_stride + i] for i < len: 64 values of acc held in four
// vector accumulators across all the count sources (the dx and dfn accumulations of the backward)
void add_scaled_rows(float* acc, int64_t len, const float* coef, int64_t coef_stride, const float* src,
                     int64_t src_stride, int count) {
  int64_t i0 = 0;
  for (; i0 + 4 * VL <= len; i0 += 4 * VL) {
    vf a0 = vload(acc + i0), a1 = vload(acc + i0 + VL), a2 = vload(acc + i0 + 2 * VL), a3 = vload(acc + i0 + 3 * VL);
    for (int c = 0; c < count; ++c) {
      const float g = coef[c * coef_stride];
      const float* w = src + c * src_stride + i0;
      a0 += g * vload(w);
      a1 += g * vload(w + VL);
      a2 += g * vload(w + 2 * VL);
      a3 += g * vload(w + 3 * VL);
    }
    vstore(acc + i0, a0), vstore(acc + i0 + VL, a1), vstore(acc + i0 + 2 * VL, a2), vstore(acc + i0 + 3 * VL, a3);
  }
  for (; i0 < len; ++i0)
    for (int c = 0; c < count; ++c) acc[i0] += coef[c * coef_stride] * src[c * src_stride + i0];
}

// Sinkhorn of TB matrices side by side: ``x [n*n][TB]`` holds the row softmax + eps on entry and the result
// on exit; ``states`` (if not null) receives the matrix before every step (S = 2 * iters - 1 steps; step k
// normalises columns when k is even, rows when odd), [S][n*n][TB].
void sinkhorn_steps(float* x, int n, int iters, float eps, float* states) {
  const int steps = 2 * iters - 1;
  float d[TB];
  for (int k = 0; k < steps; ++k) {
    if (states) std::memcpy(states + static_cast<int64_t>(k) * n * n * TB, x, sizeof(float) * n * n * TB);
    for (int a = 0; a < n; ++a) {  // a: the column (even k) or the row (odd k) being normalised
      for (int l = 0; l < TB; ++l) d[l] = eps;
      for (int b = 0; b < n; ++b) {
        const float* e = x + (k % 2 == 0 ? b * n + a : a * n + b) * TB;
        for (int l = 0; l < TB; ++l) d[l] += e[l];
      }
      for (int l = 0; l < TB; ++l) d[l] = 1.0f / d[l];
      for (int b = 0; b < n; ++b) {
        float* e = x + (k % 2 == 0 ? b * n + a : a * n + b) * TB;
        for (int l = 0; l < TB; ++l) e[l] *= d[l];
      }
    }
  }
}

// row softmax of logits [n*n][TB] into p, and p + eps into x
void softmax_rows(const float* logits, int n, float eps, float* p, float* x) {
  for (int i = 0; i < n; ++i) {
    float mx[TB], s[TB];
    for (int l = 0; l < TB; ++l) mx[l] = logits[(i * n) * TB + l];
    for (int j = 1; j < n; ++j)
      for (int l = 0; l < TB; ++l) mx[l] = std::fmax(mx[l], logits[(i * n + j) * TB + l]);
    for (int l = 0; l < TB; ++l) s[l] = 0.f;
    for (int j = 0; j < n; ++j)
      for (int l = 0; l < TB; ++l) s[l] += (p[(i * n + j) * TB + l] = std::exp(logits[(i * n + j) * TB + l] - mx[l]));
    for (int l = 0; l < TB; ++l) s[l] = 1.0f / s[l];
    for (int j = 0; j < n; ++j)
      for (int l = 0; l < TB; ++l) {
        p[(i * n + j) * TB + l] *= s[l];
        x[(i * n + j) * TB + l] = p[(i * n + j) * TB + l] + eps;
      }
  }
}

// d logits [n*n][TB] from d comb ``g`` (overwritten), through the steps in reverse (Y = X / d:
// dX = (dY - sum_axis(dY * Y)) / d) and the row softmax (dL = p * (dP - sum_j dP p)).
void sinkhorn_backward(const float* logits, float* g, int n, int iters, float eps, float* p, float* x,
                       float* states, float* g_logits) {
  softmax_rows(logits, n, eps, p, x);
  sinkhorn_steps(x, n, iters, eps, states);
  float d[TB], gy[TB];
  for (int k = 2 * iters - 2; k >= 0; --k) {
    const float* xs = states + static_cast<int64_t>(k) * n * n * TB;
    for (int a = 0; a < n; ++a) {
      for (int l = 0; l < TB; ++l) d[l] = eps, gy[l] = 0.f;
      for (int b = 0; b < n; ++b) {
        const float* e = xs + (k % 2 == 0 ? b * n + a : a * n + b) * TB;
        for (int l = 0; l < TB; ++l) d[l] += e[l];
      }
      for (int l = 0; l < TB; ++l) d[l] = 1.0f / d[l];
      for (int b = 0; b < n; ++b) {
        const int idx = (k % 2 == 0 ? b * n + a : a * n + b) * TB;
        for (int l = 0; l < TB; ++l) gy[l] += g[idx + l] * (xs[idx + l] * d[l]);
      }
      for (int b = 0; b < n; ++b) {
        const int idx = (k % 2 == 0 ? b * n + a : a * n + b) * TB;
        for (int l = 0; l < TB; ++l) g[idx + l] = (g[idx + l] - gy[l]) * d[l];
      }
    }
  }
  for (int i = 0; i < n; ++i) {
    float s[TB] = {0.f};
    for (int j = 0; j < n; ++j)
      for (int l = 0; l < TB; ++l) s[l] += g[(i * n + j) * TB + l] * p[(i * n + j) * TB + l];
    for (int j = 0; j < n; ++j)
      for (int l = 0; l < TB; ++l)
        g_logits[(i * n + j) * TB + l] = p[(i * n + j) * TB + l] * (g[(i * n + j) * TB + l] - s[l]);
  }
}

template <typename X>
void fwd(const X* x, const float* fn, const float* base, const float* scale, int64_t tokens, int n, int64_t d, int m,
         int iters, float eps, float norm_eps, float* mixes, float* rstd, float* post, float* comb, X* h, int nthreads) {
  const int64_t k = n * d;
  const int64_t blocks = (tokens + TB - 1) / TB;
#pragma omp parallel num_threads(nthreads)
  {
    std::vector<float> xf(k), hf(d);
    float logits[kMaxN * kMaxN * TB], p[kMaxN * kMaxN * TB], sk[kMaxN * kMaxN * TB];
#pragma omp for schedule(static)
    for (int64_t blk = 0; blk < blocks; ++blk) {
      const int64_t t0 = blk * TB;
      const int nt = static_cast<int>(tokens - t0 < TB ? tokens - t0 : TB);
      for (int l = 0; l < nt; ++l) {  // row statistics, mixes, collapse: one token at a time
        const int64_t t = t0 + l;
        load(x + t * k, xf.data(), k);
        const float r = 1.0f / std::sqrt(dot(xf.data(), xf.data(), k) / static_cast<float>(k) + norm_eps);
        rstd[t] = r;
        float* mix = mixes + t * m;
        dots(xf.data(), fn, m, k, mix);
        for (int j = 0; j < m; ++j) mix[j] *= r;
        for (int i = 0; i < d; ++i) hf[i] = 0.f;
        for (int s = 0; s < n; ++s) {
          const float ps = sigmoid(mix[s] * scale[0] + base[s]) + eps;
          const float* xs = xf.data() + s * d;
          for (int64_t i = 0; i < d; ++i) hf[i] += ps * xs[i];
        }
        store(hf.data(), h + t * d, d);
        if (m > n) {
          for (int s = 0; s < n; ++s) post[t * n + s] = 2.0f * sigmoid(mix[n + s] * scale[1] + base[n + s]);
          for (int s = 0; s < n * n; ++s) logits[s * TB + l] = mix[2 * n + s] * scale[2] + base[2 * n + s];
        }
      }
      if (m > n) {  // the block's Sinkhorn projections side by side
        for (int l = nt; l < TB; ++l)
          for (int s = 0; s < n * n; ++s) logits[s * TB + l] = 0.f;
        softmax_rows(logits, n, eps, p, sk);
        sinkhorn_steps(sk, n, iters, eps, nullptr);
        for (int l = 0; l < nt; ++l)
          for (int s = 0; s < n * n; ++s) comb[(t0 + l) * n * n + s] = sk[s * TB + l];
      }
    }
  }
}

template <typename X>
void bwd(const X* x, const float* fn, const float* base, const float* scale, const float* mixes, const float* rstd,
         const float* g_post, const float* g_comb, const X* g_h, int64_t tokens, int n, int64_t d, int m, int iters,
         float eps, X* dx, float* dfn, float* dbase, float* dscale, int nthreads) {
  const int64_t k = n * d;
  const int64_t blocks = (tokens + TB - 1) / TB;
  // per-thread partial sums of dfn / dbase / dscale, added in thread order afterwards (deterministic for a
  // given thread count: bit-exact resume)
  const int64_t width = static_cast<int64_t>(m) * k + m + 3;
  std::vector<float> partial(static_cast<int64_t>(nthreads) * width, 0.f);
  int used = 1;
#pragma omp parallel num_threads(nthreads)
  {
#pragma omp single
    used = omp_get_num_threads();
    float* dfn_t = partial.data() + omp_get_thread_num() * width;
    float* dbase_t = dfn_t + static_cast<int64_t>(m) * k;
    float* dscale_t = dbase_t + m;
    std::vector<float> acc(k), xblk(TB * k), ghblk(TB * d), gsb(static_cast<int64_t>(m) * TB);
    std::vector<float> states(m > n ? static_cast<int64_t>(2 * iters - 1) * n * n * TB : 0);
    std::vector<float> gmix(static_cast<int64_t>(m) * TB);  // [token in block][m]
    float logits[kMaxN * kMaxN * TB], gl[kMaxN * kMaxN * TB], p[kMaxN * kMaxN * TB], sk[kMaxN * kMaxN * TB];
    float g_logits[kMaxN * kMaxN * TB];
#pragma omp for schedule(static)
    for (int64_t blk = 0; blk < blocks; ++blk) {
      const int64_t t0 = blk * TB;
      const int nt = static_cast<int>(tokens - t0 < TB ? tokens - t0 : TB);
      for (int l = 0; l < nt; ++l) {  // d pre (<g_h, x_s>) and d post, per token
        const int64_t t = t0 + l;
        float* xl = xblk.data() + l * k;  // the block's streams and output gradients, kept in fp32 for the dx pass
        float* gl_h = ghblk.data() + l * d;
        load(x + t * k, xl, k);
        load(g_h + t * d, gl_h, d);
        const float* mix = mixes + t * m;
        float* gm = gmix.data() + l * m;
        for (int s = 0; s < n; ++s) {
          const float sg = sigmoid(mix[s] * scale[0] + base[s]);
          const float dz = dot(gl_h, xl + s * d, d) * sg * (1.0f - sg);
          gm[s] = dz;
        }
        if (m > n) {
          for (int s = 0; s < n; ++s) {
            const float sg = sigmoid(mix[n + s] * scale[1] + base[n + s]);
            gm[n + s] = g_post[t * n + s] * 2.0f * sg * (1.0f - sg);
          }
          for (int s = 0; s < n * n; ++s) {
            logits[s * TB + l] = mix[2 * n + s] * scale[2] + base[2 * n + s];
            gl[s * TB + l] = g_comb[t * n * n + s];
          }
        }
      }
      if (m > n) {  // the block's Sinkhorn backward side by side
        for (int l = nt; l < TB; ++l)
          for (int s = 0; s < n * n; ++s) logits[s * TB + l] = 0.f, gl[s * TB + l] = 0.f;
        sinkhorn_backward(logits, gl, n, iters, eps, p, sk, states.data(), g_logits);
        for (int l = 0; l < nt; ++l)
          for (int s = 0; s < n * n; ++s) gmix[l * m + 2 * n + s] = g_logits[s * TB + l];
      }
      for (int l = 0; l < nt; ++l) {  // dx: one token at a time
        const int64_t t = t0 + l;
        const float* mix = mixes + t * m;
        const float r = rstd[t];
        const float* dz = gmix.data() + l * m;  // d (mixes * scale + base)
        float* gs = gsb.data() + l * m;         // d mixes * r
        float gsum = 0.f, pre[kMaxN];
        for (int j = 0; j < m; ++j) {
          const int part = j < n ? 0 : (j < 2 * n ? 1 : 2);
          dbase_t[j] += dz[j];
          dscale_t[part] += dz[j] * mix[j];
          const float g = dz[j] * scale[part];
          gsum += g * mix[j];
          gs[j] = g * r;
        }
        for (int s = 0; s < n; ++s) pre[s] = sigmoid(mix[s] * scale[0] + base[s]) + eps;
        const float* __restrict__ xl = xblk.data() + l * k;
        const float* __restrict__ gh = ghblk.data() + l * d;
        // mixes = r <x, fn_m>: dx = sum_m (g_m r) fn_m - x r^2 / K sum_m g_m mixes_m
        const float coef = -gsum * r * r / static_cast<float>(k);
        float* __restrict__ ac = acc.data();
        for (int s = 0; s < n; ++s) {
          const float ps = pre[s];
          for (int64_t i = 0; i < d; ++i) ac[s * d + i] = ps * gh[i] + coef * xl[s * d + i];
        }
        add_scaled_rows(ac, k, gs, 1, fn, k, m);
        store(ac, dx + t * k, k);
      }
      // dfn_m += sum over the block's tokens of (g_m r) x: each dfn row loaded and stored once per block
      for (int j = 0; j < m; ++j) add_scaled_rows(dfn_t + j * k, k, gsb.data() + j, m, xblk.data(), k, nt);
    }
  }
#pragma omp parallel for num_threads(nthreads) schedule(static)
  for (int64_t i = 0; i < width; ++i) {
    float v = 0.f;
    for (int th = 0; th < used; ++th) v += partial[th * width + i];
    (i < m * k ? dfn[i] : i < m * k + m ? dbase[i - m * k] : dscale[i - m * k - m]) = v;
  }
}

}  // namespace

extern "C" {
int trex_hc_pre_max_n() { return kMaxN; }
int trex_hc_pre_max_steps() { return kMaxSteps; }

void trex_hc_pre_fwd_f32(const float* x, const float* fn, const float* base, const float* scale, int64_t tokens, int n,
                         int64_t d, int m, int iters, float eps, float norm_eps, float* mixes, float* rstd, float* post,
                         float* comb, float* h, int nthreads) {
  fwd(x, fn, base, scale, tokens, n, d, m, iters, eps, norm_eps, mixes, rstd, post, comb, h, nthreads);
}
void trex_hc_pre_fwd_bf16(const uint16_t* x, const float* fn, const float* base, const float* scale, int64_t tokens,
                          int n, int64_t d, int m, int iters, float eps, float norm_eps, float* mixes, float* rstd,
                          float* post, float* comb, uint16_t* h, int nthreads) {
  fwd(x, fn, base, scale, tokens, n, d, m, iters, eps, norm_eps, mixes, rstd, post, comb, h, nthreads);
}
void trex_hc_pre_bwd_f32(const float* x, const float* fn, const float* base, const float* scale, const float* mixes,
                         const float* rstd, const float* g_post, const float* g_comb, const float* g_h, int64_t tokens,
                         int n, int64_t d, int m, int iters, float eps, float* dx, float* dfn, float* dbase,
                         float* dscale, int nthreads) {
  bwd(x, fn, base, scale, mixes, rstd, g_post, g_comb, g_h, tokens, n, d, m, iters, eps, dx, dfn, dbase, dscale,
      nthreads);
}
void trex_hc_pre_bwd_bf16(const uint16_t* x, const float* fn, const float* base, const float* scale,
                          const float* mixes, const float* rstd, const float* g_post, const float* g_comb,
                          const uint16_t* g_h, int64_t tokens, int n, int64_t d, int m, int iters, float eps,
                          uint16_t* dx, float* dfn, float* dbase, float* dscale, int nthreads) {
  bwd(x, fn, base, scale, mixes, rstd, g_post, g_comb, g_h, tokens, n, d, m, iters, eps, dx, dfn, dbase, dscale,
      nthreads);
}
}
