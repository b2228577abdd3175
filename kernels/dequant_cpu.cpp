// Dequantisation of the published DeepSeek-V4 weights on a CPU: the C++ backend of kernels/dequant.py (which holds
// the definition and the torch reference the tests compare with). One pass over the codes writes the output:
//
//   MXFP4  codes [R, C/2] (two E2M1 codes a byte, low nibble first), E8M0 scales [R, C/32]:
//          each value is one of the 16 code values times the group's scale, rounded once to the output type:
//          table lookups (bf16: byte shuffles over tables made per scale byte);
//   FP8    codes [R, C] (e4m3fn), float32 scales [ceil(R/128), ceil(C/128)] (E8M0 widened by the caller):
//          out = value(code) * scale of its 128 x 128 block, computed in float32 and rounded once (a 256-entry
//          table per block).
//
// The code -> float tables come from torch (``e2m1`` [16], ``e8m0`` [256], ``fp8`` [256]), so every value equals
// the reference's. Output bf16 (round to nearest even, NaN kept) or float32. Rows are split over OpenMP threads
// (the runtime torch loaded, ``nthreads`` from the caller).
#include <cstdint>
#include <cstring>
#include <omp.h>
#include <vector>
#if defined(__SSSE3__)
#include <tmmintrin.h>
#endif

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

// MXFP4 to bf16: the output of a 32-group is 16 lookups into the group's 16-entry table of bf16 values, which
// depends on the scale byte alone: the tables of all 256 scales are made first (8 KB, split into a low-byte and a
// high-byte plane), then each group is two byte shuffles per plane (SSSE3), or a scalar loop without SSSE3.
void mxfp4_bf16(const uint8_t* codes, const uint8_t* scales, const float* e2m1, const float* e8m0, int64_t rows,
                int64_t cols, uint16_t* out, int nthreads) {
  alignas(16) uint8_t lo_plane[256][16], hi_plane[256][16];
  for (int s = 0; s < 256; ++s)
    for (int i = 0; i < 16; ++i) {
      const uint16_t v = f32_to_bf16(e2m1[i] * e8m0[s]);
      lo_plane[s][i] = static_cast<uint8_t>(v & 0xff);
      hi_plane[s][i] = static_cast<uint8_t>(v >> 8);
    }
  const int64_t groups = cols / 32;
#pragma omp parallel for num_threads(nthreads) schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* c = codes + r * (cols / 2);
    const uint8_t* s = scales + r * groups;
    uint16_t* o = out + r * cols;
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* cg = c + g * 16;
      uint16_t* og = o + g * 32;
#if defined(__SSSE3__)
      const __m128i tl = _mm_load_si128(reinterpret_cast<const __m128i*>(lo_plane[s[g]]));
      const __m128i th = _mm_load_si128(reinterpret_cast<const __m128i*>(hi_plane[s[g]]));
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(cg));
      const __m128i nib = _mm_set1_epi8(0x0f);
      const __m128i lo = _mm_and_si128(b, nib), hi = _mm_and_si128(_mm_srli_epi16(b, 4), nib);
      const __m128i i0 = _mm_unpacklo_epi8(lo, hi), i1 = _mm_unpackhi_epi8(lo, hi);  // output order
      const __m128i l0 = _mm_shuffle_epi8(tl, i0), h0 = _mm_shuffle_epi8(th, i0);
      const __m128i l1 = _mm_shuffle_epi8(tl, i1), h1 = _mm_shuffle_epi8(th, i1);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(og), _mm_unpacklo_epi8(l0, h0));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(og + 8), _mm_unpackhi_epi8(l0, h0));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(og + 16), _mm_unpacklo_epi8(l1, h1));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(og + 24), _mm_unpackhi_epi8(l1, h1));
#else
      const uint8_t* tl = lo_plane[s[g]];
      const uint8_t* th = hi_plane[s[g]];
      for (int j = 0; j < 16; ++j) {
        const uint8_t x = cg[j];
        og[2 * j] = static_cast<uint16_t>(tl[x & 15] | (th[x & 15] << 8));
        og[2 * j + 1] = static_cast<uint16_t>(tl[x >> 4] | (th[x >> 4] << 8));
      }
#endif
    }
  }
}

void mxfp4_f32(const uint8_t* codes, const uint8_t* scales, const float* e2m1, const float* e8m0, int64_t rows,
               int64_t cols, float* out, int nthreads) {
  const int64_t groups = cols / 32;
#pragma omp parallel for num_threads(nthreads) schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* c = codes + r * (cols / 2);
    const uint8_t* s = scales + r * groups;
    float* o = out + r * cols;
    for (int64_t g = 0; g < groups; ++g) {
      const float scale = e8m0[s[g]];
      float lut[16];
      for (int i = 0; i < 16; ++i) lut[i] = e2m1[i] * scale;
      const uint8_t* cg = c + g * 16;
      float* og = o + g * 32;
      for (int j = 0; j < 16; ++j) {
        og[2 * j] = lut[cg[j] & 15];
        og[2 * j + 1] = lut[cg[j] >> 4];
      }
    }
  }
}

// FP8: per 128 x 128 block the 256 code values times the block's scale, rounded once: a 256-entry table per block
// of a block row (made once per block row), then one lookup per value, row by row.
template <typename Out>
void fp8(const uint8_t* codes, const float* scales, const float* table, int64_t rows, int64_t cols, Out* out,
         int nthreads) {
  const int64_t scale_cols = (cols + 127) / 128, block_rows = (rows + 127) / 128;
#pragma omp parallel num_threads(nthreads)
  {
    std::vector<Out> lut(scale_cols * 256);
#pragma omp for schedule(static)
    for (int64_t br = 0; br < block_rows; ++br) {
      for (int64_t bc = 0; bc < scale_cols; ++bc) {
        const float scale = scales[br * scale_cols + bc];
        for (int i = 0; i < 256; ++i) lut[bc * 256 + i] = convert<Out>(table[i] * scale);
      }
      const int64_t r1 = br * 128 + 128 < rows ? br * 128 + 128 : rows;
      for (int64_t r = br * 128; r < r1; ++r) {
        const uint8_t* c = codes + r * cols;
        Out* o = out + r * cols;
        for (int64_t bc = 0; bc < scale_cols; ++bc) {
          const Out* t = lut.data() + bc * 256;
          const int64_t lo = bc * 128, hi = lo + 128 < cols ? lo + 128 : cols;
          for (int64_t k = lo; k < hi; ++k) o[k] = t[c[k]];
        }
      }
    }
  }
}

}  // namespace

extern "C" {
void trex_dequant_mxfp4_bf16(const uint8_t* codes, const uint8_t* scales, const float* e2m1, const float* e8m0,
                             int64_t rows, int64_t cols, uint16_t* out, int nthreads) {
  mxfp4_bf16(codes, scales, e2m1, e8m0, rows, cols, out, nthreads);
}
void trex_dequant_mxfp4_f32(const uint8_t* codes, const uint8_t* scales, const float* e2m1, const float* e8m0,
                            int64_t rows, int64_t cols, float* out, int nthreads) {
  mxfp4_f32(codes, scales, e2m1, e8m0, rows, cols, out, nthreads);
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
