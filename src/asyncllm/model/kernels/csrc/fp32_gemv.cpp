// float32 matrix-vector products (1-8 rows per pass) on the plain [in, out] weight, for decode steps of a few rows.
//
// Why: at a few rows a product reads every weight value once, so its speed is the speed it streams the weight from
// memory. oneDNN's and MKL's float32 kernels streamed a decode step's small weights at 15-20 GB/s on an AVX2-only AMD
// EPYC VM (family 25 model 17, 2 threads, 30 layers' distinct weights back to back, as a step reads them); this
// kernel at 31-37 GB/s (benchmarks/analysis.md, "float32 GEMV").
//
// How: a weight of up to kWideColumns columns is cut into kPieces pieces of its input rows. A thread takes whole
// pieces, so it reads one contiguous stretch of the weight, and adds x[r, i] * weight[i, :] for four weight rows at a
// time into the piece's partial sums (all output columns, in L1), asking for the weight kPrefetchRows rows ahead into
// L2 (`_MM_HINT_T1`: without it, 7% slower at two threads and 23% at one in a standalone loop). The partial sums are
// then added in piece order. Each piece's sums sit in a buffer kept per calling thread, half a 4 KiB page away from
// its weight rows modulo 4 KiB, their rows a cache line longer than the output's (`place_sums`). A wider weight (an
// LM head) is cut into column chunks instead, each chunk summed over all input rows by one thread straight into the
// output (no partial sums to add: they would be as large as the output).
// Up to kGroupRows rows share a pass over the weight; more rows take more passes.
//
// Sums: float32 FMA in input order within a piece (or chunk), then pieces in order. The cut depends on the shape
// alone, so the values do not depend on the thread count or on the other rows; they differ in the last bits from
// other GEMMs (another summation order), as those differ from each other.
#include "fp32_gemv.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t kPieces = 8;          // pieces of the input features: enough to even out 2-8 threads
constexpr int kGroupRows = 8;           // rows per pass over the weight
constexpr int64_t kPrefetchRows = 8;    // weight rows asked for ahead of the ones read
constexpr int64_t kWideColumns = 8192;  // wider weights are cut into column chunks instead of input pieces
constexpr int64_t kChunkColumns = 4096; // columns x rows of sums per chunk of a wide weight (16 KB: in L1)

constexpr int64_t kPageFloats = 1024;   // floats per 4 KiB page
constexpr int64_t kRowPadFloats = 16;   // a row of partial sums is a 64-byte line longer than the output's

#if defined(__AVX2__) && defined(__FMA__)
// sums[r, 0:cols] = sum over i in [i0, i1) of x[r, i] * w[i, c0:c0 + cols], for rows r < R of x (row stride
// x_stride) and w's rows `out` apart; row r of `sums` starts at sums + r * sums_stride.
template <int R>
void piece_sums(const float* x, int64_t x_stride, const float* w, int64_t out, int64_t i0, int64_t i1, int64_t c0,
                int64_t cols, float* sums, int64_t sums_stride) {
  const int64_t vec_end = cols - cols % 8;
  const __m256i tail_mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(cols % 8)),
                                               _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  float* partial = sums;
  for (int r = 0; r < R; ++r) std::fill(sums + r * sums_stride, sums + r * sums_stride + cols, 0.0f);
  w += c0;
  int64_t i = i0;
  for (; i + 4 <= i1; i += 4) {
    const float* w0 = w + i * out;
    __m256 a[R][4];
    for (int r = 0; r < R; ++r)
      for (int k = 0; k < 4; ++k) a[r][k] = _mm256_set1_ps(x[r * x_stride + i + k]);
    const float* ahead = w0 + kPrefetchRows * out;
    for (int64_t c = 0; c < vec_end; c += 8) {
      if ((c & 15) == 0) {  // once per 64-byte line of each of the 4 rows
        for (int k = 0; k < 4; ++k) _mm_prefetch(reinterpret_cast<const char*>(ahead + k * out + c), _MM_HINT_T1);
      }
      const __m256 v0 = _mm256_loadu_ps(w0 + c), v1 = _mm256_loadu_ps(w0 + out + c);
      const __m256 v2 = _mm256_loadu_ps(w0 + 2 * out + c), v3 = _mm256_loadu_ps(w0 + 3 * out + c);
      for (int r = 0; r < R; ++r) {
        float* y = partial + r * sums_stride + c;
        __m256 acc = _mm256_loadu_ps(y);
        acc = _mm256_fmadd_ps(a[r][0], v0, acc);
        acc = _mm256_fmadd_ps(a[r][1], v1, acc);
        acc = _mm256_fmadd_ps(a[r][2], v2, acc);
        acc = _mm256_fmadd_ps(a[r][3], v3, acc);
        _mm256_storeu_ps(y, acc);
      }
    }
    if (vec_end < cols) {
      const __m256 v0 = _mm256_maskload_ps(w0 + vec_end, tail_mask);
      const __m256 v1 = _mm256_maskload_ps(w0 + out + vec_end, tail_mask);
      const __m256 v2 = _mm256_maskload_ps(w0 + 2 * out + vec_end, tail_mask);
      const __m256 v3 = _mm256_maskload_ps(w0 + 3 * out + vec_end, tail_mask);
      for (int r = 0; r < R; ++r) {
        float* y = partial + r * sums_stride + vec_end;
        __m256 acc = _mm256_maskload_ps(y, tail_mask);
        acc = _mm256_fmadd_ps(a[r][0], v0, acc);
        acc = _mm256_fmadd_ps(a[r][1], v1, acc);
        acc = _mm256_fmadd_ps(a[r][2], v2, acc);
        acc = _mm256_fmadd_ps(a[r][3], v3, acc);
        _mm256_maskstore_ps(y, tail_mask, acc);
      }
    }
  }
  for (; i < i1; ++i) {  // the last 1-3 input rows of a piece
    const float* wi = w + i * out;
    for (int r = 0; r < R; ++r) {
      const float xi = x[r * x_stride + i];
      float* y = partial + r * sums_stride;
      for (int64_t c = 0; c < cols; ++c) y[c] = std::fma(xi, wi[c], y[c]);
    }
  }
}

// out [rows, cols] = the pieces' partial sums (pieces[p], rows `stride` apart) added in piece order.
void add_pieces(float* const* pieces, int64_t num_pieces, int64_t rows, int64_t cols, int64_t stride, float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t row = r * stride;
    float* y = out + r * cols;
    int64_t c = 0;
    for (; c + 8 <= cols; c += 8) {
      __m256 sum = _mm256_loadu_ps(pieces[0] + row + c);
      for (int64_t p = 1; p < num_pieces; ++p) sum = _mm256_add_ps(sum, _mm256_loadu_ps(pieces[p] + row + c));
      _mm256_storeu_ps(y + c, sum);
    }
    for (; c < cols; ++c) {
      float sum = pieces[0][row + c];
      for (int64_t p = 1; p < num_pieces; ++p) sum += pieces[p][row + c];
      y[c] = sum;
    }
  }
}

// Where a piece's partial sums go in its region of the buffer (R rows of out + kRowPadFloats floats, then
// kPageFloats): half a 4 KiB page away from its weight rows' addresses modulo 4 KiB. A load whose address matches an
// earlier store's modulo 4 KiB waits for it (4K aliasing). The rows of a weight whose width is a multiple of 1,024
// floats all fall on one offset: sums on that offset made 8-row products twice as slow in some processes (44 against
// 22 ms for 30 layers), and sum rows exactly as long as the output's (row r stored, row r + 1 loaded) 23 against 19.
float* place_sums(float* region, const float* weight_rows) {
  const auto offset = [](const void* p) { return reinterpret_cast<std::uintptr_t>(p) & 4095; };
  const std::uintptr_t shift = ((offset(weight_rows) + 2048 - offset(region)) & 4095) & ~std::uintptr_t{63};
  return region + shift / sizeof(float);
}

// y [R, out] = x [R, in] @ w [in, out]: a weight of at most kWideColumns columns in `pieces` pieces of its input
// rows, each piece's partial sums in its region of `buffer`, added in piece order; a wider one (an LM head) in column
// chunks of kChunkColumns / R columns, each chunk's sums over all input rows written straight into y.
template <int R>
void group_product(const float* x, int64_t in, const float* w, int64_t out, float* y, float* buffer,
                   int64_t piece_rows, int64_t pieces) {
  if (out > kWideColumns) {
    constexpr int64_t chunk_columns = kChunkColumns / R / 8 * 8;
    const int64_t chunks = (out + chunk_columns - 1) / chunk_columns;
    at::parallel_for(0, chunks, 1, [&](int64_t k0, int64_t k1) {
      for (int64_t k = k0; k < k1; ++k) {
        const int64_t c0 = k * chunk_columns;
        piece_sums<R>(x, in, w, out, 0, in, c0, std::min(chunk_columns, out - c0), y + c0, out);
      }
    });
    return;
  }
  float* sums[kPieces];
  const int64_t stride = out + kRowPadFloats;
  for (int64_t p = 0; p < pieces; ++p) {
    sums[p] = place_sums(buffer + p * (R * stride + kPageFloats), w + p * piece_rows * out);
  }
  at::parallel_for(0, pieces, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      piece_sums<R>(x, in, w, out, p * piece_rows, std::min(in, (p + 1) * piece_rows), 0, out, sums[p], stride);
    }
  });
  add_pieces(sums, pieces, R, out, stride, y);
}
#endif

}  // namespace

bool fp32_gemv_available() {
#if defined(__AVX2__) && defined(__FMA__)
  return true;
#else
  return false;
#endif
}

at::Tensor fp32_gemv(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(fp32_gemv_available(), "fp32_gemv: this build has no AVX2/FMA path");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(0),
              "fp32_gemv: x [rows, in] and weight [in, out] needed, got ", x.sizes(), " and ", weight.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat, "fp32_gemv: float32 only");
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), "fp32_gemv: contiguous x and weight needed");
  const int64_t rows = x.size(0), in = x.size(1), out = weight.size(1);
  at::Tensor y = at::empty({rows, out}, x.options());
  if (rows == 0 || out == 0) return y;
  if (in == 0) return y.zero_();
#if defined(__AVX2__) && defined(__FMA__)
  const int64_t piece_rows = std::max<int64_t>(4, ((in + kPieces - 1) / kPieces + 3) / 4 * 4);
  const int64_t pieces = (in + piece_rows - 1) / piece_rows;
  // each piece zero-fills its own partial sums: one buffer per calling thread (at most 8 x (8 x 8,208 + 1,024)
  // floats, 2.1 MB), kept between calls, so a call neither allocates nor clears it
  thread_local std::vector<float> buffer;
  const int64_t group_rows = std::min<int64_t>(kGroupRows, rows);
  const int64_t region = group_rows * (out + kRowPadFloats) + kPageFloats;  // floats per piece (`place_sums`)
  const size_t needed = out <= kWideColumns ? static_cast<size_t>(pieces * region) : 0;
  if (buffer.size() < needed) buffer.resize(needed);
  float* partials = buffer.data();
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  pybind11::gil_scoped_release no_gil;
  for (int64_t r0 = 0; r0 < rows; r0 += kGroupRows) {
    const float* xr = xp + r0 * in;
    float* yr = yp + r0 * out;
    switch (std::min<int64_t>(kGroupRows, rows - r0)) {
      case 1: group_product<1>(xr, in, wp, out, yr, partials, piece_rows, pieces); break;
      case 2: group_product<2>(xr, in, wp, out, yr, partials, piece_rows, pieces); break;
      case 3: group_product<3>(xr, in, wp, out, yr, partials, piece_rows, pieces); break;
      case 4: group_product<4>(xr, in, wp, out, yr, partials, piece_rows, pieces); break;
      case 5: group_product<5>(xr, in, wp, out, yr, partials, piece_rows, pieces); break;
      case 6: group_product<6>(xr, in, wp, out, yr, partials, piece_rows, pieces); break;
      case 7: group_product<7>(xr, in, wp, out, yr, partials, piece_rows, pieces); break;
      default: group_product<8>(xr, in, wp, out, yr, partials, piece_rows, pieces); break;
    }
  }
#endif
  return y;
}
