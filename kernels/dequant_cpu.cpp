// Dequantisation of the published DeepSeek-V4 weights on a CPU: the C++ backend of kernels/dequant.py (which holds
// the definition and the torch reference the tests compare with). One pass over the codes writes the output:
//
//   MXFP4  codes [R, C/2] (two E2M1 codes a byte, low nibble first), E8M0 scales [R, C/32]:
//          per 32-group the 16 code values times the group's scale, rounded once to the output type, then one
//          table lookup per value;
//   FP8    codes [R, C] (e4m3fn), float32 scales [ceil(R/128), ceil(C/128)] (E8M0 widened by the caller):
//          out = value(code) * scale of its 128 x 128 block, computed in float32 and rounded once.
//
// The code -> float tables come from torch (``e2m1`` [16], ``e8m0`` [256], ``fp8`` [256]), so every value equals
// the reference's. Output bf16 (round to nearest even, NaN kept) or float32. Rows are split over OpenMP threads
// (the runtime torch loaded, ``nthreads`` from the caller).
#include <cstdint>
#include <cstring>
#include <omp.h>

namespace {

inline uint16_t f32_to_bf16(float f) {  // round to nearest even, NaN stays NaN (as torch)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

template <typename Out> inline Out convert(float f);
template <> inline uint16_t convert<uint16_t>(float f) { return f32_to_bf16(f); }
template <> inline float convert<float>(float f) { return f; }

template <typename Out>
void mxfp4(const uint8_t* codes, const uint8_t* scales, const float* e2m1, const float* e8m0, int64_t rows,
           int64_t cols, Out* out, int nthreads) {
  const int64_t groups = cols / 32;
#pragma omp parallel for num_threads(nthreads) schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* c = codes + r * (cols / 2);
    const uint8_t* s = scales + r * groups;
    Out* o = out + r * cols;
    for (int64_t g = 0; g < groups; ++g) {
      const float scale = e8m0[s[g]];
      Out lut[16];
      for (int i = 0; i < 16; ++i) lut[i] = convert<Out>(e2m1[i] * scale);
      const uint8_t* cg = c + g * 16;
      Out* og = o + g * 32;
      for (int j = 0; j < 16; ++j) {
        const uint8_t b = cg[j];
        og[2 * j] = lut[b & 15];
        og[2 * j + 1] = lut[b >> 4];
      }
    }
  }
}

template <typename Out>
void fp8(const uint8_t* codes, const float* scales, const float* table, int64_t rows, int64_t cols, Out* out,
         int nthreads) {
  const int64_t scale_cols = (cols + 127) / 128;
#pragma omp parallel for num_threads(nthreads) schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* c = codes + r * cols;
    const float* s = scales + (r / 128) * scale_cols;
    Out* o = out + r * cols;
    for (int64_t b = 0; b < scale_cols; ++b) {
      const float scale = s[b];
      const int64_t lo = b * 128, hi = lo + 128 < cols ? lo + 128 : cols;
#pragma omp simd
      for (int64_t k = lo; k < hi; ++k) o[k] = convert<Out>(table[c[k]] * scale);
    }
  }
}

}  // namespace

extern "C" {
void trex_dequant_mxfp4_bf16(const uint8_t* codes, const uint8_t* scales, const float* e2m1, const float* e8m0,
                             int64_t rows, int64_t cols, uint16_t* out, int nthreads) {
  mxfp4<uint16_t>(codes, scales, e2m1, e8m0, rows, cols, out, nthreads);
}
void trex_dequant_mxfp4_f32(const uint8_t* codes, const uint8_t* scales, const float* e2m1, const float* e8m0,
                            int64_t rows, int64_t cols, float* out, int nthreads) {
  mxfp4<float>(codes, scales, e2m1, e8m0, rows, cols, out, nthreads);
}
void trex_dequant_fp8_bf16(const uint8_t* codes, const float* scales, const float* table, int64_t rows, int64_t cols,
                           uint16_t* out, int nthreads) {
  fp8<uint16_t>(codes, scales, table, rows, cols, out, nthreads);
}
void trex_dequant_fp8_f32(const uint8_t* codes, const float* scales, const float* table, int64_t rows, int64_t cols,
                          float* out, int nthreads) {
  fp8<float>(codes, scales, table, rows, cols, out, nthreads);
}
}
