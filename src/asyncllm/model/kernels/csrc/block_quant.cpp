// Block-quantized linear products (Q8_0, Q4_0, Q4_1 weights; int8 activation blocks; integer dot products).
//
// Weights are blocks of 32 values along the input dimension with a float16 scale (and, for Q4_1, a float16 minimum)
// per block: Q8_0 w = d * q (q int8), Q4_0 w = d * (q - 8) (q 0..15), Q4_1 w = d * q + m (q 0..15): the block types
// of llama.cpp's GGUF files (ggml's quants describe them; this is our own layout and code). Output columns come in
// groups of 4 whose blocks are interleaved, so one pass over a block index reads 4 columns' blocks from one place
// and reuses them across up to 4 rows (a GEMV streams each weight byte once; a tile of 4 rows x 4 columns reads a
// weight block once per 4 rows; on vnni and amx the 1-5 row GEMV takes 4 groups, 16 columns, per pass and sums
// their block dots in registers). From kGemmMinRows rows a GEMM unpacks each panel of columns once per call and
// sweeps every row over it (below: vnni, every kind; avx2, Q4_0 and Q4_1, and Q8_0 from kQ8GemmMinRows2 rows; from
// kAmxMinRows rows on the "amx" path,
// the same panels as AMX int8 tiles, every kind). Activations are quantized per row and
// block of 32 to int8 with a float32 scale dx = max|x| / 127 and the sum s of the block's values (for Q4_0's
// offset and Q4_1's minimum term).
//
// The integer dot of a block is exact on every path (AVX-512 VNNI `vpdpbusd` on 256-bit vectors, 512-bit in the
// GEMM; AMX `tdpbssd` with K = 32, one block per tile product; AVX2 `vpmaddubsw` + `vpmaddwd`; scalar C++); the float32 arithmetic after it is the same operation for
// operation (built with -ffp-contract=off), so every path gives the same bits and tests compare them exactly with a
// numpy reference. Columns are shared out to threads in whole groups (panels in the GEMMs), each output summed by
// one thread in block order: values do not depend on the thread count, nor a row's on the other rows of its batch.
#include "vec_capability.h"
#include "block_quant.h"

#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#if defined(__linux__) && defined(__x86_64__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace {

constexpr int64_t kBlock = 32;  // values per block
constexpr int64_t kGroup = 4;   // output columns per interleaved group
constexpr int64_t kRowTile = 4; // rows sharing one read of a group's weight blocks
// From this many rows the unpacked-panel GEMM serves a product on the vnni path (measured, 1 thread, SmolLM2's
// shapes: at 4 rows the GEMV and the GEMM were level within noise, at 6 the GEMM was 5-15% faster).
constexpr int64_t kGemmMinRows = 6;

enum Kind : int64_t { kQ8_0 = 0, kQ4_0 = 1, kQ4_1 = 2 };

#if defined(__AVX2__) && defined(__F16C__)
#define ASYNCLLM_BLOCK_AVX2 1
#endif
#if defined(ASYNCLLM_BLOCK_AVX2) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define ASYNCLLM_BLOCK_VNNI 1
#endif

// AMX tiles where the build has AVX-512 VNNI (every AMX CPU has it) on Linux (the tile permission is asked from its
// kernel) with a compiler that has the AMX intrinsics; whether this CPU and kernel allow them is asked at run time.
#if defined(ASYNCLLM_BLOCK_VNNI) && defined(__linux__) && defined(__x86_64__) && \
    (defined(__clang__) && __clang_major__ >= 12 || !defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11)
#define ASYNCLLM_BLOCK_AMX 1
#endif

enum class Path { kScalar, kAvx2, kVnni, kAmx };

struct Acts {  // a quantized activation matrix
  const int8_t* q;   // [rows, nb * 32]
  const float* d;    // [rows, nb]
  const int32_t* s;  // [rows, nb]
  int64_t nb;
};

struct Weights {  // one block weight in the grouped layout (block_quant.h)
  const uint8_t* qs;
  const c10::Half* d;
  const c10::Half* m;  // Q4_1 only
  int64_t nb;
  int64_t block_bytes;  // 32 (Q8_0) or 16 (Q4)
};

void quantize_row(const float* x, int64_t nb, int8_t* q, float* d, int32_t* s) {
  int64_t b = 0;
#ifdef __AVX512F__
  // The same steps 16 values at a time: max|x| is exact in any order, vdivps is IEEE division and vcvtps2dq rounds
  // half to even under the default rounding mode, as std::nearbyint does; |q| <= 127, so vpmovdb keeps every value.
  const __m512 sign = _mm512_set1_ps(-0.0f);
  for (; b < nb; ++b) {
    const float* xb = x + b * kBlock;
    const __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
    const __m512 a0 = _mm512_andnot_ps(sign, x0), a1 = _mm512_andnot_ps(sign, x1);
    // vmaxps returns its second operand where either is NaN: with 0 second, a NaN is skipped as std::max skips it
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(a0, _mm512_max_ps(a1, _mm512_setzero_ps())));
    const float scale = amax / 127.0f;
    d[b] = scale;
    int8_t* qb = q + b * kBlock;
    if (scale == 0.0f) {
      std::memset(qb, 0, kBlock);
      s[b] = 0;
      continue;
    }
    const __m512 sv = _mm512_set1_ps(scale);
    const __m512i q0 = _mm512_cvtps_epi32(_mm512_div_ps(x0, sv)), q1 = _mm512_cvtps_epi32(_mm512_div_ps(x1, sv));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(qb), _mm512_cvtepi32_epi8(q0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(qb + 16), _mm512_cvtepi32_epi8(q1));
    s[b] = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
  }
#endif
  for (; b < nb; ++b) {
    const float* xb = x + b * kBlock;
    float amax = 0.0f;
    for (int64_t j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(xb[j]));
    const float scale = amax / 127.0f;
    d[b] = scale;
    int32_t sum = 0;
    int8_t* qb = q + b * kBlock;
    if (scale == 0.0f) {
      std::memset(qb, 0, kBlock);
    } else {
      for (int64_t j = 0; j < kBlock; ++j) {
        const int32_t v = static_cast<int32_t>(std::nearbyint(xb[j] / scale));
        qb[j] = static_cast<int8_t>(v);
        sum += v;
      }
    }
    s[b] = sum;
  }
}

// One group of 4 columns for rows [r0, r1), plain C++: the reference every vector path equals bit for bit.
template <int64_t KIND>
void group_scalar(const Acts& a, const Weights& w, int64_t g, int64_t r0, int64_t r1, float* out, int64_t ldo,
                  int64_t columns) {
  for (int64_t r = r0; r < r1; ++r) {
    float acc[kGroup] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int64_t b = 0; b < w.nb; ++b) {
      const int64_t block = g * w.nb + b;
      const uint8_t* wq = w.qs + block * kGroup * w.block_bytes;
      const int8_t* xq = a.q + (r * a.nb + b) * kBlock;
      const float dx = a.d[r * a.nb + b];
      const int32_t sx = a.s[r * a.nb + b];
      for (int64_t c = 0; c < kGroup; ++c) {
        int32_t dot = 0;
        if (KIND == kQ8_0) {
          const int8_t* wc = reinterpret_cast<const int8_t*>(wq + c * kBlock);
          for (int64_t j = 0; j < kBlock; ++j) dot += int32_t(wc[j]) * int32_t(xq[j]);
        } else {
          const uint8_t* wc = wq + c * (kBlock / 2);
          for (int64_t j = 0; j < kBlock / 2; ++j) {
            dot += int32_t(wc[j] & 15) * int32_t(xq[j]) + int32_t(wc[j] >> 4) * int32_t(xq[j + kBlock / 2]);
          }
        }
        const float dw = static_cast<float>(w.d[block * kGroup + c]);
        if (KIND == kQ8_0) {
          acc[c] = acc[c] + float(dot) * (dw * dx);
        } else if (KIND == kQ4_0) {
          acc[c] = acc[c] + float(dot - 8 * sx) * (dw * dx);
        } else {
          const float mw = static_cast<float>(w.m[block * kGroup + c]);
          acc[c] = acc[c] + (float(dot) * (dw * dx) + (mw * dx) * float(sx));
        }
      }
    }
    for (int64_t c = 0; c < columns; ++c) out[r * ldo + g * kGroup + c] = acc[c];
  }
}

#ifdef ASYNCLLM_BLOCK_AVX2
// Exact int32 dot products of 32 unsigned bytes with 32 signed bytes, in 8 lanes (callers sum the lanes).
template <bool VNNI>
inline __m256i dot_u8s8(__m256i u, __m256i s) {
#ifdef ASYNCLLM_BLOCK_VNNI
  if constexpr (VNNI) return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#endif
  // pair sums are at most 2 * 127 * 127 (Q8_0) or 2 * 15 * 127 (Q4): no int16 saturation
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

// The 8-lane sums of 4 vectors -> [sum(d0), sum(d1), sum(d2), sum(d3)], exact.
inline __m128i hsum4(__m256i d0, __m256i d1, __m256i d2, __m256i d3) {
  const __m256i s = _mm256_hadd_epi32(_mm256_hadd_epi32(d0, d1), _mm256_hadd_epi32(d2, d3));
  return _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
}

inline __m128 load_half4(const c10::Half* p) {
  return _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}

template <int64_t KIND, bool VNNI>
void group_simd(const Acts& a, const Weights& w, int64_t g, int64_t r0, int64_t r1, float* out, int64_t ldo,
                int64_t columns) {
  const __m256i low_nibbles = _mm256_set1_epi8(15);
  for (int64_t rt = r0; rt < r1; rt += kRowTile) {
    const int64_t rows = std::min(kRowTile, r1 - rt);
    __m128 acc[kRowTile];
    for (int64_t i = 0; i < kRowTile; ++i) acc[i] = _mm_setzero_ps();
    for (int64_t b = 0; b < w.nb; ++b) {
      const int64_t block = g * w.nb + b;
      const uint8_t* wq = w.qs + block * kGroup * w.block_bytes;
      __m256i wv[kGroup];
      for (int64_t c = 0; c < kGroup; ++c) {
        if (KIND == kQ8_0) {
          wv[c] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wq + c * kBlock));
        } else {
          const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wq + c * (kBlock / 2)));
          wv[c] = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(packed, 4), packed), low_nibbles);
        }
      }
      const __m128 dw = load_half4(w.d + block * kGroup);
      __m128 mw = _mm_setzero_ps();
      if (KIND == kQ4_1) mw = load_half4(w.m + block * kGroup);
      for (int64_t i = 0; i < rows; ++i) {
        const int64_t r = rt + i;
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q + (r * a.nb + b) * kBlock));
        __m256i dots[kGroup];
        if (KIND == kQ8_0) {
          const __m256i ax = _mm256_sign_epi8(xv, xv);  // |x| (x is never -128)
          for (int64_t c = 0; c < kGroup; ++c) dots[c] = dot_u8s8<VNNI>(ax, _mm256_sign_epi8(wv[c], xv));
        } else {
          for (int64_t c = 0; c < kGroup; ++c) dots[c] = dot_u8s8<VNNI>(wv[c], xv);
        }
        __m128i dot = hsum4(dots[0], dots[1], dots[2], dots[3]);
        const float dx_scalar = a.d[r * a.nb + b];
        const int32_t sx = a.s[r * a.nb + b];
        const __m128 dx = _mm_set1_ps(dx_scalar);
        if (KIND == kQ4_0) dot = _mm_sub_epi32(dot, _mm_set1_epi32(8 * sx));
        __m128 term = _mm_mul_ps(_mm_cvtepi32_ps(dot), _mm_mul_ps(dw, dx));
        if (KIND == kQ4_1) term = _mm_add_ps(term, _mm_mul_ps(_mm_mul_ps(mw, dx), _mm_set1_ps(float(sx))));
        acc[i] = _mm_add_ps(acc[i], term);
      }
    }
    for (int64_t i = 0; i < rows; ++i) {
      float values[kGroup];
      _mm_storeu_ps(values, acc[i]);
      for (int64_t c = 0; c < columns; ++c) out[(rt + i) * ldo + g * kGroup + c] = values[c];
    }
  }
}
#endif

#ifdef ASYNCLLM_BLOCK_VNNI
// --- the few-row GEMV (AVX-512 VNNI, 512-bit vectors) ----------------------------------------------------------------
// 1 to kGemmMinRows - 1 rows against a chunk of 16 columns (4 groups, whose blocks lie next to each other in memory)
// per pass over the blocks. Per block, group j's 64 bytes (Q4: 4 columns x 16 bytes; Q8_0: 128 bytes, halves
// regrouped) give two vectors whose 128-bit lane c holds column c's values 0-15 and 16-31, met by the row's values
// 0-15 and 16-31 broadcast to every lane in two `vpdpbusd`; the 4 partial sums per column are added in registers
// (unpack + add, exact) into one int32 per column, so no horizontal sum per group and block as in group_simd. Then
// the float32 steps of group_scalar for 16 columns at once, in block order. Q8_0 weights are taken + 128 (unsigned)
// and the row's sum starts at -128 s; Q4_0 at -8 s: exact integers, the same bits as every other path.
// The next chunk's lines are prefetched one chunk ahead (the weight streams from memory at batch 1).
constexpr int64_t kChunk = 16;  // columns per GEMV chunk
constexpr int kGemvMaxRows = 4;  // rows per GEMV pass (a 5th row takes a second pass)

// Column (j, c) of 4 vectors whose lane 4c + k holds partial k of group j's column c -> lane 4c + j, exact.
inline __m512i sum_partials(__m512i d0, __m512i d1, __m512i d2, __m512i d3) {
  const __m512i s01 = _mm512_add_epi32(_mm512_unpacklo_epi32(d0, d1), _mm512_unpackhi_epi32(d0, d1));
  const __m512i s23 = _mm512_add_epi32(_mm512_unpacklo_epi32(d2, d3), _mm512_unpackhi_epi32(d2, d3));
  return _mm512_add_epi32(_mm512_unpacklo_epi64(s01, s23), _mm512_unpackhi_epi64(s01, s23));
}

// The 16 float16 values at p[j] + offset (4 each, j = 0..3) as float32, lane 4j + c.
inline __m512 load_half16(const c10::Half* const* p, int64_t offset) {
  const __m128i a = _mm_unpacklo_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p[0] + offset)),
                                       _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p[1] + offset)));
  const __m128i b = _mm_unpacklo_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p[2] + offset)),
                                       _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p[3] + offset)));
  return _mm512_cvtph_ps(_mm256_set_m128i(b, a));
}

template <int64_t KIND, int R>
void gemv_chunk(const Acts& a, const Weights& w, int64_t g0, int64_t groups, int64_t r0, float* out, int64_t ldo,
                int64_t columns) {
  const int64_t nb = w.nb, group_bytes = nb * kGroup * w.block_bytes;
  const __m512i low = _mm512_set1_epi8(15), flip = _mm512_set1_epi8(static_cast<char>(0x80));
  const __m512i to_columns = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  // a chunk past the last real group reads the last one again (its outputs are not stored)
  const uint8_t* src[kGroup];
  const c10::Half* dp[kGroup];
  const c10::Half* mp[kGroup];
  for (int64_t j = 0; j < kGroup; ++j) {
    const int64_t g = g0 + std::min(j, groups - 1);
    src[j] = w.qs + g * group_bytes;
    dp[j] = w.d + g * nb * kGroup;
    mp[j] = KIND == kQ4_1 ? w.m + g * nb * kGroup : nullptr;
  }
  const uint8_t* next = w.qs + (g0 + kGroup) * group_bytes;  // the next chunk (may be past the end: prefetch only)
  __m512 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m512i lo[kGroup], hi[kGroup];
    for (int64_t j = 0; j < kGroup; ++j) {
      const uint8_t* p = src[j] + b * kGroup * w.block_bytes;
      if (KIND == kQ8_0) {
        const __m512i z0 = _mm512_xor_si512(_mm512_loadu_si512(p), flip);
        const __m512i z1 = _mm512_xor_si512(_mm512_loadu_si512(p + 64), flip);
        lo[j] = _mm512_shuffle_i64x2(z0, z1, _MM_SHUFFLE(2, 0, 2, 0));
        hi[j] = _mm512_shuffle_i64x2(z0, z1, _MM_SHUFFLE(3, 1, 3, 1));
        _mm_prefetch(reinterpret_cast<const char*>(next + (j * nb + b) * kGroup * w.block_bytes), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(next + (j * nb + b) * kGroup * w.block_bytes + 64), _MM_HINT_T0);
      } else {
        const __m512i z = _mm512_loadu_si512(p);
        lo[j] = _mm512_and_si512(z, low);
        hi[j] = _mm512_and_si512(_mm512_srli_epi16(z, 4), low);
        _mm_prefetch(reinterpret_cast<const char*>(next + (j * nb + b) * kGroup * w.block_bytes), _MM_HINT_T0);
      }
    }
    const __m512 dw = load_half16(dp, b * kGroup);
    __m512 mw = _mm512_setzero_ps();
    if (KIND == kQ4_1) mw = load_half16(mp, b * kGroup);
    for (int i = 0; i < R; ++i) {
      const int64_t r = r0 + i;
      const int8_t* xq = a.q + (r * a.nb + b) * kBlock;
      const __m512i xl = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(xq)));
      const __m512i xh = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(xq + 16)));
      __m512i parts[kGroup];
      for (int64_t j = 0; j < kGroup; ++j) {
        parts[j] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo[j], xl), hi[j], xh);
      }
      __m512i dot = _mm512_permutexvar_epi32(to_columns, sum_partials(parts[0], parts[1], parts[2], parts[3]));
      const int32_t sx = a.s[r * a.nb + b];
      if (KIND != kQ4_1) dot = _mm512_add_epi32(dot, _mm512_set1_epi32((KIND == kQ8_0 ? -128 : -8) * sx));
      const __m512 dx = _mm512_set1_ps(a.d[r * a.nb + b]);
      __m512 term = _mm512_mul_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(dw, dx));
      if (KIND == kQ4_1) term = _mm512_add_ps(term, _mm512_mul_ps(_mm512_mul_ps(mw, dx), _mm512_set1_ps(float(sx))));
      acc[i] = _mm512_add_ps(acc[i], term);
    }
  }
  const __mmask16 mask = static_cast<__mmask16>((1u << columns) - 1u);
  for (int i = 0; i < R; ++i) _mm512_mask_storeu_ps(out + (r0 + i) * ldo + g0 * kGroup, mask, acc[i]);
}

template <int64_t KIND>
void gemv(const Acts& a, const Weights& w, int64_t rows, int64_t out_features, float* out) {
  const int64_t groups = (out_features + kGroup - 1) / kGroup;
  const int64_t chunks = (out_features + kChunk - 1) / kChunk;
  // about 4 K block products per task: at 1 row a SmolLM2 product of 576 inputs splits from 2 chunks of 16 columns
  const int64_t grain = std::max<int64_t>(1, 4096 / std::max<int64_t>(1, rows * w.nb * kChunk));
  at::parallel_for(0, chunks, grain, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t g0 = c * (kChunk / kGroup), n = std::min(kGroup, groups - g0);
      const int64_t columns = std::min(kChunk, out_features - c * kChunk);
      for (int64_t r = 0; r < rows; r += kGemvMaxRows) {
        switch (std::min<int64_t>(kGemvMaxRows, rows - r)) {
          case 1: gemv_chunk<KIND, 1>(a, w, g0, n, r, out, out_features, columns); break;
          case 2: gemv_chunk<KIND, 2>(a, w, g0, n, r, out, out_features, columns); break;
          case 3: gemv_chunk<KIND, 3>(a, w, g0, n, r, out, out_features, columns); break;
          default: gemv_chunk<KIND, 4>(a, w, g0, n, r, out, out_features, columns); break;
        }
      }
    }
  });
}
#endif

#ifdef ASYNCLLM_BLOCK_AVX2
// --- activations for the many-row GEMMs -----------------------------------------------------------------------------
inline int32_t load_quad(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// The activations of a tile of P rows, per block b: quads [8][P] int32 (row i's values 4q..4q+3 at [q][i]), then
// the sums' starts [P] int32 (start * s: -128 s for the vnni path's Q8_0, -8 s for Q4_0, else 0), dx [P] float32,
// float(s) [P] float32.
// One pointer and constant offsets reach every row's operands; rows past the batch's end are zeros.
template <int P>
struct TileLayout {
  static constexpr int64_t kQuads = 0, kStart = 8 * P, kDx = 9 * P, kSx = 10 * P, kWords = 11 * P;
};

template <int P>
std::vector<int32_t> pack_tiles(const Acts& a, int64_t rows, int32_t start) {
  using L = TileLayout<P>;
  const int64_t tiles = (rows + P - 1) / P;
  std::vector<int32_t> packed(tiles * a.nb * L::kWords, 0);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = r / P, i = r % P;
    for (int64_t b = 0; b < a.nb; ++b) {
      int32_t* rec = packed.data() + (t * a.nb + b) * L::kWords;
      const int8_t* xb = a.q + (r * a.nb + b) * kBlock;
      for (int64_t q = 0; q < 8; ++q) rec[L::kQuads + q * P + i] = load_quad(xb + 4 * q);
      const int32_t sx = a.s[r * a.nb + b];
      rec[L::kStart + i] = start * sx;
      const float dx = a.d[r * a.nb + b], sxf = static_cast<float>(sx);
      std::memcpy(rec + L::kDx + i, &dx, sizeof(float));
      std::memcpy(rec + L::kSx + i, &sxf, sizeof(float));
    }
  }
  return packed;
}

#endif

#ifdef ASYNCLLM_BLOCK_VNNI
// --- the many-row GEMM (AVX-512 VNNI, 512-bit vectors) ---------------------------------------------------------------
// A panel of 16 output columns (4 groups) is unpacked ONCE per call into int8 quads laid out for `vpdpbusd`
// (block b, quad q = values 4q..4q+3: one 64-byte vector of the 16 columns' quads), its scales into float32
// vectors; then every row sweeps it in register tiles of kGemmRows rows x kGemmPanels panels, each weight vector
// feeding kGemmRows `vpdpbusd` with a row's quad broadcast. A panel (nb * 576 bytes: 10 KB at 576 inputs, 27 KB at
// 1536) stays in L1/L2; the activations are packed once per call so one pointer reaches a tile's operands.
// Lane 4c + j of a vector holds column 4j + c of the panel (group j, column c): the in-lane 4 x 4 transpose that
// makes the quads is then 8 unpack instructions; scales are laid out the same way and outputs are permuted back.
// Every value is exact as an integer (Q8_0 weights are stored + 128, unsigned, and the row's 128 * s is taken off
// by starting the sum at -128 s; Q4_0 starts at -8 s, which is dot - 8 s), and the float32 steps per block are
// those of group_scalar in the same order: the same bits as the GEMV for every row, whatever its batch-mates.
// Tile shapes measured (1 thread, ms per SmolLM2 step at 32 / 256 rows, Q4_0): 8 rows x 1 panel 40.8 / 289,
// 4 x 1 44.5 / 290, 12 x 1 46.9 / 332, 4 x 2 42.2 / 267, 6 x 2 39.9 / 262: 6 rows x 2 panels (24 accumulators).
constexpr int64_t kPanel = 16;  // columns per panel: one 512-bit vector of int32 / float32
constexpr int kGemmRows = 6;    // rows per register tile
constexpr int kGemmPanels = 2;  // panels per register tile

struct Panel {
  std::vector<__m512i> q;  // [nb, 8] quads
  std::vector<__m512> d;   // [nb] scales
  std::vector<__m512> m;   // [nb] minimums (Q4_1)
  explicit Panel(int64_t nb) : q(nb * 8), d(nb), m(nb) {}
};

// r[j] holds, in 128-bit lane c, 4 dwords (quads) of group j's column c -> t[q] holds quad q of (j, c) at dword j
// of lane c.
inline void transpose4(const __m512i r[4], __m512i* t) {
  const __m512i a = _mm512_unpacklo_epi32(r[0], r[1]), b = _mm512_unpackhi_epi32(r[0], r[1]);
  const __m512i c = _mm512_unpacklo_epi32(r[2], r[3]), e = _mm512_unpackhi_epi32(r[2], r[3]);
  t[0] = _mm512_unpacklo_epi64(a, c);
  t[1] = _mm512_unpackhi_epi64(a, c);
  t[2] = _mm512_unpacklo_epi64(b, e);
  t[3] = _mm512_unpackhi_epi64(b, e);
}

// SIGNED (the AMX GEMM's signed x signed products): Q8_0 values as stored (not + 128), Q4_0 values - 8 (so the
// integer sum is dot - 8 s itself), Q4_1 values 0..15 as they are.
template <int64_t KIND, bool SIGNED = false>
void unpack_panel(const Weights& w, int64_t g0, int64_t groups, Panel& p) {
  const __m512i low = _mm512_set1_epi8(15), flip = _mm512_set1_epi8(static_cast<char>(0x80));
  const __m512i offset = _mm512_set1_epi8(KIND == kQ4_0 && SIGNED ? 8 : 0);
  for (int64_t b = 0; b < w.nb; ++b) {
    __m512i lo[kGroup], hi[kGroup];
    int64_t d4[kGroup] = {0, 0, 0, 0}, m4[kGroup] = {0, 0, 0, 0};  // each group's 4 float16 scales (minimums)
    for (int64_t j = 0; j < kGroup; ++j) {
      if (j >= groups) {
        lo[j] = hi[j] = _mm512_setzero_si512();
        continue;
      }
      const int64_t block = (g0 + j) * w.nb + b;
      const uint8_t* src = w.qs + block * kGroup * w.block_bytes;
      if (KIND == kQ8_0) {  // [c0 q0-3 | c0 q4-7 | c1 q0-3 | c1 q4-7], [c2 ... | c3 ...], + 128
        const __m512i z0 = SIGNED ? _mm512_loadu_si512(src) : _mm512_xor_si512(_mm512_loadu_si512(src), flip);
        const __m512i z1 =
            SIGNED ? _mm512_loadu_si512(src + 64) : _mm512_xor_si512(_mm512_loadu_si512(src + 64), flip);
        lo[j] = _mm512_shuffle_i64x2(z0, z1, _MM_SHUFFLE(2, 0, 2, 0));
        hi[j] = _mm512_shuffle_i64x2(z0, z1, _MM_SHUFFLE(3, 1, 3, 1));
      } else {  // [c0 | c1 | c2 | c3] bytes: low nibbles values 0-15, high ones 16-31
        const __m512i z = _mm512_loadu_si512(src);
        lo[j] = _mm512_sub_epi8(_mm512_and_si512(z, low), offset);
        hi[j] = _mm512_sub_epi8(_mm512_and_si512(_mm512_srli_epi16(z, 4), low), offset);
      }
      std::memcpy(&d4[j], w.d + block * kGroup, sizeof(int64_t));
      if (KIND == kQ4_1) std::memcpy(&m4[j], w.m + block * kGroup, sizeof(int64_t));
    }
    transpose4(lo, &p.q[b * 8]);
    transpose4(hi, &p.q[b * 8 + 4]);
    // float16 -> float32 is exact (vcvtph2ps as c10::Half's conversion); lane 4j + c -> lane 4c + j
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    p.d[b] = _mm512_permutexvar_ps(order, _mm512_cvtph_ps(_mm256_setr_epi64x(d4[0], d4[1], d4[2], d4[3])));
    if (KIND == kQ4_1) {
      p.m[b] = _mm512_permutexvar_ps(order, _mm512_cvtph_ps(_mm256_setr_epi64x(m4[0], m4[1], m4[2], m4[3])));
    }
  }
}

// The first R rows of a packed tile of P against NV unpacked panels, the first one's first column col0;
// `mask[v]` marks panel v's real columns.
template <int64_t KIND, int P, int R, int NV>
void panel_tile(const int32_t* tile, int64_t nb, const Panel* p, int64_t r0, float* out, int64_t ldo, int64_t col0,
                const __mmask16* mask) {
  using L = TileLayout<P>;
  __m512 acc[R][NV];
  for (int i = 0; i < R; ++i)
    for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const int32_t* rec = tile + b * L::kWords;
    __m512i dot[R][NV];
    for (int i = 0; i < R; ++i) {
      const __m512i start = _mm512_set1_epi32(rec[L::kStart + i]);
      for (int v = 0; v < NV; ++v) dot[i][v] = start;
    }
    for (int64_t q = 0; q < 8; ++q) {
      __m512i wv[NV];
      for (int v = 0; v < NV; ++v) wv[v] = p[v].q[b * 8 + q];
      for (int i = 0; i < R; ++i) {
        const __m512i xv = _mm512_set1_epi32(rec[L::kQuads + q * P + i]);
        for (int v = 0; v < NV; ++v) dot[i][v] = _mm512_dpbusd_epi32(dot[i][v], wv[v], xv);
      }
    }
    const float* dxs = reinterpret_cast<const float*>(rec + L::kDx);
    const float* sxs = reinterpret_cast<const float*>(rec + L::kSx);
    for (int i = 0; i < R; ++i) {
      const __m512 dx = _mm512_set1_ps(dxs[i]);
      for (int v = 0; v < NV; ++v) {
        __m512 term = _mm512_mul_ps(_mm512_cvtepi32_ps(dot[i][v]), _mm512_mul_ps(p[v].d[b], dx));
        if (KIND == kQ4_1) {
          term = _mm512_add_ps(term, _mm512_mul_ps(_mm512_mul_ps(p[v].m[b], dx), _mm512_set1_ps(sxs[i])));
        }
        acc[i][v] = _mm512_add_ps(acc[i][v], term);
      }
    }
  }
  // lane 4c + j -> column 4j + c (the permutation is its own inverse)
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  for (int i = 0; i < R; ++i) {
    for (int v = 0; v < NV; ++v) {
      _mm512_mask_storeu_ps(out + (r0 + i) * ldo + col0 + v * kPanel, mask[v],
                            _mm512_permutexvar_ps(order, acc[i][v]));
    }
  }
}

template <int64_t KIND, int P, int R, int NV>
void panel_rest(const int32_t* tile, int64_t nb, const Panel* p, int64_t r0, int64_t rows, float* out, int64_t ldo,
                int64_t col0, const __mmask16* mask) {
  if constexpr (R > 0) {
    if (rows == R) return panel_tile<KIND, P, R, NV>(tile, nb, p, r0, out, ldo, col0, mask);
    panel_rest<KIND, P, R - 1, NV>(tile, nb, p, r0, rows, out, ldo, col0, mask);
  }
}

template <int64_t KIND, int P, int NV>
void panel_rows(const int32_t* packed, int64_t nb, const Panel* p, int64_t rows, float* out, int64_t ldo,
                int64_t col0, const __mmask16* mask) {
  int64_t r = 0;
  for (; r + P <= rows; r += P) {
    panel_tile<KIND, P, P, NV>(packed + (r / P) * nb * TileLayout<P>::kWords, nb, p, r, out, ldo, col0, mask);
  }
  if (r < rows) {
    panel_rest<KIND, P, P - 1, NV>(packed + (r / P) * nb * TileLayout<P>::kWords, nb, p, r, rows - r, out, ldo,
                                   col0, mask);
  }
}

template <int64_t KIND, int P, int NV>
void gemm_t(const Acts& a, const Weights& w, int64_t rows, int64_t out_features, float* out) {
  const std::vector<int32_t> packed = pack_tiles<P>(a, rows, KIND == kQ4_1 ? 0 : KIND == kQ8_0 ? -128 : -8);
  const int64_t groups = (out_features + kGroup - 1) / kGroup;
  const int64_t panels = (out_features + kPanel - 1) / kPanel;
  const int64_t steps = (panels + NV - 1) / NV;
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, rows * w.nb * kPanel * NV));
  at::parallel_for(0, steps, grain, [&](int64_t s0, int64_t s1) {
    std::vector<Panel> panel;
    for (int v = 0; v < NV; ++v) panel.emplace_back(w.nb);
    for (int64_t step = s0; step < s1; ++step) {
      const int64_t pi = step * NV, col0 = pi * kPanel;
      __mmask16 mask[NV];
      int nv = 0;
      for (; nv < NV && pi + nv < panels; ++nv) {
        const int64_t g0 = (pi + nv) * (kPanel / kGroup);
        unpack_panel<KIND>(w, g0, std::min(kPanel / kGroup, groups - g0), panel[nv]);
        mask[nv] = static_cast<__mmask16>((1u << std::min(kPanel, out_features - col0 - nv * kPanel)) - 1u);
      }
      if (nv == NV) {
        panel_rows<KIND, P, NV>(packed.data(), w.nb, panel.data(), rows, out, out_features, col0, mask);
      } else {
        panel_rows<KIND, P, 1>(packed.data(), w.nb, panel.data(), rows, out, out_features, col0, mask);
      }
    }
  });
}

// The product of every row with every column: activations packed in tiles of kGemmRows rows, panels handed out to
// threads kGemmPanels at a time (whole columns: each output is summed by one thread, in block order).
template <int64_t KIND>
void gemm(const Acts& a, const Weights& w, int64_t rows, int64_t out_features, float* out) {
  gemm_t<KIND, kGemmRows, kGemmPanels>(a, w, rows, out_features, out);
}
#endif

#ifdef ASYNCLLM_BLOCK_AMX
// --- the many-row GEMM on AMX (Advanced Matrix Extensions: int8 tile products) --------------------------------------
// The vnni GEMM's panels of 16 columns, unpacked once per call, are already AMX's B operand: block b's 8 quad
// vectors of 64 bytes are a tile of K / 4 = 8 rows x 16 columns x 4 bytes. Weights are unpacked signed (Q8_0 as
// stored, Q4_0 - 8, Q4_1 0..15) and every kind takes `tdpbssd` (signed x signed): the product of 16 rows' block b
// (an A tile of 16 x 32 bytes) with a panel's block b is each (row, column)'s exact block dot (dot - 8 s for Q4_0),
// K = 32, one block per product so blocks never mix. Per block the int32 tile is stored and the float32 steps of
// group_scalar applied in AVX-512, in block order, to 16 accumulator registers (one per row): the same bits as
// every other path. Blocks alternate between two sets of tiles (C 0/1, A 4/5, B 6/7) and the tile products of
// block b + 1 are issued before block b's float32 steps, so the tile unit and the vector unit overlap.
// Activations are packed per 16 rows and block into contiguous records (the A tile, then dx and float(s) per row),
// rows past the batch's end zero (multiplied, never stored). The tile registers are configured per thread and task
// (`ldtilecfg`) and released after it; they need the process's permission from Linux (arch_prctl
// ARCH_REQ_XCOMP_PERM for XTILEDATA), asked once by amx_unavailable_reason(): without it the path is not offered.
// The functions that touch tiles are built with target("amx-tile,amx-int8"), whatever -march says.
constexpr int kAmxRows = 16;                     // rows per A tile
constexpr int64_t kAmxQBytes = kAmxRows * kBlock;  // an A tile: 512 bytes
constexpr int64_t kAmxRecord = kAmxQBytes + 2 * kAmxRows * 4;  // + dx [16] float32, float(s) [16] float32
// From this many rows the "amx" path takes the AMX GEMM (below it the vnni GEMM and GEMV).
constexpr int64_t kAmxMinRows = 16;

struct alignas(64) TileConfig {  // the `ldtilecfg` operand, palette 1
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

__attribute__((target("amx-tile,amx-int8"))) inline void amx_configure() {
  TileConfig config;
  for (int t = 0; t < 2; ++t) config.rows[t] = kAmxRows, config.colsb[t] = 64;       // C: 16 rows x 16 int32
  for (int t = 4; t < 6; ++t) config.rows[t] = kAmxRows, config.colsb[t] = kBlock;   // A: 16 rows x 32 bytes
  for (int t = 6; t < 8; ++t) config.rows[t] = kBlock / 4, config.colsb[t] = 64;     // B: 8 quads x 16 columns
  asm volatile("" ::: "memory");  // ldtilecfg's operand is declared as 8 bytes: keep every store before it
  _tile_loadconfig(&config);
}

// Activations as records [tiles][nb] of kAmxRecord bytes: the A tile [16 rows][32] int8, dx [16] float32,
// float(s) [16] float32; rows past `rows` zero.
std::vector<int8_t> pack_amx_rows(const Acts& a, int64_t rows) {
  const int64_t tiles = (rows + kAmxRows - 1) / kAmxRows;
  std::vector<int8_t> packed(tiles * a.nb * kAmxRecord, 0);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = r / kAmxRows, i = r % kAmxRows;
    for (int64_t b = 0; b < a.nb; ++b) {
      int8_t* rec = packed.data() + (t * a.nb + b) * kAmxRecord;
      std::memcpy(rec + i * kBlock, a.q + (r * a.nb + b) * kBlock, kBlock);
      const float dx = a.d[r * a.nb + b], sx = static_cast<float>(a.s[r * a.nb + b]);
      std::memcpy(rec + kAmxQBytes + 4 * i, &dx, sizeof(float));
      std::memcpy(rec + kAmxQBytes + 4 * (kAmxRows + i), &sx, sizeof(float));
    }
  }
  return packed;
}

// One block's exact dots of an A tile (16 rows x 32 bytes) with a B tile (8 quads x 16 columns) into tile C as
// [16][16] int32 (literal tile numbers: the intrinsics name them in their assembly); stored later.
#define ASYNCLLM_AMX_BLOCK_DOTS(C, A, B, a_tile, b_tile) \
  do {                                                   \
    _tile_loadd(A, (a_tile), kBlock);                    \
    _tile_loadd(B, (b_tile), 64);                        \
    _tile_zero(C);                                       \
    _tile_dpbssd(C, A, B);                               \
  } while (0)

// 16 packed rows (the first R real) against one unpacked panel: out[r0 + i, col0 + c] for the columns in mask. The
// tile products always take 16 rows; the float32 steps only the R real ones.
// A pipeline of three blocks: while block b's int32 dots (stored one step earlier) take their float32 steps, block
// b + 1's tile is stored and block b + 2's tile product runs (tile sets by parity: C 0/1, A 4/5, B 6/7), so neither
// the product's latency nor the store's stalls the vector steps (a tile stored right after its product, and read
// right after its store, took half the time: measured with perf).
template <int64_t KIND, int R>
__attribute__((target("amx-tile,amx-int8"))) void amx_tile(const int8_t* records, int64_t nb, const Panel& p,
                                                            int64_t r0, float* out, int64_t ldo, int64_t col0,
                                                            __mmask16 mask) {
  alignas(64) int32_t dots[2][kAmxRows * 16];
  // unrolled, so the accumulators are 16 registers: as an array they were kept on the stack (a load and a store
  // per row and block: 28.4 -> 23.7 ns per 16 x 16 block product in a stand-alone loop)
  __m512 acc[kAmxRows];
#pragma GCC unroll 16
  for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
  ASYNCLLM_AMX_BLOCK_DOTS(0, 4, 6, records, &p.q[0]);
  if (nb > 1) ASYNCLLM_AMX_BLOCK_DOTS(1, 5, 7, records + kAmxRecord, &p.q[8]);
  _tile_stored(0, dots[0], 64);
  for (int64_t b = 0; b < nb; ++b) {
    if (b % 2 == 0) {  // block b's tile is C 0 (stored), b + 1's is C 1, b + 2 goes to C 0
      if (b + 1 < nb) _tile_stored(1, dots[1], 64);
      if (b + 2 < nb) ASYNCLLM_AMX_BLOCK_DOTS(0, 4, 6, records + (b + 2) * kAmxRecord, &p.q[(b + 2) * 8]);
    } else {
      if (b + 1 < nb) _tile_stored(0, dots[0], 64);
      if (b + 2 < nb) ASYNCLLM_AMX_BLOCK_DOTS(1, 5, 7, records + (b + 2) * kAmxRecord, &p.q[(b + 2) * 8]);
    }
    const int32_t* block_dots = dots[b % 2];
    const float* dxs = reinterpret_cast<const float*>(records + b * kAmxRecord + kAmxQBytes);
    const float* sxs = dxs + kAmxRows;
    const __m512 dw = p.d[b];
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i) {
      const __m512 dx = _mm512_set1_ps(dxs[i]);
      __m512 term = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_load_si512(block_dots + i * 16)), _mm512_mul_ps(dw, dx));
      if (KIND == kQ4_1) term = _mm512_add_ps(term, _mm512_mul_ps(_mm512_mul_ps(p.m[b], dx), _mm512_set1_ps(sxs[i])));
      acc[i] = _mm512_add_ps(acc[i], term);
    }
  }
  // lane 4c + j -> column 4j + c, as in panel_tile
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
#pragma GCC unroll 16
  for (int i = 0; i < R; ++i) {
    _mm512_mask_storeu_ps(out + (r0 + i) * ldo + col0, mask, _mm512_permutexvar_ps(order, acc[i]));
  }
}

// amx_tile for the last tile's `rows` (< R) real rows.
template <int64_t KIND, int R>
void amx_rest(const int8_t* records, int64_t nb, const Panel& p, int64_t r0, int64_t rows, float* out, int64_t ldo,
              int64_t col0, __mmask16 mask) {
  if constexpr (R > 0) {
    if (rows == R) return amx_tile<KIND, R>(records, nb, p, r0, out, ldo, col0, mask);
    amx_rest<KIND, R - 1>(records, nb, p, r0, rows, out, ldo, col0, mask);
  }
}

// Panels [p0, p1) of a GEMM on this thread: tiles configured, each panel unpacked and swept by every row tile,
// tiles released.
template <int64_t KIND>
__attribute__((target("amx-tile,amx-int8"))) void amx_panels(const int8_t* packed, const Weights& w, int64_t rows,
                                                              int64_t out_features, float* out, int64_t p0,
                                                              int64_t p1) {
  const int64_t groups = (out_features + kGroup - 1) / kGroup;
  const int64_t row_tiles = (rows + kAmxRows - 1) / kAmxRows;
  amx_configure();
  Panel panel(w.nb);
  for (int64_t pi = p0; pi < p1; ++pi) {
    const int64_t g0 = pi * (kPanel / kGroup), col0 = pi * kPanel;
    unpack_panel<KIND, true>(w, g0, std::min(kPanel / kGroup, groups - g0), panel);
    const auto mask = static_cast<__mmask16>((1u << std::min(kPanel, out_features - col0)) - 1u);
    asm volatile("" ::: "memory");  // the tile loads are assembly reading memory: the panel is stored before them
    for (int64_t t = 0; t < row_tiles; ++t) {
      const int8_t* records = packed + t * w.nb * kAmxRecord;
      if (rows - t * kAmxRows >= kAmxRows) {
        amx_tile<KIND, kAmxRows>(records, w.nb, panel, t * kAmxRows, out, out_features, col0, mask);
      } else {
        amx_rest<KIND, kAmxRows - 1>(records, w.nb, panel, t * kAmxRows, rows - t * kAmxRows, out, out_features,
                                     col0, mask);
      }
    }
  }
  _tile_release();
}

// The product of every row with every column on AMX: activations packed once, panels of 16 columns handed out to
// threads (whole columns: each output summed by one thread, in block order).
template <int64_t KIND>
void gemm_amx(const Acts& a, const Weights& w, int64_t rows, int64_t out_features, float* out) {
  const std::vector<int8_t> packed = pack_amx_rows(a, rows);
  const int64_t panels = (out_features + kPanel - 1) / kPanel;
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, rows * w.nb * kPanel));
  at::parallel_for(0, panels, grain, [&](int64_t p0, int64_t p1) {
    amx_panels<KIND>(packed.data(), w, rows, out_features, out, p0, p1);
  });
}
#endif

#ifdef ASYNCLLM_BLOCK_AVX2
// --- the many-row GEMM on AVX2 (no VNNI), Q4: the same idea on 256-bit vectors --------------------------------------
// A panel of 8 columns (2 groups) is unpacked once per call into quads; a row's quad, broadcast, meets a quad vector
// in `vpmaddubsw` (unsigned 4-bit weights x signed activations, pairs summed to int16: at most 2 * 15 * 127), a
// block's 8 quads summed in int16 (at most 30480) before one `vpmaddwd` to int32. Exact integers again, then the
// float32 steps of group_scalar in the same order. Lane 4l + k of a vector holds column 4(k / 2) + 2(k % 2) + l of
// the panel (l the 128-bit lane). Q4_0 / Q4_1 gain 12% at 6-8 rows and 1.7x at 32 (66.4 / 73.7 from 115.8 / 130.7).
// Q8_0's signed weights cannot sum a block in int16 (|x| x sign(w, x) pairs reach 2 * 127 * 127): its GEMM is below.
constexpr int64_t kPanel2 = 8;  // columns per AVX2 panel
constexpr int kGemmRows2 = 4;   // rows per AVX2 register tile: 8 accumulators of 16 registers

struct Panel2 {
  std::vector<__m256i> q;  // [nb, 8] quads
  std::vector<__m256> d;   // [nb]
  std::vector<__m256> m;   // [nb]
  explicit Panel2(int64_t nb) : q(nb * 8), d(nb), m(nb) {}
};

inline void transpose4(const __m256i r[4], __m256i* t) {
  const __m256i a = _mm256_unpacklo_epi32(r[0], r[1]), b = _mm256_unpackhi_epi32(r[0], r[1]);
  const __m256i c = _mm256_unpacklo_epi32(r[2], r[3]), e = _mm256_unpackhi_epi32(r[2], r[3]);
  t[0] = _mm256_unpacklo_epi64(a, c);
  t[1] = _mm256_unpackhi_epi64(a, c);
  t[2] = _mm256_unpacklo_epi64(b, e);
  t[3] = _mm256_unpackhi_epi64(b, e);
}

template <int64_t KIND>
void unpack_panel2(const Weights& w, int64_t g0, int64_t groups, Panel2& p) {
  const __m256i low = _mm256_set1_epi8(15);
  for (int64_t b = 0; b < w.nb; ++b) {
    __m256i lo[4], hi[4];  // r[k]: k = 2 * group + half (columns 0-1 or 2-3)
    float d[kPanel2], m[kPanel2];
    for (int64_t j = 0; j < 2; ++j) {
      if (j >= groups) {
        lo[2 * j] = lo[2 * j + 1] = hi[2 * j] = hi[2 * j + 1] = _mm256_setzero_si256();
        for (int64_t c = 0; c < kGroup; ++c) d[4 * (c & 1) + 2 * j + (c >> 1)] = m[4 * (c & 1) + 2 * j + (c >> 1)] = 0;
        continue;
      }
      const int64_t block = (g0 + j) * w.nb + b;
      const uint8_t* src = w.qs + block * kGroup * w.block_bytes;
      for (int64_t h = 0; h < 2; ++h) {  // columns 2h, 2h + 1
        const __m256i z = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + h * 32));
        lo[2 * j + h] = _mm256_and_si256(z, low);
        hi[2 * j + h] = _mm256_and_si256(_mm256_srli_epi16(z, 4), low);
      }
      for (int64_t c = 0; c < kGroup; ++c) {
        const int64_t lane = 4 * (c & 1) + 2 * j + (c >> 1);
        d[lane] = static_cast<float>(w.d[block * kGroup + c]);
        m[lane] = KIND == kQ4_1 ? static_cast<float>(w.m[block * kGroup + c]) : 0.0f;
      }
    }
    transpose4(lo, &p.q[b * 8]);
    transpose4(hi, &p.q[b * 8 + 4]);
    p.d[b] = _mm256_loadu_ps(d);
    p.m[b] = _mm256_loadu_ps(m);
  }
}

template <int64_t KIND, int P, int R>
void panel2_tile(const int32_t* tile, int64_t nb, const Panel2& p, int64_t r0, float* out, int64_t ldo, int64_t col0,
                 __m256i mask) {
  using L = TileLayout<P>;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const int32_t* rec = tile + b * L::kWords;
    __m256i dot[R];
    for (int i = 0; i < R; ++i) dot[i] = _mm256_setzero_si256();
    for (int64_t q = 0; q < 8; ++q) {
      const __m256i wv = p.q[b * 8 + q];
      for (int i = 0; i < R; ++i) {
        const __m256i xv = _mm256_set1_epi32(rec[L::kQuads + q * P + i]);
        dot[i] = _mm256_add_epi16(dot[i], _mm256_maddubs_epi16(wv, xv));  // int16 sums, at most 30480
      }
    }
    const float* dxs = reinterpret_cast<const float*>(rec + L::kDx);
    const float* sxs = reinterpret_cast<const float*>(rec + L::kSx);
    for (int i = 0; i < R; ++i) {
      const __m256i d32 = _mm256_add_epi32(_mm256_madd_epi16(dot[i], ones), _mm256_set1_epi32(rec[L::kStart + i]));
      const __m256 dx = _mm256_set1_ps(dxs[i]);
      __m256 term = _mm256_mul_ps(_mm256_cvtepi32_ps(d32), _mm256_mul_ps(p.d[b], dx));
      if (KIND == kQ4_1) term = _mm256_add_ps(term, _mm256_mul_ps(_mm256_mul_ps(p.m[b], dx), _mm256_set1_ps(sxs[i])));
      acc[i] = _mm256_add_ps(acc[i], term);
    }
  }
  // column c (group j = c / 4, column c % 4) is in lane 4 (c % 2) + 2 j + (c % 4) / 2
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int i = 0; i < R; ++i) {
    _mm256_maskstore_ps(out + (r0 + i) * ldo + col0, mask, _mm256_permutevar8x32_ps(acc[i], order));
  }
}

template <int64_t KIND, int P, int R>
void panel2_rest(const int32_t* tile, int64_t nb, const Panel2& p, int64_t r0, int64_t rows, float* out, int64_t ldo,
                 int64_t col0, __m256i mask) {
  if constexpr (R > 0) {
    if (rows == R) return panel2_tile<KIND, P, R>(tile, nb, p, r0, out, ldo, col0, mask);
    panel2_rest<KIND, P, R - 1>(tile, nb, p, r0, rows, out, ldo, col0, mask);
  }
}

template <int64_t KIND>
void gemm_avx2(const Acts& a, const Weights& w, int64_t rows, int64_t out_features, float* out) {
  constexpr int P = kGemmRows2;
  static_assert(KIND == kQ4_0 || KIND == kQ4_1, "the AVX2 GEMM is for Q4 weights");
  const std::vector<int32_t> packed = pack_tiles<P>(a, rows, KIND == kQ4_0 ? -8 : 0);
  const int64_t groups = (out_features + kGroup - 1) / kGroup;
  const int64_t panels = (out_features + kPanel2 - 1) / kPanel2;
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, rows * w.nb * kPanel2));
  at::parallel_for(0, panels, grain, [&](int64_t p0, int64_t p1) {
    Panel2 panel(w.nb);
    for (int64_t pi = p0; pi < p1; ++pi) {
      const int64_t g0 = pi * 2, col0 = pi * kPanel2;
      unpack_panel2<KIND>(w, g0, std::min<int64_t>(2, groups - g0), panel);
      const int64_t columns = std::min(kPanel2, out_features - col0);
      const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(columns)),
                                              _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
      int64_t r = 0;
      for (; r + P <= rows; r += P) {
        panel2_tile<KIND, P, P>(packed.data() + (r / P) * w.nb * TileLayout<P>::kWords, w.nb, panel, r, out,
                                out_features, col0, mask);
      }
      if (r < rows) {
        panel2_rest<KIND, P, P - 1>(packed.data() + (r / P) * w.nb * TileLayout<P>::kWords, w.nb, panel, r, rows - r,
                                    out, out_features, col0, mask);
      }
    }
  });
}
#endif

#ifdef ASYNCLLM_BLOCK_AVX2
// --- the many-row Q8_0 GEMM on AVX2 (no VNNI) ---------------------------------------------------------------------
// Signed weights meet signed activations as in the tile (`vpmaddubsw(|x|, sign(w, x))`, pairs at most
// 2 * 127 * 127, then `vpmaddwd` to int32 per quad: 4 instructions per 32 multiply-adds, as in the int8 kernel,
// csrc/int8_gemm.cpp), but on panels of 8 columns unpacked once per call (lane c = column c: an 8 x 8 transpose of
// quads), each broadcast activation quad and its |x| shared by kQ8Panels panels and each weight vector by a tile of
// kGemmRows2 rows, and the horizontal sums and per-block float steps of the tile (4 columns per pass) gone: a
// block's 8 quads end in one int32 vector per row and panel, then the float32 steps of group_scalar, in block order.
// From this many rows (measured, two threads, the LM heads of SmolLM2 and Gemma 3 read from memory: at 16 rows the
// tile was level or 10% faster, at 24 the GEMM 6-8% faster, at 32 8-24%, at 64 14-25%; on 1 MB layer weights that
// stay in cache the GEMM led from 6 rows).
constexpr int64_t kQ8GemmMinRows2 = 24;
constexpr int kQ8Panels = 2;  // panels per register tile

inline void transpose8(__m256i r[8]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(_mm256_castsi256_ps(r[2 * i]), _mm256_castsi256_ps(r[2 * i + 1]));
    t[2 * i + 1] = _mm256_unpackhi_ps(_mm256_castsi256_ps(r[2 * i]), _mm256_castsi256_ps(r[2 * i + 1]));
  }
  for (int i = 0; i < 2; ++i) {  // rows 4i .. 4i + 3: t[4i .. 4i + 3]
    u[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
    u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_castps_si256(_mm256_permute2f128_ps(u[i], u[4 + i], 0x20));
    r[4 + i] = _mm256_castps_si256(_mm256_permute2f128_ps(u[i], u[4 + i], 0x31));
  }
}

// Panel p.q[b * 8 + q] lane c = column c's values 4q .. 4q + 3 of block b (signed, as stored); p.d[b] lane c its scale.
void unpack_panel_q8(const Weights& w, int64_t g0, int64_t groups, Panel2& p) {
  for (int64_t b = 0; b < w.nb; ++b) {
    __m256i r[8];
    __m128 d[2];
    for (int64_t j = 0; j < 2; ++j) {  // group j: columns 4j .. 4j + 3, their blocks next to each other
      if (j >= groups) {
        for (int64_t c = 0; c < kGroup; ++c) r[j * kGroup + c] = _mm256_setzero_si256();
        d[j] = _mm_setzero_ps();
        continue;
      }
      const int64_t block = (g0 + j) * w.nb + b;
      for (int64_t c = 0; c < kGroup; ++c)
        r[j * kGroup + c] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.qs + (block * kGroup + c) * kBlock));
      d[j] = load_half4(w.d + block * kGroup);
    }
    transpose8(r);
    for (int64_t q = 0; q < 8; ++q) p.q[b * 8 + q] = r[q];
    p.d[b] = _mm256_set_m128(d[1], d[0]);
  }
}

template <int P, int R, int NP>
void q8_tile(const int32_t* tile, int64_t nb, const Panel2* p, int64_t r0, float* out, int64_t ldo, int64_t col0,
             const __m256i* mask) {
  using L = TileLayout<P>;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R][NP];
  for (int i = 0; i < R; ++i)
    for (int v = 0; v < NP; ++v) acc[i][v] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const int32_t* rec = tile + b * L::kWords;
    __m256i dot[R][NP];
    for (int i = 0; i < R; ++i)
      for (int v = 0; v < NP; ++v) dot[i][v] = _mm256_setzero_si256();
    for (int64_t q = 0; q < 8; ++q) {
      __m256i wv[NP];
      for (int v = 0; v < NP; ++v) wv[v] = p[v].q[b * 8 + q];
      for (int i = 0; i < R; ++i) {
        const __m256i xv = _mm256_set1_epi32(rec[L::kQuads + q * P + i]);
        const __m256i ax = _mm256_sign_epi8(xv, xv);  // |x| (x is never -128)
        for (int v = 0; v < NP; ++v) {
          const __m256i pairs = _mm256_maddubs_epi16(ax, _mm256_sign_epi8(wv[v], xv));
          dot[i][v] = _mm256_add_epi32(dot[i][v], _mm256_madd_epi16(pairs, ones));
        }
      }
    }
    const float* dxs = reinterpret_cast<const float*>(rec + L::kDx);
    for (int i = 0; i < R; ++i) {
      const __m256 dx = _mm256_set1_ps(dxs[i]);
      for (int v = 0; v < NP; ++v)
        acc[i][v] = _mm256_add_ps(acc[i][v], _mm256_mul_ps(_mm256_cvtepi32_ps(dot[i][v]), _mm256_mul_ps(p[v].d[b], dx)));
    }
  }
  for (int i = 0; i < R; ++i)
    for (int v = 0; v < NP; ++v) _mm256_maskstore_ps(out + (r0 + i) * ldo + col0 + v * kPanel2, mask[v], acc[i][v]);
}

template <int P, int R, int NP>
void q8_rest(const int32_t* tile, int64_t nb, const Panel2* p, int64_t r0, int64_t rows, float* out, int64_t ldo,
             int64_t col0, const __m256i* mask) {
  if constexpr (R > 0) {
    if (rows == R) return q8_tile<P, R, NP>(tile, nb, p, r0, out, ldo, col0, mask);
    q8_rest<P, R - 1, NP>(tile, nb, p, r0, rows, out, ldo, col0, mask);
  }
}

template <int NP>
void q8_rows(const int32_t* packed, int64_t nb, const Panel2* p, int64_t rows, float* out, int64_t ldo, int64_t col0,
             const __m256i* mask) {
  constexpr int P = kGemmRows2;
  const int64_t words = nb * TileLayout<P>::kWords;
  int64_t r = 0;
  for (; r + P <= rows; r += P) q8_tile<P, P, NP>(packed + (r / P) * words, nb, p, r, out, ldo, col0, mask);
  if (r < rows) q8_rest<P, P - 1, NP>(packed + (r / P) * words, nb, p, r, rows - r, out, ldo, col0, mask);
}

void gemm_avx2_q8(const Acts& a, const Weights& w, int64_t rows, int64_t out_features, float* out) {
  const std::vector<int32_t> packed = pack_tiles<kGemmRows2>(a, rows, 0);
  const int64_t groups = (out_features + kGroup - 1) / kGroup;
  const int64_t panels = (out_features + kPanel2 - 1) / kPanel2;
  const int64_t steps = (panels + kQ8Panels - 1) / kQ8Panels;
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, rows * w.nb * kPanel2 * kQ8Panels));
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  at::parallel_for(0, steps, grain, [&](int64_t s0, int64_t s1) {
    std::vector<Panel2> panel;
    for (int v = 0; v < kQ8Panels; ++v) panel.emplace_back(w.nb);
    for (int64_t step = s0; step < s1; ++step) {
      const int64_t pi = step * kQ8Panels, col0 = pi * kPanel2;
      __m256i mask[kQ8Panels];
      int nv = 0;
      for (; nv < kQ8Panels && pi + nv < panels; ++nv) {
        const int64_t g0 = (pi + nv) * (kPanel2 / kGroup);
        unpack_panel_q8(w, g0, std::min(kPanel2 / kGroup, groups - g0), panel[nv]);
        const int64_t columns = std::min(kPanel2, out_features - col0 - nv * kPanel2);
        mask[nv] = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(columns)), lanes);
      }
      if (nv == kQ8Panels) {
        q8_rows<kQ8Panels>(packed.data(), w.nb, panel.data(), rows, out, out_features, col0, mask);
      } else {
        q8_rows<1>(packed.data(), w.nb, panel.data(), rows, out, out_features, col0, mask);
      }
    }
  });
}
#endif

using GroupFn = void (*)(const Acts&, const Weights&, int64_t, int64_t, int64_t, float*, int64_t, int64_t);

template <int64_t KIND>
GroupFn group_fn(Path path) {
#ifdef ASYNCLLM_BLOCK_VNNI
  if (path == Path::kVnni || path == Path::kAmx) return &group_simd<KIND, true>;
#endif
#ifdef ASYNCLLM_BLOCK_AVX2
  if (path == Path::kAvx2) return &group_simd<KIND, false>;
#endif
  return &group_scalar<KIND>;
}

Path parse_path(const std::string& name) {
  const std::string chosen = name.empty() ? block_quant_best_path() : name;
  const auto available = block_quant_paths();
  TORCH_CHECK(std::find(available.begin(), available.end(), chosen) != available.end(), "block_linear: path '",
              chosen, "' is not in this build (", block_quant_best_path(), " is its best)");
  return chosen == "amx"    ? Path::kAmx
         : chosen == "vnni" ? Path::kVnni
         : chosen == "avx2" ? Path::kAvx2
                            : Path::kScalar;
}

// "" when this process may use AMX int8 tiles (the CPU has AMX-TILE and AMX-INT8, and Linux granted the tile data
// permission, asked once here), else why not.
const std::string& amx_unavailable_reason() {
  static const std::string reason = []() -> std::string {
#ifndef ASYNCLLM_BLOCK_AMX
    return "this build has no AMX path (it needs AVX-512 VNNI, Linux on x86-64 and GCC >= 11 or clang >= 12)";
#else
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return "the CPU has no CPUID leaf 7";
    if (!(edx & (1u << 24)) || !(edx & (1u << 25))) return "the CPU has no AMX-TILE and AMX-INT8";
    constexpr long kArchGetXcompPerm = 0x1022, kArchReqXcompPerm = 0x1023, kXtiledata = 18;
    if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXtiledata) != 0) {
      return std::string("Linux refused the AMX tile data permission (arch_prctl ARCH_REQ_XCOMP_PERM: ") +
             std::strerror(errno) + ")";
    }
    unsigned long granted = 0;
    if (syscall(SYS_arch_prctl, kArchGetXcompPerm, &granted) != 0 || !(granted & (1ul << kXtiledata))) {
      return "Linux refused the AMX tile data permission (ARCH_GET_XCOMP_PERM shows no XTILEDATA)";
    }
    return "";
#endif
  }();
  return reason;
}

// Inputs of up to this many values have their activation blocks in a per-thread scratch (decode steps); larger ones
// (prefill chunks) in tensors of their own, so a long prompt does not leave megabytes held per thread.
constexpr int64_t kScratchValues = int64_t(1) << 18;

// The rows' activation blocks in this thread's scratch (grown as needed up to kScratchValues, never freed: no
// allocation per call at a steady shape); valid until this thread's next call.
Acts quantize_to_scratch(const float* x, int64_t rows, int64_t nb) {
  thread_local std::vector<int8_t> q;
  thread_local std::vector<float> d;
  thread_local std::vector<int32_t> s;
  if (static_cast<int64_t>(d.size()) < rows * nb) {
    q.resize(rows * nb * kBlock);
    d.resize(rows * nb);
    s.resize(rows * nb);
  }
  int8_t* qp = q.data();
  float* dp = d.data();
  int32_t* sp = s.data();
  const int64_t in = nb * kBlock;
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / in), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) quantize_row(x + r * in, nb, qp + r * in, dp + r * nb, sp + r * nb);
  });
  return Acts{qp, dp, sp, nb};
}

}  // namespace

std::vector<std::string> block_quant_paths() {
  std::vector<std::string> paths;
  if (amx_unavailable_reason().empty()) paths.push_back("amx");
#ifdef ASYNCLLM_BLOCK_VNNI
  paths.push_back("vnni");
#endif
#ifdef ASYNCLLM_BLOCK_AVX2
  paths.push_back("avx2");
#endif
  paths.push_back("scalar");
  return paths;
}

std::string block_quant_best_path() { return block_quant_paths().front(); }

std::string block_quant_amx_status() { return amx_unavailable_reason(); }

std::vector<at::Tensor> block_quantize_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "block_quantize_rows: x must be a contiguous 2-D float32 tensor");
  const int64_t rows = x.size(0), in = x.size(1);
  TORCH_CHECK(in % kBlock == 0, "block_quantize_rows: ", in, " input features is not a multiple of 32");
  const int64_t nb = in / kBlock;
  auto q = at::empty({rows, in}, x.options().dtype(at::kChar));
  auto d = at::empty({rows, nb}, x.options());
  auto s = at::empty({rows, nb}, x.options().dtype(at::kInt));
  const float* xp = x.data_ptr<float>();
  int8_t* qp = q.data_ptr<int8_t>();
  float* dp = d.data_ptr<float>();
  int32_t* sp = s.data_ptr<int32_t>();
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(in, 1)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) quantize_row(xp + r * in, nb, qp + r * in, dp + r * nb, sp + r * nb);
  });
  return {q, d, s};
}

at::Tensor block_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d, const at::Tensor& m,
                        int64_t kind, int64_t out_features, const std::string& path_name) {
  TORCH_CHECK(kind == kQ8_0 || kind == kQ4_0 || kind == kQ4_1, "block_linear: unknown kind ", kind);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "block_linear: x must be a contiguous 2-D float32 tensor");
  TORCH_CHECK(x.size(1) % kBlock == 0, "block_linear: ", x.size(1), " input features is not a multiple of 32");
  TORCH_CHECK(out_features >= 1, "block_linear: out_features must be >= 1");
  const Path path = parse_path(path_name);
  const int64_t rows = x.size(0), nb = x.size(1) / kBlock;
  const int64_t groups = (out_features + kGroup - 1) / kGroup;
  const int64_t block_bytes = kind == kQ8_0 ? kBlock : kBlock / 2;
  TORCH_CHECK(qs.scalar_type() == at::kByte && qs.is_contiguous() && qs.numel() == groups * nb * kGroup * block_bytes,
              "block_linear: qs must be contiguous uint8 with ", groups * nb * kGroup * block_bytes, " bytes");
  TORCH_CHECK(d.scalar_type() == at::kHalf && d.is_contiguous() && d.numel() == groups * nb * kGroup,
              "block_linear: d must be contiguous float16 with ", groups * nb * kGroup, " scales");
  if (kind == kQ4_1) {
    TORCH_CHECK(m.scalar_type() == at::kHalf && m.is_contiguous() && m.numel() == groups * nb * kGroup,
                "block_linear: m must be contiguous float16 with ", groups * nb * kGroup, " minimums");
  }
  auto out = at::empty({rows, out_features}, x.options());
  if (rows == 0) return out;
  {
    pybind11::gil_scoped_release no_gil;
    std::vector<at::Tensor> owned;  // the activation blocks of a large input
    Acts acts{};
    if (rows * nb * kBlock <= kScratchValues) {
      acts = quantize_to_scratch(x.data_ptr<float>(), rows, nb);
    } else {
      owned = block_quantize_rows(x);
      acts = Acts{owned[0].data_ptr<int8_t>(), owned[1].data_ptr<float>(), owned[2].data_ptr<int32_t>(), nb};
    }
    const Weights weights{qs.data_ptr<uint8_t>(), d.data_ptr<c10::Half>(),
                          kind == kQ4_1 ? m.data_ptr<c10::Half>() : nullptr, nb, block_bytes};
    const GroupFn fn = kind == kQ8_0 ? group_fn<kQ8_0>(path) : kind == kQ4_0 ? group_fn<kQ4_0>(path)
                                                                                : group_fn<kQ4_1>(path);
    float* op = out.data_ptr<float>();
#ifdef ASYNCLLM_BLOCK_AMX
    if (path == Path::kAmx && rows >= kAmxMinRows) {
      if (kind == kQ8_0) gemm_amx<kQ8_0>(acts, weights, rows, out_features, op);
      if (kind == kQ4_0) gemm_amx<kQ4_0>(acts, weights, rows, out_features, op);
      if (kind == kQ4_1) gemm_amx<kQ4_1>(acts, weights, rows, out_features, op);
      return out;
    }
#endif
#ifdef ASYNCLLM_BLOCK_VNNI
    if ((path == Path::kVnni || path == Path::kAmx) && rows < kGemmMinRows) {
      if (kind == kQ8_0) gemv<kQ8_0>(acts, weights, rows, out_features, op);
      if (kind == kQ4_0) gemv<kQ4_0>(acts, weights, rows, out_features, op);
      if (kind == kQ4_1) gemv<kQ4_1>(acts, weights, rows, out_features, op);
      return out;
    }
    if (path == Path::kVnni || path == Path::kAmx) {
      if (kind == kQ8_0) gemm<kQ8_0>(acts, weights, rows, out_features, op);
      if (kind == kQ4_0) gemm<kQ4_0>(acts, weights, rows, out_features, op);
      if (kind == kQ4_1) gemm<kQ4_1>(acts, weights, rows, out_features, op);
      return out;
    }
#endif
#ifdef ASYNCLLM_BLOCK_AVX2
    if (path == Path::kAvx2 && (kind == kQ8_0 ? rows >= kQ8GemmMinRows2 : rows >= kGemmMinRows)) {
      if (kind == kQ8_0) gemm_avx2_q8(acts, weights, rows, out_features, op);
      if (kind == kQ4_0) gemm_avx2<kQ4_0>(acts, weights, rows, out_features, op);
      if (kind == kQ4_1) gemm_avx2<kQ4_1>(acts, weights, rows, out_features, op);
      return out;
    }
#endif
    // about 4 K block products per task, as the VNNI GEMV: at 1 row a SmolLM2 product of 576 inputs splits into 7
    // tasks (at 64 K per task, as before, the layers' products ran on one thread: 2 threads took a batch-1 step from
    // 10.9 ms CPU to only 9.9 ms wall on the AVX2-only AMD EPYC)
    const int64_t grain = std::max<int64_t>(1, 4096 / std::max<int64_t>(1, rows * nb * kGroup));
    at::parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) {
      for (int64_t g = g0; g < g1; ++g) {
        fn(acts, weights, g, 0, rows, op, out_features, std::min(kGroup, out_features - g * kGroup));
      }
    });
  }
  return out;
}

at::Tensor block_dequantize_columns(const at::Tensor& qs, const at::Tensor& d, const at::Tensor& m, int64_t kind,
                                    int64_t in_features, const at::Tensor& columns) {
  TORCH_CHECK(kind == kQ8_0 || kind == kQ4_0 || kind == kQ4_1, "block_dequantize_columns: unknown kind ", kind);
  TORCH_CHECK(in_features >= kBlock && in_features % kBlock == 0, "block_dequantize_columns: ", in_features,
              " input features is not a positive multiple of 32");
  TORCH_CHECK(columns.dim() == 1 && columns.scalar_type() == at::kLong && columns.is_contiguous(),
              "block_dequantize_columns: columns must be a contiguous int64 [n] tensor");
  const int64_t nb = in_features / kBlock, block_bytes = kind == kQ8_0 ? kBlock : kBlock / 2;
  TORCH_CHECK(d.scalar_type() == at::kHalf && d.is_contiguous() && d.numel() % (nb * kGroup) == 0,
              "block_dequantize_columns: d must be contiguous float16 [groups, ", nb, ", 4]");
  const int64_t groups = d.numel() / (nb * kGroup);
  TORCH_CHECK(qs.scalar_type() == at::kByte && qs.is_contiguous() && qs.numel() == groups * nb * kGroup * block_bytes,
              "block_dequantize_columns: qs must be contiguous uint8 with ", groups * nb * kGroup * block_bytes, " bytes");
  if (kind == kQ4_1) {
    TORCH_CHECK(m.scalar_type() == at::kHalf && m.is_contiguous() && m.numel() == d.numel(),
                "block_dequantize_columns: m must be contiguous float16 like d");
  }
  const int64_t n = columns.numel();
  const int64_t* cp = columns.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK_INDEX(cp[i] >= 0 && cp[i] < groups * kGroup, "column ", cp[i], " is outside the weight's ",
                      groups * kGroup, " (padded) columns");
  auto out = at::empty({n, in_features}, d.options().dtype(at::kFloat));
  const uint8_t* qp = qs.data_ptr<uint8_t>();
  const c10::Half* dp = d.data_ptr<c10::Half>();
  const c10::Half* mp = kind == kQ4_1 ? m.data_ptr<c10::Half>() : nullptr;
  float* op = out.data_ptr<float>();
  at::parallel_for(0, n, std::max<int64_t>(1, 65536 / in_features), [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t g = cp[i] / kGroup, slot = cp[i] % kGroup;
      float* y = op + i * in_features;
      for (int64_t b = 0; b < nb; ++b, y += kBlock) {
        const int64_t k = (g * nb + b) * kGroup + slot;  // this column's block b: [g, b, slot]
        const uint8_t* p = qp + k * block_bytes;
        const float dw = static_cast<float>(dp[k]);
        if (kind == kQ8_0) {
          for (int64_t j = 0; j < kBlock; ++j) y[j] = static_cast<float>(static_cast<int8_t>(p[j])) * dw;
        } else if (kind == kQ4_0) {
          for (int64_t j = 0; j < kBlock / 2; ++j) {
            y[j] = static_cast<float>((p[j] & 15) - 8) * dw;
            y[j + kBlock / 2] = static_cast<float>((p[j] >> 4) - 8) * dw;
          }
        } else {
          const float mw = static_cast<float>(mp[k]);
          for (int64_t j = 0; j < kBlock / 2; ++j) {
            y[j] = dw * static_cast<float>(p[j] & 15) + mw;
            y[j + kBlock / 2] = dw * static_cast<float>(p[j] >> 4) + mw;
          }
        }
      }
    }
  });
  return out;
}
