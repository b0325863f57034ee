// int8 x int8 products with exact int32 sums on AVX2, for the int8 weights (per-column scales; the caller applies each
// row's activation scale).
//
// Why: on CPUs without AVX-512 VNNI or AMX (an AVX2-only AMD EPYC VM, family 25 model 17, torch 2.13.0), torch's
// `torch._int_mm` runs 15-45x slower than the same product in float32, and oneDNN's prepacked int8 linear gives
// values off by thousands (docs/kernels.md). This kernel gives the values `_int_mm(qx, w).float() * scale` gives.
//
// Layout: the weight's columns in panels of 8; a panel is a run of quads, each 32 bytes holding 4 consecutive input
// features of its 8 columns (column-major within the quad), so one 256-bit load feeds 8 columns' 4-term dot products:
// `vpmaddubsw(|x|, sign(w, x))` multiplies unsigned |x| by the weight with x's sign moved onto it and adds pairs in
// int16 (at most 2 x 128 x 127 = 32512: never saturates, as the weight is never -128), `vpmaddwd` with ones adds
// those pairs into the 8 columns' int32 sums (the same two-step dot product as llama.cpp's AVX2 `mul_sum_i8_pairs`;
// our own code). A register tile of up to 4 rows x 2 panels reuses each weight load across rows and each broadcast
// activation quad across panels. Integer sums are exact in any order; the scaling after them is one int32 -> float32
// conversion and one float32 multiply, as in torch.
//
// The VNNI path (CPUs with AVX-512 VNNI; torch's `_int_mm` reaches half their int8 peak at decode's 8-64 rows): panels
// of 16 columns, each quad 64 bytes, so one 512-bit load feeds 16 columns. `vpdpbusd` multiplies unsigned bytes by
// signed ones and adds each 4-term dot product into an int32 lane (no saturation). AVX-512 has no byte sign
// instruction, so the activations go in as `x + 128` (0..255) and each column's sum loses `128 * sum_k w[k, n]`,
// computed once at packing: integer arithmetic throughout, so the result is the exact sum, as on the AVX2 path (int32
// lanes wrap, but the exact sum fits and the correction is made modulo 2^32 too). oneDNN subtracts the same
// correction after a trip through float32, which is why asyncllm does not offer its uint8 route (docs/kernels.md).
// A register tile of up to 6 rows x 4 panels (24 accumulators).
#include "int8_gemm.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t kCols = 8;      // columns per panel: one vector of int32 sums
constexpr int64_t kQuad = 4;      // input features per 32-bit lane
constexpr int64_t kQuadBytes = kCols * kQuad;
constexpr int kTileRows = 4;
constexpr int kTilePanels = 2;

#ifdef __AVX2__
// Sums of rows [r0, r0 + R) with panels [p0, p0 + P) over every quad, scaled into out [rows, out_features].
template <int R, int P>
void tile(const int8_t* x, int64_t x_stride, const int8_t* w, int64_t quads, int64_t p0, const float* scale,
          float* out, int64_t out_features) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i acc[R][P];
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p) acc[r][p] = _mm256_setzero_si256();
  const int8_t* panel[P];
  for (int p = 0; p < P; ++p) panel[p] = w + (p0 + p) * quads * kQuadBytes;
  for (int64_t q = 0; q < quads; ++q) {
    __m256i wv[P];
    for (int p = 0; p < P; ++p) wv[p] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel[p] + q * kQuadBytes));
    for (int r = 0; r < R; ++r) {
      int32_t quad;
      std::memcpy(&quad, x + r * x_stride + q * kQuad, sizeof(quad));
      const __m256i xv = _mm256_set1_epi32(quad);
      const __m256i ax = _mm256_abs_epi8(xv);  // |x| read as unsigned: 128 for -128
      for (int p = 0; p < P; ++p) {
        const __m256i pairs = _mm256_maddubs_epi16(ax, _mm256_sign_epi8(wv[p], xv));
        acc[r][p] = _mm256_add_epi32(acc[r][p], _mm256_madd_epi16(pairs, ones));
      }
    }
  }
  for (int p = 0; p < P; ++p) {
    const int64_t col0 = (p0 + p) * kCols;
    const int64_t columns = std::min<int64_t>(kCols, out_features - col0);
    alignas(32) float scales[kCols] = {};
    std::memcpy(scales, scale + col0, columns * sizeof(float));
    const __m256 scale_v = _mm256_load_ps(scales);
    for (int r = 0; r < R; ++r) {
      alignas(32) float values[kCols];
      _mm256_store_ps(values, _mm256_mul_ps(_mm256_cvtepi32_ps(acc[r][p]), scale_v));
      std::memcpy(out + r * out_features + col0, values, columns * sizeof(float));
    }
  }
}

template <int P>
void row_tiles(const int8_t* x, int64_t rows, int64_t x_stride, const int8_t* w, int64_t quads, int64_t p0,
               const float* scale, float* out, int64_t out_features) {
  int64_t r = 0;
  for (; r + kTileRows <= rows; r += kTileRows)
    tile<kTileRows, P>(x + r * x_stride, x_stride, w, quads, p0, scale, out + r * out_features, out_features);
  const int64_t left = rows - r;
  const int8_t* xr = x + r * x_stride;
  float* o = out + r * out_features;
  if (left == 3) tile<3, P>(xr, x_stride, w, quads, p0, scale, o, out_features);
  if (left == 2) tile<2, P>(xr, x_stride, w, quads, p0, scale, o, out_features);
  if (left == 1) tile<1, P>(xr, x_stride, w, quads, p0, scale, o, out_features);
}
#endif


constexpr int64_t kVnniCols = 16;  // columns per panel of the VNNI path: one 512-bit vector of int32 sums

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define ASYNCLLM_INT8_VNNI 1
constexpr int64_t kVnniQuadBytes = kVnniCols * kQuad;
constexpr int64_t kVnniTileRows = 4;
constexpr int kVnniTilePanels = 4;
constexpr int64_t kVnniRowBlock = 48;  // rows per task: many-row products share out rows as well as columns
constexpr int64_t kVnniGroupCols = kVnniTilePanels * kVnniCols;
constexpr int64_t kVnniQuadChunk = 32;  // quads per chunk of the inputs: 4 panels' chunk is 8 KB

// One VNNI product's operands: the offset activations `xu` (x + 128, rows padded to whole quads), the packed weight,
// its corrections and scales, and the output [rows, out_features].
struct VnniOperands {
  const uint8_t* xu;
  int64_t x_stride;
  const int8_t* w;
  int64_t quads;
  const int32_t* correction;
  const float* scale;
  float* out;
  int64_t out_features;
};

// Sums of rows [r, r + R) with panels [p0, p0 + P) over quads [q0, q1): started from zero (q0 == 0) or from `partial`
// (R rows of kVnniGroupCols int32), and kept there, or on the last quad corrected, scaled and written out.
template <int R, int P>
void vnni_tile(const VnniOperands& a, int64_t r, int64_t p0, int64_t q0, int64_t q1, int32_t* partial) {
  __m512i acc[R][P];
  for (int i = 0; i < R; ++i)
    for (int p = 0; p < P; ++p)
      acc[i][p] = q0 == 0 ? _mm512_setzero_si512() : _mm512_loadu_si512(partial + i * kVnniGroupCols + p * kVnniCols);
  const int8_t* panel[P];
  for (int p = 0; p < P; ++p) panel[p] = a.w + (p0 + p) * a.quads * kVnniQuadBytes;
  const uint8_t* x = a.xu + r * a.x_stride;
  for (int64_t q = q0; q < q1; ++q) {
    __m512i wv[P];
    for (int p = 0; p < P; ++p) wv[p] = _mm512_loadu_si512(panel[p] + q * kVnniQuadBytes);
    for (int i = 0; i < R; ++i) {
      int32_t quad;
      std::memcpy(&quad, x + i * a.x_stride + q * kQuad, sizeof(quad));
      const __m512i xv = _mm512_set1_epi32(quad);
      for (int p = 0; p < P; ++p) acc[i][p] = _mm512_dpbusd_epi32(acc[i][p], xv, wv[p]);
    }
  }
  if (q1 < a.quads) {
    for (int i = 0; i < R; ++i)
      for (int p = 0; p < P; ++p) _mm512_storeu_si512(partial + i * kVnniGroupCols + p * kVnniCols, acc[i][p]);
    return;
  }
  for (int p = 0; p < P; ++p) {
    const int64_t col0 = (p0 + p) * kVnniCols;
    const int64_t columns = std::min<int64_t>(kVnniCols, a.out_features - col0);
    const __mmask16 mask = static_cast<__mmask16>((1u << columns) - 1u);
    const __m512i correction_v = _mm512_maskz_loadu_epi32(mask, a.correction + col0);
    const __m512 scale_v = _mm512_maskz_loadu_ps(mask, a.scale + col0);
    for (int i = 0; i < R; ++i) {
      const __m512 sums = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[i][p], correction_v));
      _mm512_mask_storeu_ps(a.out + (r + i) * a.out_features + col0, mask, _mm512_mul_ps(sums, scale_v));
    }
  }
}

// Rows [r0, r0 + rows) (rows <= kVnniRowBlock) with panels [p0, p0 + P) over quads [q0, q1).
template <int P>
void vnni_row_tiles(const VnniOperands& a, int64_t r0, int64_t rows, int64_t p0, int64_t q0, int64_t q1,
                    int32_t* partial) {
  int64_t i = 0;
  for (; i + kVnniTileRows <= rows; i += kVnniTileRows)
    vnni_tile<kVnniTileRows, P>(a, r0 + i, p0, q0, q1, partial + i * kVnniGroupCols);
  int32_t* rest = partial + i * kVnniGroupCols;
  switch (rows - i) {
    case 3: return vnni_tile<3, P>(a, r0 + i, p0, q0, q1, rest);
    case 2: return vnni_tile<2, P>(a, r0 + i, p0, q0, q1, rest);
    case 1: return vnni_tile<1, P>(a, r0 + i, p0, q0, q1, rest);
    default: return;
  }
}

// Rows [r0, r0 + rows) (rows <= kVnniRowBlock) with panels [p0, p0 + count) (count <= kVnniTilePanels). More than
// one tile of rows takes the inputs in chunks of kVnniQuadChunk quads, each chunk of the panels (8 KB) read from L1
// by every row tile while the sums wait in `partial`; a single tile reads each weight byte once anyway.
template <int P>
void vnni_block(const VnniOperands& a, int64_t r0, int64_t rows, int64_t p0) {
  alignas(64) int32_t partial[kVnniRowBlock * kVnniGroupCols];
  const int64_t chunk = rows <= kVnniTileRows ? a.quads : kVnniQuadChunk;
  for (int64_t q0 = 0; q0 < a.quads; q0 += chunk)
    vnni_row_tiles<P>(a, r0, rows, p0, q0, std::min(a.quads, q0 + chunk), partial);
}

void vnni_panels(const VnniOperands& a, int64_t r0, int64_t rows, int64_t p0, int64_t count) {
  switch (count) {
    case 4: return vnni_block<4>(a, r0, rows, p0);
    case 3: return vnni_block<3>(a, r0, rows, p0);
    case 2: return vnni_block<2>(a, r0, rows, p0);
    default: return vnni_block<1>(a, r0, rows, p0);
  }
}
#endif

// A contiguous [in, out] int8 weight -> uint8 [ceil(out / cols), ceil(in / 4), cols, 4]: panels of `cols` columns,
// each a run of 4-input quads of those columns (column-major within the quad), zero-padded.
at::Tensor pack_panels(const at::Tensor& w, int64_t cols) {
  const int64_t in = w.size(0), out = w.size(1);
  const int64_t panels = (out + cols - 1) / cols, quads = (in + kQuad - 1) / kQuad;
  auto packed = at::zeros({panels, quads, cols, kQuad}, w.options().dtype(at::kByte));
  const int8_t* src = w.data_ptr<int8_t>();
  auto* dst = reinterpret_cast<int8_t*>(packed.data_ptr<uint8_t>());
  for (int64_t k = 0; k < in; ++k)
    for (int64_t n = 0; n < out; ++n)
      dst[((n / cols * quads + k / kQuad) * cols + n % cols) * kQuad + k % kQuad] = src[k * out + n];
  return packed;
}

// The checks both products make of their operands: `name` is the product's, `pack` the packing function's name,
// `cols` its panel width.
void check_operands(const char* name, const char* pack, const at::Tensor& qx, const at::Tensor& packed,
                    const at::Tensor& scale, int64_t in_features, int64_t out_features, int64_t cols) {
  TORCH_CHECK(qx.dim() == 2 && qx.scalar_type() == at::kChar, name, ": expected 2-D int8 activations");
  TORCH_CHECK(out_features >= 1, name, ": out_features must be >= 1");
  TORCH_CHECK(qx.size(1) == in_features, name, ": activations of ", qx.size(1), " features for a weight of ",
              in_features, " input features");
  const int64_t panels = (out_features + cols - 1) / cols, quads = (in_features + kQuad - 1) / kQuad;
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.sizes() == at::IntArrayRef({panels, quads, cols, kQuad}),
              name, ": the packed weight is not ", pack, "'s for ", in_features, " x ", out_features);
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() == out_features, name,
              ": scale must be float32 with ", out_features, " values");
}

}  // namespace

bool int8_avx2_available() {
#ifdef __AVX2__
  return true;
#else
  return false;
#endif
}

at::Tensor int8_pack_avx2(const at::Tensor& qweight) {
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == at::kChar, "int8_pack_avx2: expected a 2-D int8 weight");
  TORCH_CHECK(qweight.min().item<int>() > -128, "int8_pack_avx2: the weight holds -128 (symmetric int8 never does)");
  return pack_panels(qweight.contiguous(), kCols);
}

at::Tensor int8_gemm_avx2(const at::Tensor& qx, const at::Tensor& packed, const at::Tensor& scale,
                          int64_t in_features, int64_t out_features) {
  TORCH_CHECK(int8_avx2_available(), "int8_gemm_avx2: this build has no AVX2 path");
  check_operands("int8_gemm_avx2", "int8_pack_avx2", qx, packed, scale, in_features, out_features, kCols);
  const int64_t rows = qx.size(0), in = in_features;
  const int64_t panels = (out_features + kCols - 1) / kCols, quads = (in + kQuad - 1) / kQuad;
  // rows padded with zeros to whole quads where `in` is not a multiple of 4
  const auto x = in % kQuad == 0 ? qx.contiguous() : at::constant_pad_nd(qx, {0, quads * kQuad - in}).contiguous();
  auto out = at::empty({rows, out_features}, qx.options().dtype(at::kFloat));
  if (rows == 0) return out;
#ifdef __AVX2__
  pybind11::gil_scoped_release no_gil;
  const int8_t* xp = x.data_ptr<int8_t>();
  const int8_t* wp = reinterpret_cast<const int8_t*>(packed.data_ptr<uint8_t>());
  const float* sp = scale.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t stride = quads * kQuad;
  const int64_t pairs = (panels + kTilePanels - 1) / kTilePanels;
  // about 64 K multiply-adds per task: a 1-row product of SmolLM2's shapes splits over both threads
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, rows * in * kCols * kTilePanels));
  at::parallel_for(0, pairs, grain, [&](int64_t a0, int64_t a1) {
    for (int64_t a = a0; a < a1; ++a) {
      const int64_t p0 = a * kTilePanels;
      if (p0 + kTilePanels <= panels)
        row_tiles<kTilePanels>(xp, rows, stride, wp, quads, p0, sp, op, out_features);
      else
        row_tiles<1>(xp, rows, stride, wp, quads, p0, sp, op, out_features);
    }
  });
#endif
  return out;
}

bool int8_vnni_available() {
#ifdef ASYNCLLM_INT8_VNNI
  return true;
#else
  return false;
#endif
}

std::tuple<at::Tensor, at::Tensor> int8_pack_vnni(const at::Tensor& qweight) {
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == at::kChar, "int8_pack_vnni: expected a 2-D int8 weight");
  const auto w = qweight.contiguous();
  auto packed = pack_panels(w, kVnniCols);
  // 128 * sum_k w[k, n]: at most 128 * 127 * in in magnitude, exact in int64; kept modulo 2^32 as the sums are
  auto correction = (w.sum(0, /*keepdim=*/false, at::kLong) * 128).to(at::kInt).contiguous();
  return {packed, correction};
}

at::Tensor int8_gemm_vnni(const at::Tensor& qx, const at::Tensor& packed, const at::Tensor& correction,
                          const at::Tensor& scale, int64_t in_features, int64_t out_features) {
  TORCH_CHECK(int8_vnni_available(), "int8_gemm_vnni: this build has no AVX-512 VNNI path");
  check_operands("int8_gemm_vnni", "int8_pack_vnni", qx, packed, scale, in_features, out_features, kVnniCols);
  TORCH_CHECK(correction.scalar_type() == at::kInt && correction.is_contiguous() && correction.numel() == out_features,
              "int8_gemm_vnni: the correction must be int8_pack_vnni's int32 one of ", out_features, " values");
  const int64_t rows = qx.size(0), in = in_features;
  const int64_t panels = (out_features + kVnniCols - 1) / kVnniCols, quads = (in + kQuad - 1) / kQuad;
  auto out = at::empty({rows, out_features}, qx.options().dtype(at::kFloat));
  if (rows == 0) return out;
#ifdef ASYNCLLM_INT8_VNNI
  // x + 128 as unsigned bytes (flipping the sign bit), rows padded to whole quads with 128: the padded weights are 0
  const int64_t stride = quads * kQuad;
  auto xu = at::full({rows, stride}, 128, qx.options().dtype(at::kByte));
  const auto x = qx.contiguous();
  {
    const auto* src = reinterpret_cast<const uint8_t*>(x.data_ptr<int8_t>());
    uint8_t* dst = xu.data_ptr<uint8_t>();
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t k = 0; k < in; ++k) dst[r * stride + k] = src[r * in + k] ^ 0x80u;
  }
  pybind11::gil_scoped_release no_gil;
  const uint8_t* xp = xu.data_ptr<uint8_t>();
  const int8_t* wp = reinterpret_cast<const int8_t*>(packed.data_ptr<uint8_t>());
  const int32_t* cp = correction.data_ptr<int32_t>();
  const float* sp = scale.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t groups = (panels + kVnniTilePanels - 1) / kVnniTilePanels;
  const int64_t row_blocks = (rows + kVnniRowBlock - 1) / kVnniRowBlock;
  // a task: one group of panels for one block of rows (a thread's tasks run the same group's blocks in turn); about
  // 256 K multiply-adds per task, so a 1-row product of SmolLM2's shapes splits over both threads
  const int64_t task_rows = std::min(rows, kVnniRowBlock);
  const int64_t grain =
      std::max<int64_t>(1, 262144 / std::max<int64_t>(1, task_rows * in * kVnniCols * kVnniTilePanels));
  const VnniOperands operands{xp, stride, wp, quads, cp, sp, op, out_features};
  at::parallel_for(0, groups * row_blocks, grain, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t p0 = t / row_blocks * kVnniTilePanels, r0 = t % row_blocks * kVnniRowBlock;
      vnni_panels(operands, r0, std::min(kVnniRowBlock, rows - r0), p0, std::min<int64_t>(kVnniTilePanels, panels - p0));
    }
  });
#endif
  return out;
}
