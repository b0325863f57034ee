// Fused row kernels of the decoder layer (asyncllm/model/kernels/row_kernels.py builds and loads this file).
//
// Each kernel does in one pass over a row what the eager path does in 2-12 torch ops, so a decode step runs
// far fewer ops between its matrix products. The arithmetic is the eager ops', operation for operation, so the
// values are the same bit for bit: per-row symmetric int8 quantization `scale = max(max|y|, 1e-30) / 127`,
// `q = round_half_even(y / scale)` (model/kernels/int8.py `quantize_rows`); RMSNorm `x * rsqrt(mean(x^2) + eps) * w`
// (Zhang & Sennrich, 2019) with the sum of squares added in ATen's order (`sum_squares`); SiLU
// `a / (1 + exp(-a))` with ATen's vectorized exp; rotary `y * cos + roll(y) * sin`; the K/V stores are copies.
// Built with -ffp-contract=off (no fused multiply-adds). Rows are independent: a row's result never depends on its
// batch.
//
// The float32 products with an MKL-packed weight live in packed_gemm.cpp, the block-quantized products in
// block_quant.cpp; this module exports them.
#include "vec_capability.h"
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <type_traits>
#include <vector>

#include "block_quant.h"
#include "fp32_gemv.h"
#include "int8_gemm.h"
#include "packed_gemm.h"
#include "paged_attention.h"
#include "paged_prefill_attention.h"

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kGrainElements = 32768;  // ATen's grain size: fewer elements than this run on one thread

int64_t grain_rows(int64_t cols) { return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(cols, 1)); }

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), name,
              " must be a contiguous 2-D float32 tensor");
}

float max_lanes(const Vec& v) {
  float lanes[Vec::size()];
  v.store(lanes);
  return *std::max_element(lanes, lanes + Vec::size());
}

// ATen's utils::CeilLog2.
int64_t ceil_log2(int64_t x) {
  if (x <= 2) return 1;
  int64_t bits = 0;
  while ((int64_t{1} << bits) < x) ++bits;
  return bits;
}

// W float lanes added lane by lane (one `Vectorized<float>` of ATen's sum kernel when W = 8).
template <int64_t W>
struct Lanes {
  float v[W];
  static Lanes zero() {
    Lanes lanes;
    std::fill_n(lanes.v, W, 0.f);
    return lanes;
  }
  void add(const Lanes& other) {
    for (int64_t i = 0; i < W; ++i) v[i] += other.v[i];
  }
};

// The W squares x[index * W + i]^2.
template <int64_t W>
Lanes<W> squares_at(const float* x, int64_t index) {
  Lanes<W> lanes;
  for (int64_t i = 0; i < W; ++i) lanes.v[i] = x[index * W + i] * x[index * W + i];
  return lanes;
}

// ATen's `row_sum` over `count` items of W lanes (SumKernel.cpp, `multi_row_sum` with 4 interleaved
// accumulators merged in a cascade of 4 levels, chunks of at least 16 rows).
template <int64_t W>
Lanes<W> cascade_sum_squares(const float* x, int64_t count) {
  constexpr int64_t kIlp = 4, kLevels = 4;
  const int64_t rows = count / kIlp;
  const int64_t level_power = std::max<int64_t>(4, ceil_log2(rows) / kLevels);
  const int64_t level_step = int64_t{1} << level_power, level_mask = level_step - 1;
  Lanes<W> acc[kLevels][kIlp];
  for (auto& level : acc) std::fill_n(level, kIlp, Lanes<W>::zero());
  int64_t i = 0;
  while (i + level_step <= rows) {
    for (int64_t j = 0; j < level_step; ++j, ++i)
      for (int64_t k = 0; k < kIlp; ++k) acc[0][k].add(squares_at<W>(x, i * kIlp + k));
    for (int64_t j = 1; j < kLevels; ++j) {
      for (int64_t k = 0; k < kIlp; ++k) {
        acc[j][k].add(acc[j - 1][k]);
        acc[j - 1][k] = Lanes<W>::zero();
      }
      if ((i & (level_mask << (j * level_power))) != 0) break;
    }
  }
  for (; i < rows; ++i)
    for (int64_t k = 0; k < kIlp; ++k) acc[0][k].add(squares_at<W>(x, i * kIlp + k));
  for (int64_t j = 1; j < kLevels; ++j)
    for (int64_t k = 0; k < kIlp; ++k) acc[0][k].add(acc[j][k]);
  for (int64_t v = rows * kIlp; v < count; ++v) acc[0][0].add(squares_at<W>(x, v));
  for (int64_t k = 1; k < kIlp; ++k) acc[0][0].add(acc[0][k]);
  return acc[0][0];
}

// Sum of x[i]^2 over a contiguous row in the order of ATen's float `sum` over a contiguous dimension, so that
// RMSNorm here gives `F.rms_norm`'s values bit for bit: 8-lane vectors (the width of ATen's sum kernel: x86
// builds dispatch it to the AVX2 or default kernel, both 8 floats wide), then the scalar tail, then the lanes;
// rows shorter than one vector take ATen's scalar path. `row_kernels.self_check` compares with torch at start-up.
float sum_squares(const float* x, int64_t n) {
  constexpr int64_t kWidth = 8;
  if (n < kWidth) return cascade_sum_squares<1>(x, n).v[0];
  const int64_t count = n / kWidth;
  const Lanes<kWidth> lanes = cascade_sum_squares<kWidth>(x, count);
  float total = 0.f;
  for (int64_t t = count * kWidth; t < n; ++t) total += x[t] * x[t];
  for (int64_t i = 0; i < kWidth; ++i) total += lanes.v[i];
  return total;
}

void check_weight(const at::Tensor& weight, int64_t cols) {
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == cols && weight.scalar_type() == at::kFloat &&
              weight.is_contiguous(), "weight must be a contiguous float32 [hidden]");
}

// Quantize one row `y[0:n]` in place of `q`; returns its scale. `y` is overwritten with the rounded values.
float quantize_row(float* y, int64_t n, int8_t* q) {
  Vec vmax(0.f);
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) vmax = at::vec::maximum(vmax, Vec::loadu(y + i).abs());
  float amax = max_lanes(vmax);
  for (; i < n; ++i) amax = std::max(amax, std::fabs(y[i]));
  const float scale = std::max(amax, 1e-30f) * (1.0f / 127.0f);
  const Vec vscale(scale);
  for (i = 0; i + Vec::size() <= n; i += Vec::size()) (Vec::loadu(y + i) / vscale).round().store(y + i);
  for (; i < n; ++i) y[i] = std::nearbyint(y[i] / scale);
  for (i = 0; i < n; ++i) q[i] = static_cast<int8_t>(static_cast<int32_t>(y[i]));
  return scale;
}

// RMSNorm of one row into y: row * (1 / sqrt(sum(row^2) / cols + eps)) * w, in `F.rms_norm`'s order.
void rms_norm_row(const float* row, const float* w, int64_t cols, float eps, float* y) {
  const float mean = sum_squares(row, cols) / static_cast<float>(cols);
  const float inv = 1.0f / std::sqrt(mean + eps);
  const Vec vinv(inv);
  int64_t i = 0;
  for (; i + Vec::size() <= cols; i += Vec::size()) (Vec::loadu(row + i) * vinv * Vec::loadu(w + i)).store(y + i);
  for (; i < cols; ++i) y[i] = row[i] * inv * w[i];
}

// silu(gate * s) * (up * s) of one gate/up row ([gate | up], 2 * inter values) into y; s = 1 leaves both as they
// are (multiplying by 1 is exact).
void silu_mul_row(const float* gate, int64_t inter, float s, float* y) {
  const float* up = gate + inter;
  const Vec vs(s), one(1.f);
  int64_t i = 0;
  for (; i + Vec::size() <= inter; i += Vec::size()) {
    const Vec a = Vec::loadu(gate + i) * vs;
    ((a / (one + a.neg().exp())) * (Vec::loadu(up + i) * vs)).store(y + i);
  }
  for (; i < inter; ++i) {
    const float a = gate[i] * s;
    y[i] = a / (1.f + std::exp(-a)) * (up[i] * s);
  }
}

// x[i] *= s.
void scale_row(float* x, int64_t n, float s) {
  const Vec vs(s);
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) (Vec::loadu(x + i) * vs).store(x + i);
  for (; i < n; ++i) x[i] *= s;
}

// x[i] += b[i].
void add_row(float* x, const float* b, int64_t n) {
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) (Vec::loadu(x + i) + Vec::loadu(b + i)).store(x + i);
  for (; i < n; ++i) x[i] += b[i];
}

// out[i] = x[i] * c[i] + rolled[i] * s[i] for i < n: one half of a head's rotary embedding, where `rolled` is the
// other half of the same head (roll by head_dim / 2).
void rotate_half(const float* x, const float* rolled, const float* c, const float* s, int64_t n, float* out) {
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size())
    (Vec::loadu(x + i) * Vec::loadu(c + i) + Vec::loadu(rolled + i) * Vec::loadu(s + i)).store(out + i);
  for (; i < n; ++i) out[i] = x[i] * c[i] + rolled[i] * s[i];
}

// Quantize `rows` rows of `cols` values each: `fill(r, y)` writes row r's float32 values into y, which is then
// quantized into int8 [rows, cols] with float32 [rows, 1] scales. `grain_cols` is the width of an input row.
template <typename Fill>
std::tuple<at::Tensor, at::Tensor> quantize_each_row(const at::Tensor& like, int64_t rows, int64_t cols,
                                                     int64_t grain_cols, const Fill& fill) {
  auto q = at::empty({rows, cols}, like.options().dtype(at::kChar));
  auto scale = at::empty({rows, 1}, like.options());
  int8_t* qp = q.data_ptr<int8_t>();
  float* sp = scale.data_ptr<float>();
  at::parallel_for(0, rows, grain_rows(grain_cols), [&](int64_t begin, int64_t end) {
    std::vector<float> y(cols);
    for (int64_t r = begin; r < end; ++r) {
      fill(r, y.data());
      sp[r] = quantize_row(y.data(), cols, qp + r * cols);
    }
  });
  return {q, scale};
}

}  // namespace

// [rows, hidden] float32, [hidden] float32 -> (int8 [rows, hidden], float32 [rows, 1]).
std::tuple<at::Tensor, at::Tensor> rms_norm_quantize(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  const int64_t rows = x.size(0), cols = x.size(1);
  check_weight(weight, cols);
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  return quantize_each_row(x, rows, cols, cols, [&](int64_t r, float* y) {
    rms_norm_row(xp + r * cols, wp, cols, static_cast<float>(eps), y);
  });
}

// [rows, 2 * inter] unscaled gate/up product, [rows, 1] row scales -> (int8 [rows, inter], float32 [rows, 1])
// of silu(gate * s) * (up * s).
std::tuple<at::Tensor, at::Tensor> silu_mul_quantize(const at::Tensor& gate_up, const at::Tensor& row_scale) {
  check_rows(gate_up, "gate_up");
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2;
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "gate_up must have an even number of columns");
  TORCH_CHECK(row_scale.numel() == rows && row_scale.is_contiguous(), "row_scale must be [rows, 1]");
  const float* gp = gate_up.data_ptr<float>();
  const float* rs = row_scale.data_ptr<float>();
  return quantize_each_row(gate_up, rows, inter, 2 * inter, [&](int64_t r, float* y) {
    silu_mul_row(gp + r * 2 * inter, inter, rs[r], y);
  });
}

// [rows, cols] float32 -> (int8 [rows, cols], float32 [rows, 1]).
std::tuple<at::Tensor, at::Tensor> quantize_rows(const at::Tensor& x) {
  check_rows(x, "x");
  const int64_t rows = x.size(0), cols = x.size(1);
  const float* xp = x.data_ptr<float>();
  return quantize_each_row(x, rows, cols, cols, [&](int64_t r, float* y) {
    std::copy(xp + r * cols, xp + (r + 1) * cols, y);
  });
}

// residual + out * row_scale, written into `out` (returned): [rows, cols] float32 each, row_scale [rows, 1].
at::Tensor add_scaled_(const at::Tensor& residual, at::Tensor& out, const at::Tensor& row_scale) {
  check_rows(residual, "residual");
  check_rows(out, "out");
  const int64_t rows = out.size(0), cols = out.size(1);
  TORCH_CHECK(residual.sizes() == out.sizes(), "residual and out must have one shape");
  TORCH_CHECK(row_scale.numel() == rows && row_scale.is_contiguous(), "row_scale must be [rows, 1]");
  const float* hp = residual.data_ptr<float>();
  const float* rs = row_scale.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, grain_rows(cols), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float s = rs[r];
      const Vec vs(s);
      float* o = op + r * cols;
      const float* h = hp + r * cols;
      int64_t i = 0;
      for (; i + Vec::size() <= cols; i += Vec::size()) (Vec::loadu(h + i) + Vec::loadu(o + i) * vs).store(o + i);
      for (; i < cols; ++i) o[i] = h[i] + o[i] * s;
    }
  });
  return out;
}

// [rows, hidden] float32, [hidden] -> [rows, hidden] float32 RMSNorm (the fp32 model's norms).
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  const int64_t rows = x.size(0), cols = x.size(1);
  check_weight(weight, cols);
  auto y = at::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, rows, grain_rows(cols), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) rms_norm_row(xp + r * cols, wp, cols, static_cast<float>(eps), yp + r * cols);
  });
  return y;
}

// [rows, 2 * inter] float32 gate/up -> [rows, inter] silu(gate) * up (the fp32 model's MLP activation).
at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, "gate_up");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "gate_up must have an even number of columns");
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2;
  auto y = at::empty({rows, inter}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, rows, grain_rows(2 * inter), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) silu_mul_row(gp + r * 2 * inter, inter, 1.f, yp + r * inter);
  });
  return y;
}

// block_linear (block_quant.h) with its input made in the same call and a residual added after: prologue 0 takes x
// as it is, 1 its RMSNorm (x [rows, hidden], norm_weight [hidden]: rms_norm's bits), 2 silu(gate) * up (x [rows,
// 2 * inter]: silu_mul's bits), into a per-thread scratch instead of a new tensor; residual ([rows, out_features]
// float32, if given) is added to the product (out + residual: `add_`'s bits). One call instead of two or three at
// batch 1. Raises (c10::Error) on what block_linear, rms_norm or silu_mul refuse, an unknown prologue or a residual
// of another shape.
at::Tensor block_linear_fused(const at::Tensor& x, int64_t prologue, const std::optional<at::Tensor>& norm_weight,
                              double eps, const std::optional<at::Tensor>& residual, const at::Tensor& qs,
                              const at::Tensor& d, const at::Tensor& m, int64_t kind, int64_t out_features,
                              const std::string& path) {
  check_rows(x, "x");
  TORCH_CHECK(prologue >= 0 && prologue <= 2, "block_linear_fused: unknown prologue ", prologue);
  const int64_t rows = x.size(0);
  at::Tensor input = x;
  if (prologue != 0) {
    TORCH_CHECK(prologue == 1 || x.size(1) % 2 == 0, "gate_up must have an even number of columns");
    const int64_t cols = prologue == 1 ? x.size(1) : x.size(1) / 2;
    TORCH_CHECK(prologue == 2 || norm_weight.has_value(), "block_linear_fused: RMSNorm needs its weight");
    if (prologue == 1) check_weight(*norm_weight, cols);
    // a decode step's rows in a per-thread scratch; a prefill chunk's (over 256 K values) in a tensor of its own
    const bool own = rows * cols > (int64_t(1) << 18);
    thread_local std::vector<float> scratch;
    if (!own && static_cast<int64_t>(scratch.size()) < rows * cols) scratch.resize(rows * cols);
    if (own) input = at::empty({rows, cols}, x.options());
    const float* xp = x.data_ptr<float>();
    float* yp = own ? input.data_ptr<float>() : scratch.data();
    if (prologue == 1) {
      const float* wp = norm_weight->data_ptr<float>();
      at::parallel_for(0, rows, grain_rows(cols), [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) rms_norm_row(xp + r * cols, wp, cols, static_cast<float>(eps), yp + r * cols);
      });
    } else {
      at::parallel_for(0, rows, grain_rows(2 * cols), [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) silu_mul_row(xp + r * 2 * cols, cols, 1.f, yp + r * cols);
      });
    }
    if (!own) input = at::from_blob(yp, {rows, cols}, x.options());
  }
  at::Tensor out = block_linear(input, qs, d, m, kind, out_features, path);
  if (residual.has_value()) {
    TORCH_CHECK(residual->scalar_type() == at::kFloat && residual->is_contiguous() && residual->dim() == 2 &&
                    residual->size(0) == rows && residual->size(1) == out_features,
                "block_linear_fused: residual must be a contiguous float32 [", rows, ", ", out_features, "]");
    float* op = out.data_ptr<float>();
    const float* rp = residual->data_ptr<float>();
    at::parallel_for(0, rows, grain_rows(out_features), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) add_row(op + r * out_features, rp + r * out_features, out_features);
    });
  }
  return out;
}

// In place on qkv [rows, cols] float32: y = qkv * row_scale (if given) + bias (if given), then the first `rotated`
// columns, one head of `head_dim` at a time, become y * cos + roll(y, head_dim / 2) * sin (model/llama.py
// `apply_rotary` on the sign-folded tables). cos, sin: rows * head_dim float32, contiguous ([rows, 1, head_dim]).
void scale_bias_rotate_(at::Tensor& qkv, const std::optional<at::Tensor>& row_scale,
                        const std::optional<at::Tensor>& bias, const at::Tensor& cos, const at::Tensor& sin,
                        int64_t rotated) {
  check_rows(qkv, "qkv");
  const int64_t rows = qkv.size(0), cols = qkv.size(1), head_dim = cos.size(-1), half = head_dim / 2;
  TORCH_CHECK(head_dim % 2 == 0 && rotated % head_dim == 0 && rotated <= cols, "rotated must be whole heads");
  for (const at::Tensor* t : {&cos, &sin})
    TORCH_CHECK(t->numel() == rows * head_dim && t->is_contiguous() && t->scalar_type() == at::kFloat,
                "cos and sin must be contiguous float32 [rows, 1, head_dim]");
  if (row_scale) TORCH_CHECK(row_scale->numel() == rows && row_scale->is_contiguous(), "row_scale must be [rows, 1]");
  if (bias) TORCH_CHECK(bias->numel() == cols && bias->is_contiguous(), "bias must be [cols]");
  float* qp = qkv.data_ptr<float>();
  const float* rs = row_scale ? row_scale->data_ptr<float>() : nullptr;
  const float* bp = bias ? bias->data_ptr<float>() : nullptr;
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  at::parallel_for(0, rows, grain_rows(cols), [&](int64_t begin, int64_t end) {
    std::vector<float> head(head_dim);
    for (int64_t r = begin; r < end; ++r) {
      float* row = qp + r * cols;
      if (rs) scale_row(row, cols, rs[r]);
      if (bp) add_row(row, bp, cols);
      const float* c = cp + r * head_dim;
      const float* sn = sp + r * head_dim;
      for (int64_t h = 0; h < rotated / head_dim; ++h) {
        float* x = row + h * head_dim;
        std::copy(x, x + head_dim, head.begin());
        rotate_half(head.data(), head.data() + half, c, sn, half, x);             // first half reads the second
        rotate_half(head.data() + half, head.data(), c + half, sn + half, half, x + half);
      }
    }
  });
}

// Checks a [n, heads, head_dim] float32 tensor whose rows may be strided (a view of the q/k/v product) but whose
// heads are contiguous.
void check_heads(const at::Tensor& x, int64_t n, int64_t row_numel, const char* name) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kFloat && x.size(0) == n && x.size(1) * x.size(2) == row_numel &&
                  x.stride(2) == 1 && x.stride(1) == x.size(2),
              name, " must be float32 [rows, heads, head_dim] with contiguous heads, matching the destination");
}

void check_index(const at::Tensor& index, int64_t n, const char* name) {
  TORCH_CHECK(index.dim() == 1 && index.numel() == n && index.scalar_type() == at::kLong && index.is_contiguous(),
              name, " must be a contiguous int64 [rows] tensor");
}

// Copies row i of `key` and `value` ([rows, heads, head_dim]) to key_dst[i0(i)][i1(i)] and value_dst[...], whose
// rows are `row_numel` elements apart within dimension 1 and `stride0` elements apart within dimension 0. A bfloat16
// destination gets each float rounded to nearest even (c10::BFloat16's conversion, as `.to(torch.bfloat16)`).
template <typename T>
void copy_kv_rows(const at::Tensor& key, const at::Tensor& value, T* key_dst, T* value_dst, const int64_t* i0,
                  int64_t stride0, const int64_t* i1, int64_t row_numel) {
  const int64_t rows = key.size(0);
  const float* kp = key.data_ptr<float>();
  const float* vp = value.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t at = i0[r] * stride0 + i1[r] * row_numel;
    if constexpr (std::is_same_v<T, float>) {
      std::copy_n(kp + r * key.stride(0), row_numel, key_dst + at);
      std::copy_n(vp + r * value.stride(0), row_numel, value_dst + at);
    } else {
      const float* k = kp + r * key.stride(0);
      const float* v = vp + r * value.stride(0);
      for (int64_t j = 0; j < row_numel; ++j) key_dst[at + j] = static_cast<T>(k[j]);
      for (int64_t j = 0; j < row_numel; ++j) value_dst[at + j] = static_cast<T>(v[j]);
    }
  }
}

// The paged KV cache write (model/attention.py `write_kv_cache`): kv_cache [num_blocks, 2, block_size, heads,
// head_dim] float32 or bfloat16 (rounded to nearest even) contiguous gets key[i] at [blocks[i], 0, offsets[i]] and value[i] at [blocks[i], 1, offsets[i]].
// Raises IndexError for a block or offset outside the cache (nothing is written then).
void store_kv_cache_(at::Tensor& kv_cache, const at::Tensor& key, const at::Tensor& value, const at::Tensor& blocks,
                     const at::Tensor& offsets) {
  const bool bf16 = kv_cache.scalar_type() == at::kBFloat16;
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(1) == 2 && (kv_cache.scalar_type() == at::kFloat || bf16) &&
                  kv_cache.is_contiguous(),
              "kv_cache must be a contiguous float32 or bfloat16 [num_blocks, 2, block_size, heads, head_dim] tensor");
  const int64_t rows = key.size(0), num_blocks = kv_cache.size(0), block_size = kv_cache.size(2);
  const int64_t row_numel = kv_cache.size(3) * kv_cache.size(4);
  check_heads(key, rows, row_numel, "key");
  check_heads(value, rows, row_numel, "value");
  check_index(blocks, rows, "blocks");
  check_index(offsets, rows, "offsets");
  const int64_t* bp = blocks.data_ptr<int64_t>();
  const int64_t* op = offsets.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r)
    TORCH_CHECK_INDEX(bp[r] >= 0 && bp[r] < num_blocks && op[r] >= 0 && op[r] < block_size, "slot of row ", r,
                      " (block ", bp[r], ", offset ", op[r], ") is outside the KV cache");
  const int64_t stride0 = 2 * block_size * row_numel;
  if (bf16) {
    c10::BFloat16* base = kv_cache.data_ptr<c10::BFloat16>();
    copy_kv_rows(key, value, base, base + block_size * row_numel, bp, stride0, op, row_numel);
  } else {
    float* base = kv_cache.data_ptr<float>();
    copy_kv_rows(key, value, base, base + block_size * row_numel, bp, stride0, op, row_numel);
  }
}

// The decode K/V mirror write (model/kv_mirror.py): key_dst and value_dst [rows, capacity, heads, head_dim] float32
// contiguous get key[i] and value[i] at [i, positions[i]]. Raises IndexError for a position outside the capacity.
void store_kv_rows_(at::Tensor& key_dst, at::Tensor& value_dst, const at::Tensor& key, const at::Tensor& value,
                    const at::Tensor& positions) {
  for (const at::Tensor* t : {&key_dst, &value_dst})
    TORCH_CHECK(t->dim() == 4 && t->scalar_type() == at::kFloat && t->is_contiguous() && t->sizes() == key_dst.sizes(),
                "key_dst and value_dst must be contiguous float32 [rows, capacity, heads, head_dim] of one shape");
  const int64_t rows = key_dst.size(0), capacity = key_dst.size(1), row_numel = key_dst.size(2) * key_dst.size(3);
  check_heads(key, rows, row_numel, "key");
  check_heads(value, rows, row_numel, "value");
  check_index(positions, rows, "positions");
  const int64_t* pp = positions.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r)
    TORCH_CHECK_INDEX(pp[r] >= 0 && pp[r] < capacity, "position ", pp[r], " of row ", r, " is outside the mirror");
  std::vector<int64_t> row_ids(rows);
  for (int64_t r = 0; r < rows; ++r) row_ids[r] = r;
  copy_kv_rows(key, value, key_dst.data_ptr<float>(), value_dst.data_ptr<float>(), row_ids.data(),
               capacity * row_numel, pp, row_numel);
}

// The index of each row's maximum as torch.max(dim=-1) gives it (ATen's loop: the first index of the largest value;
// a NaN is the largest, the first NaN wins), in two passes over the row instead of its one dependent compare per
// value: the row's maximum by vector max (any NaN seen: the first NaN's index by a scan), then the first index
// holding a value equal to it (+0 and -0 compare equal, as in ATen's `<=`). x [rows, n] float32 contiguous, n >= 1
// -> [rows] int64. The greedy sampler's and the exponential race's token choice over a vocabulary of logits.
static int64_t argmax_row(const float* x, int64_t n) {
  constexpr int64_t W = Vec::size();
  float top = x[0];
  if (n >= W) {
    Vec m = Vec::loadu(x);
    int64_t i = W;
    for (; i + W <= n; i += W) m = at::vec::maximum(m, Vec::loadu(x + i));  // NaN propagates
    float lanes[W];
    m.store(lanes);
    for (int64_t j = 0; j < W; ++j) top = std::isnan(lanes[j]) || std::isnan(top) ? NAN : std::max(top, lanes[j]);
    for (; i < n; ++i) top = std::isnan(x[i]) || std::isnan(top) ? NAN : std::max(top, x[i]);
  } else {
    for (int64_t i = 1; i < n; ++i) top = std::isnan(x[i]) || std::isnan(top) ? NAN : std::max(top, x[i]);
  }
  if (std::isnan(top)) {
    for (int64_t i = 0; i < n; ++i)
      if (std::isnan(x[i])) return i;
  }
  for (int64_t i = 0; i < n; ++i)
    if (x[i] == top) return i;
  return 0;  // not reached: top is one of the row's values
}

at::Tensor argmax_rows(const at::Tensor& x) {
  check_rows(x, "x");
  const int64_t rows = x.size(0), n = x.size(1);
  TORCH_CHECK(n >= 1, "argmax_rows: rows must have at least one value");
  auto out = at::empty({rows}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) op[r] = argmax_row(xp + r * n, n);
  });
  return out;
}

// What the two decode stacks below share: each holds its layers' tensors and ints (a fixed count per layer), the
// final norm and the attention geometry, and runs a layer's attention half with the same calls:
//   scale_bias_rotate_(qkv, row_scale, bias, cos, sin); store_kv_cache_(k, v); paged_decode_attention(q).
class DecodeStackBase {
 public:
  int64_t num_layers() const { return static_cast<int64_t>(ints_.size() / ints_per_layer_); }

 protected:
  // One decode-only step's rotary rows: cos / sin [rows, head_dim] of the tokens' positions.
  struct Rotary {
    at::Tensor cos, sin;
  };

  DecodeStackBase(const char* name, size_t tensors_per_layer, size_t ints_per_layer, std::vector<at::Tensor> tensors,
                  std::vector<int64_t> ints, at::Tensor final_norm, double eps, int64_t head_dim, int64_t q_size,
                  int64_t kv_size, double scale)
      : name_(name), tensors_per_layer_(tensors_per_layer), ints_per_layer_(ints_per_layer),
        tensors_(std::move(tensors)), ints_(std::move(ints)), final_norm_(std::move(final_norm)), eps_(eps),
        head_dim_(head_dim), q_size_(q_size), kv_size_(kv_size), scale_(scale) {
    TORCH_CHECK(!ints_.empty() && tensors_.size() % tensors_per_layer == 0 && ints_.size() % ints_per_layer == 0 &&
                    tensors_.size() / tensors_per_layer == ints_.size() / ints_per_layer,
                name_, ": ", tensors_per_layer, " tensors and ", ints_per_layer, " ints per layer");
    TORCH_CHECK(head_dim > 0 && q_size % head_dim == 0 && kv_size % head_dim == 0, name_, ": head sizes");
  }

  const at::Tensor* layer_tensors(int64_t layer) const { return tensors_.data() + layer * tensors_per_layer_; }
  const int64_t* layer_ints(int64_t layer) const { return ints_.data() + layer * ints_per_layer_; }

  // Checks one KV cache per layer; gathers the rotary rows of `positions` from the model's tables.
  Rotary begin_step(const at::Tensor& positions, const at::Tensor& rope_cos, const at::Tensor& rope_sin,
                    const std::vector<at::Tensor>& kv_caches) const {
    TORCH_CHECK(static_cast<int64_t>(kv_caches.size()) == num_layers(), name_, ": ", num_layers(),
                " KV caches needed, got ", kv_caches.size());
    return {rope_cos.index_select(0, positions), rope_sin.index_select(0, positions)};
  }

  // qkv [rows, q_size + 2 kv_size] (the qkv product; scaled by `row_scale` when given, plus `bias` when not empty,
  // then rotated, in place) -> the attention output [rows, q_size] after storing the rows' K and V in `kv_cache` at
  // their slots (`blocks`, `offsets`); `window` 0 for full attention.
  at::Tensor attend(at::Tensor& qkv, const std::optional<at::Tensor>& row_scale, const at::Tensor& bias,
                    const Rotary& rotary, at::Tensor& kv_cache, const at::Tensor& blocks, const at::Tensor& offsets,
                    const at::Tensor& block_tables, const at::Tensor& seq_lens, int64_t window) const {
    const std::optional<at::Tensor> maybe_bias = bias.numel() ? std::optional<at::Tensor>(bias) : std::nullopt;
    scale_bias_rotate_(qkv, row_scale, maybe_bias, rotary.cos, rotary.sin, q_size_ + kv_size_);
    const std::vector<int64_t> heads{q_size_ / head_dim_, kv_size_ / head_dim_, kv_size_ / head_dim_};
    const auto qkv_heads = qkv.view({qkv.size(0), -1, head_dim_}).split_with_sizes(heads, 1);
    store_kv_cache_(kv_cache, qkv_heads[1], qkv_heads[2], blocks, offsets);
    return paged_decode_attention(qkv_heads[0].contiguous(), kv_cache, block_tables, seq_lens, scale_, window);
  }

  const char* name_;
  size_t tensors_per_layer_, ints_per_layer_;
  std::vector<at::Tensor> tensors_;
  std::vector<int64_t> ints_;
  at::Tensor final_norm_;
  double eps_;
  int64_t head_dim_, q_size_, kv_size_;
  double scale_;
};

// A decode-only step over a stack of block layers at TP=1 in one call (model/llama.py `BlockDecodeStack`): per
// layer the calls `LlamaDecoderLayer._forward_blocks` makes, in the same order on the same inputs, so the same bits:
//   qkv = block_linear_fused(rms_norm(x)); scale_bias_rotate_(qkv, bias, cos, sin); store_kv_cache_(k, v);
//   attn = paged_decode_attention(q); x = o(attn) + x; x = down(silu_mul(gate_up(rms_norm(x)))) + x
// then the final RMSNorm. What it saves is the Python around ~7 calls per layer (about 210 per step), not work.
class BlockDecodeStack : public DecodeStackBase {
 public:
  // Per layer, 15 tensors: input_norm, post_attention_norm, qkv bias (an empty tensor for none), then qs, d, m of
  // qkv, o, gate_up, down (m empty but for Q4_1); 9 ints: the four kinds, the four out_features, the window (0: none).
  BlockDecodeStack(std::vector<at::Tensor> tensors, std::vector<int64_t> ints, at::Tensor final_norm, double eps,
                   int64_t head_dim, int64_t q_size, int64_t kv_size, double scale, std::string path)
      : DecodeStackBase("BlockDecodeStack", kTensors, kInts, std::move(tensors), std::move(ints), std::move(final_norm),
                        eps, head_dim, q_size, kv_size, scale),
        path_(std::move(path)) {}

  // hidden [rows, hidden] float32 (row i: sequence i's one token), positions [rows] int64, rope_cos / rope_sin
  // [max_positions, head_dim] float32 (the model's sign-folded tables), one KV cache per layer, blocks / offsets
  // [rows] int64 (each token's slot), block_tables [rows, max_blocks] int64, seq_lens [rows] int64 -> [rows, hidden]
  // final-normed hidden states. Raises (c10::Error) on what the separate calls refuse.
  at::Tensor forward(const at::Tensor& hidden, const at::Tensor& positions, const at::Tensor& rope_cos,
                     const at::Tensor& rope_sin, std::vector<at::Tensor> kv_caches, const at::Tensor& blocks,
                     const at::Tensor& offsets, const at::Tensor& block_tables, const at::Tensor& seq_lens) {
    const Rotary rotary = begin_step(positions, rope_cos, rope_sin, kv_caches);
    at::Tensor x = hidden.contiguous();
    for (int64_t l = 0; l < num_layers(); ++l) {
      const at::Tensor* t = layer_tensors(l);
      const int64_t* n = layer_ints(l);
      at::Tensor qkv = block_linear_fused(x, 1, t[0], eps_, std::nullopt, t[3], t[4], t[5], n[0], n[4], path_);
      const at::Tensor attn =
          attend(qkv, std::nullopt, t[2], rotary, kv_caches[l], blocks, offsets, block_tables, seq_lens, n[8]);
      x = block_linear_fused(attn, 0, std::nullopt, 0.0, x, t[6], t[7], t[8], n[1], n[5], path_);
      const at::Tensor gate_up = block_linear_fused(x, 1, t[1], eps_, std::nullopt, t[9], t[10], t[11], n[2], n[6], path_);
      x = block_linear_fused(gate_up, 2, std::nullopt, 0.0, x, t[12], t[13], t[14], n[3], n[7], path_);
    }
    return rms_norm(x, final_norm_, eps_);
  }

 private:
  static constexpr size_t kTensors = 15, kInts = 9;
  std::string path_;
};

// A decode-only step over a stack of int8 layers at TP=1 in one call (model/llama.py `Int8DecodeStack`): per layer
// the calls `LlamaDecoderLayer._forward_fused_int8` makes, in the same order on the same inputs, so the same bits:
//   qx, s = rms_norm_quantize(x); qkv = product(qx); scale_bias_rotate_(qkv, s, bias, cos, sin); store_kv_cache_(k, v);
//   attn = paged_decode_attention(q); qx, s = quantize_rows(attn); x = add_scaled_(x, o(qx), s);
//   qx, s = rms_norm_quantize(x); qx, s = silu_mul_quantize(gate_up(qx), s); x = add_scaled_(x, down(qx), s)
// then the final RMSNorm. A product runs the kernel the weight's choice names for this step's rows: VNNI (packed,
// correction, scale) or AVX2 (packed, an empty tensor, scale); the stack is built per row class (`model/llama.py`).
// What it saves is the Python around ~11 calls per layer, not work.
class Int8DecodeStack : public DecodeStackBase {
 public:
  static constexpr int64_t kVnni = 0, kAvx2 = 1;

  // Per layer, 15 tensors: input_norm, post_attention_norm, qkv bias (an empty tensor for none), then packed,
  // correction (empty for AVX2) and scale of qkv, o, gate_up and down; 13 ints: the four kernels (kVnni, kAvx2), the
  // four in_features, the four out_features, the window (0: none).
  Int8DecodeStack(std::vector<at::Tensor> tensors, std::vector<int64_t> ints, at::Tensor final_norm, double eps,
                  int64_t head_dim, int64_t q_size, int64_t kv_size, double scale)
      : DecodeStackBase("Int8DecodeStack", kTensors, kInts, std::move(tensors), std::move(ints), std::move(final_norm),
                        eps, head_dim, q_size, kv_size, scale) {
    for (int64_t l = 0; l < num_layers(); ++l)
      for (int64_t w = 0; w < 4; ++w) {
        const int64_t kernel = layer_ints(l)[w];
        TORCH_CHECK(kernel == kVnni || kernel == kAvx2, "Int8DecodeStack: kernel ", kernel, " of layer ", l);
        TORCH_CHECK(kernel != kVnni || int8_vnni_available(), "Int8DecodeStack: this build has no VNNI product");
        TORCH_CHECK(kernel != kAvx2 || int8_avx2_available(), "Int8DecodeStack: this build has no AVX2 product");
      }
  }

  // Arguments, result and errors as BlockDecodeStack::forward's.
  at::Tensor forward(const at::Tensor& hidden, const at::Tensor& positions, const at::Tensor& rope_cos,
                     const at::Tensor& rope_sin, std::vector<at::Tensor> kv_caches, const at::Tensor& blocks,
                     const at::Tensor& offsets, const at::Tensor& block_tables, const at::Tensor& seq_lens) {
    const Rotary rotary = begin_step(positions, rope_cos, rope_sin, kv_caches);
    at::Tensor x = hidden.contiguous();
    for (int64_t l = 0; l < num_layers(); ++l) {
      const at::Tensor* t = layer_tensors(l);
      const int64_t* n = layer_ints(l);
      auto [qx, row_scale] = rms_norm_quantize(x, t[0], eps_);
      at::Tensor qkv = product(qx, t + 3, n, 0);
      const at::Tensor attn =
          attend(qkv, row_scale, t[2], rotary, kv_caches[l], blocks, offsets, block_tables, seq_lens, n[12]);
      std::tie(qx, row_scale) = quantize_rows(attn.contiguous());
      at::Tensor o = product(qx, t + 6, n, 1);
      x = add_scaled_(x, o, row_scale);
      std::tie(qx, row_scale) = rms_norm_quantize(x, t[1], eps_);
      std::tie(qx, row_scale) = silu_mul_quantize(product(qx, t + 9, n, 2), row_scale);
      at::Tensor down = product(qx, t + 12, n, 3);
      x = add_scaled_(x, down, row_scale);
    }
    return rms_norm(x, final_norm_, eps_);
  }

 private:
  static constexpr size_t kTensors = 15, kInts = 13;

  // Weight `w` (0 qkv, 1 o, 2 gate_up, 3 down) of a layer: `t` its packed, correction, scale; `n` the layer's ints.
  static at::Tensor product(const at::Tensor& qx, const at::Tensor* t, const int64_t* n, int w) {
    if (n[w] == kVnni) return int8_gemm_vnni(qx, t[0], t[1], t[2], n[4 + w], n[8 + w]);
    return int8_gemm_avx2(qx, t[0], t[2], n[4 + w], n[8 + w]);
  }
};

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm_quantize", &rms_norm_quantize);
  m.def("silu_mul_quantize", &silu_mul_quantize);
  m.def("quantize_rows", &quantize_rows);
  m.def("add_scaled_", &add_scaled_);
  m.def("rms_norm", &rms_norm);
  m.def("silu_mul", &silu_mul);
  m.def("scale_bias_rotate_", &scale_bias_rotate_);
  m.def("store_kv_cache_", &store_kv_cache_);
  m.def("store_kv_rows_", &store_kv_rows_);
  m.def("has_packed_sgemm", &has_packed_sgemm);
  m.def("sgemm_pack", &sgemm_pack);
  m.def("sgemm_packed", &sgemm_packed);
  m.def("paged_decode_attention", &paged_decode_attention);
  m.def("paged_prefill_attention_available", &paged_prefill_attention_available);
  m.def("paged_prefill_attention_bf16_dot", &paged_prefill_attention_bf16_dot);
  m.def("paged_prefill_attention_", &paged_prefill_attention_);
  m.def("block_quant_paths", &block_quant_paths);
  m.def("block_quant_amx_status", &block_quant_amx_status);
  m.def("block_quantize_rows", &block_quantize_rows);
  m.def("block_linear_fused", &block_linear_fused);
  m.def("block_linear", &block_linear);
  m.def("argmax_rows", &argmax_rows);
  m.def("block_dequantize_columns", &block_dequantize_columns);
  m.def("int8_avx2_available", &int8_avx2_available);
  m.def("int8_pack_avx2", &int8_pack_avx2);
  m.def("int8_gemm_avx2", &int8_gemm_avx2);
  m.def("int8_vnni_available", &int8_vnni_available);
  m.def("int8_pack_vnni", &int8_pack_vnni);
  m.def("int8_gemm_vnni", &int8_gemm_vnni);
  m.def("fp32_gemv_available", &fp32_gemv_available);
  m.def("fp32_gemv", &fp32_gemv);
  pybind11::class_<BlockDecodeStack>(m, "BlockDecodeStack")
      .def(pybind11::init<std::vector<at::Tensor>, std::vector<int64_t>, at::Tensor, double, int64_t, int64_t, int64_t,
                          double, std::string>())
      .def("num_layers", &BlockDecodeStack::num_layers)
      .def("forward", &BlockDecodeStack::forward);
  pybind11::class_<Int8DecodeStack>(m, "Int8DecodeStack")
      .def(pybind11::init<std::vector<at::Tensor>, std::vector<int64_t>, at::Tensor, double, int64_t, int64_t, int64_t,
                          double>())
      .def("num_layers", &Int8DecodeStack::num_layers)
      .def("forward", &Int8DecodeStack::forward);
}
