// Decode attention straight from the paged KV cache (asyncllm/model/layers/attention.py `_decode_attention`).
//
// Each sequence has one query token (its newest, already written to the cache). For every (sequence, K/V head) the
// kernel walks the sequence's block table once for the keys and once for the values: scores q.k * scale for the
// query heads that share the K/V head (grouped-query attention, HF's `repeat_kv` order: query head h reads K/V head
// h / (num_heads / num_kv_heads)), an exact softmax (max subtracted, ATen's vectorized exp), then the weighted sum of
// the values. Nothing is gathered into a dense copy first, which is what the torch path does per layer and step.
// With `window` > 0 a query sees only the last `window` tokens (itself included), as sliding-window layers do.
//
// The cache holds float32 or bfloat16 (`EngineArgs.kv_cache_dtype`): bfloat16 rows are widened to float32 in registers
// as they are loaded (exact: a bfloat16 is the top half of a float32), so the arithmetic is the same either way and a
// bfloat16 cache reads half the bytes.
//
// Float32 arithmetic throughout, in a fixed order per (sequence, head): a sequence's output does not depend on its batch or on
// the thread count. Not bit-exact with torch's SDPA (another summation order): row_kernels.py checks it against
// SDPA at start-up with a tolerance.
//
// Sources: scaled dot-product attention (Vaswani et al., 2017); paged KV cache (Kwon et al., 2023, vLLM);
// grouped-query attention (Ainslie et al., 2023).
#include "vec_capability.h"

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "paged_attention.h"

namespace {

using Vec = at::vec::Vectorized<float>;
using BF16 = c10::BFloat16;

// Vec::size() cache elements from p, as float32.
inline Vec load(const float* p) { return Vec::loadu(p); }

inline Vec load(const BF16* p) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return Vec(_mm512_castsi512_ps(_mm512_slli_epi32(wide, 16)));
#elif defined(CPU_CAPABILITY_AVX2)
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return Vec(_mm256_castsi256_ps(_mm256_slli_epi32(wide, 16)));
#else
  float lanes[Vec::size()];
  for (int64_t j = 0; j < Vec::size(); ++j) lanes[j] = static_cast<float>(p[j]);
  return Vec::loadu(lanes);
#endif
}

// The sum of a vector's lanes.
inline float hsum(const Vec& v) {
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_reduce_add_ps(v);
#else
  float lanes[Vec::size()];
  v.store(lanes);
  float sum = 0.f;
  for (int64_t j = 0; j < Vec::size(); ++j) sum += lanes[j];
  return sum;
#endif
}

#if defined(CPU_CAPABILITY_AVX512)
// Lane j of the result = the sum of v[j]'s 16 lanes: pairs of vectors are folded within 128-bit lanes (unpack,
// then shuffle), then across them (shuffle_f32x4), 15 adds for 16 sums.
inline __m512 reduce16(const __m512* v) {
  __m512 x[8], y[4], z[2];
  for (int i = 0; i < 8; ++i)
    x[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)
    y[i] = _mm512_add_ps(_mm512_shuffle_ps(x[2 * i], x[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(x[2 * i], x[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int i = 0; i < 2; ++i)
    z[i] = _mm512_add_ps(_mm512_shuffle_f32x4(y[2 * i], y[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(y[2 * i], y[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(z[0], z[1], 0x88), _mm512_shuffle_f32x4(z[0], z[1], 0xDD));
}
#endif

struct Layout {
  int64_t block_size, num_kv_heads, head_dim, per_kv, max_blocks;
  int64_t token_stride() const { return num_kv_heads * head_dim; }
  int64_t block_stride() const { return 2 * block_size * token_stride(); }  // [2, block_size, kv_heads, head_dim]
  // Elements from a block's start to token t's row (of the K/V head the caller's base pointer is at).
  int64_t offset(const int64_t* table, int64_t t) const {
    return table[t / block_size] * block_stride() + (t % block_size) * token_stride();
  }
};

// The score pass and the value pass for one (sequence, K/V head), with NV vectors per head row held in registers
// (head_dim == NV * Vec::size()); T is the cache's element type (float or BF16).
template <int NV, typename T>
struct HeadKernel {
  // scores[h * n + (t - first)] = q_h . k_t * scale for t in [first, last).
  static void scores(const float* q, const T* keys, const int64_t* table, int64_t first, int64_t last,
                     const Layout& l, float scale, float* scores) {
    const int64_t n = last - first;
    for (int64_t h = 0; h < l.per_kv; ++h) {
      Vec qv[NV];
      for (int i = 0; i < NV; ++i) qv[i] = Vec::loadu(q + h * l.head_dim + i * Vec::size());
      float* out = scores + h * n - first;
#if defined(CPU_CAPABILITY_AVX512)
      // 16 tokens at a time, their 16 partial vectors summed lane-wise by one transposing reduction
      for (int64_t t = first; t < last; t += 16) {
        const int64_t count = std::min<int64_t>(16, last - t);
        __m512 partial[16];
        for (int64_t j = 0; j < 16; ++j) {
          if (j >= count) {
            partial[j] = _mm512_setzero_ps();
            continue;
          }
          const T* k = keys + l.offset(table, t + j);
          Vec acc = qv[0] * load(k);
          for (int i = 1; i < NV; ++i) acc = at::vec::fmadd(qv[i], load(k + i * Vec::size()), acc);
          partial[j] = acc;
        }
        const __m512 sums = _mm512_mul_ps(reduce16(partial), _mm512_set1_ps(scale));
        _mm512_mask_storeu_ps(out + t, static_cast<__mmask16>((1u << count) - 1), sums);
      }
#else
      for (int64_t t = first; t < last; ++t) {
        const T* k = keys + l.offset(table, t);
        Vec acc = qv[0] * load(k);
        for (int i = 1; i < NV; ++i) acc = at::vec::fmadd(qv[i], load(k + i * Vec::size()), acc);
        out[t] = hsum(acc) * scale;
      }
#endif
    }
  }

  // out[h] = sum_t p[h][t] * v_t * inv[h].
  static void values(const float* p, const T* values, const int64_t* table, int64_t first, int64_t last,
                     const Layout& l, const float* inv, float* out) {
    const int64_t n = last - first;
    for (int64_t h = 0; h < l.per_kv; ++h) {
      Vec acc[NV];
      for (int i = 0; i < NV; ++i) acc[i] = Vec(0.f);
      const float* ph = p + h * n - first;
      for (int64_t t = first; t < last; ++t) {
        const T* v = values + l.offset(table, t);
        const Vec pv(ph[t]);
        for (int i = 0; i < NV; ++i) acc[i] = at::vec::fmadd(load(v + i * Vec::size()), pv, acc[i]);
      }
      const Vec vinv(inv[h]);
      for (int i = 0; i < NV; ++i) (acc[i] * vinv).store(out + h * l.head_dim + i * Vec::size());
    }
  }
};

// In place: s[i] = exp(s[i] - max); returns the sum.
float exp_shifted(float* s, int64_t n, float max) {
  const Vec vmax(max);
  Vec vsum(0.f);
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) {
    const Vec e = (Vec::loadu(s + i) - vmax).exp();
    e.store(s + i);
    vsum = vsum + e;
  }
  float sum = hsum(vsum);
  for (; i < n; ++i) {
    s[i] = std::exp(s[i] - max);
    sum += s[i];
  }
  return sum;
}

template <int NV, typename T>
void attend(const float* q, const T* cache, const int64_t* table, int64_t first, int64_t last, const Layout& l,
            int64_t kv_head, float scale, std::vector<float>& scores, float* out) {
  const int64_t n = last - first;
  scores.resize(l.per_kv * n);
  const T* keys = cache + kv_head * l.head_dim;
  HeadKernel<NV, T>::scores(q, keys, table, first, last, l, scale, scores.data());
  std::vector<float> inv(l.per_kv);
  for (int64_t h = 0; h < l.per_kv; ++h) {
    float* s = scores.data() + h * n;
    inv[h] = 1.f / exp_shifted(s, n, *std::max_element(s, s + n));
  }
  const T* values = keys + l.block_size * l.token_stride();  // index 1 of each block: the values
  HeadKernel<NV, T>::values(scores.data(), values, table, first, last, l, inv.data(), out);
}

template <typename T>
using AttendFn = void (*)(const float*, const T*, const int64_t*, int64_t, int64_t, const Layout&, int64_t, float,
                          std::vector<float>&, float*);

// The instance for head_dim, or nullptr if head_dim is not 1, 2, 4, 8 or 16 vectors wide.
template <typename T>
AttendFn<T> attend_for(int64_t head_dim) {
  if (head_dim % Vec::size() != 0) return nullptr;
  switch (head_dim / Vec::size()) {
    case 1: return attend<1, T>;
    case 2: return attend<2, T>;
    case 4: return attend<4, T>;
    case 8: return attend<8, T>;
    case 16: return attend<16, T>;
    default: return nullptr;
  }
}

// All (sequence, K/V head) tasks of one call, on a cache of element type T.
template <typename T>
void attend_all(const float* qp, const T* cache, const int64_t* tables, const int64_t* lens, const Layout& l,
                int64_t num_seqs, int64_t num_heads, int64_t window, float scale, float* op) {
  const AttendFn<T> attend_one = attend_for<T>(l.head_dim);
  TORCH_CHECK(attend_one != nullptr, "head_dim ", l.head_dim, " is not 1, 2, 4, 8 or 16 vectors of ", Vec::size(),
              " floats");
  const int64_t num_kv_heads = l.num_kv_heads;
  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / num_kv_heads, kv_head = task % num_kv_heads;
      const int64_t last = lens[s], first = window > 0 ? std::max<int64_t>(0, last - window) : 0;
      const int64_t head0 = kv_head * l.per_kv;
      attend_one(qp + (s * num_heads + head0) * l.head_dim, cache, tables + s * l.max_blocks, first, last, l, kv_head,
                 scale, scores, op + (s * num_heads + head0) * l.head_dim);
    }
  });
}

}  // namespace

// query [num_seqs, num_heads, head_dim] float32 contiguous; kv_cache [num_blocks, 2, block_size, num_kv_heads,
// head_dim] float32 or bfloat16 contiguous; block_tables [num_seqs, max_blocks] int64 contiguous; seq_lens [num_seqs] int64
// (tokens in the cache, the query's own included; >= 1). Returns [num_seqs, num_heads * head_dim] float32.
// Raises RuntimeError on a wrong dtype, shape or layout, IndexError on a block id outside the cache or a sequence
// longer than its table.
at::Tensor paged_decode_attention(const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& block_tables,
                                  const at::Tensor& seq_lens, double scale, int64_t window) {
  TORCH_CHECK(query.dim() == 3 && query.scalar_type() == at::kFloat && query.is_contiguous(),
              "query must be a contiguous float32 [num_seqs, num_heads, head_dim] tensor");
  const bool bf16 = kv_cache.scalar_type() == at::kBFloat16;
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(1) == 2 && (kv_cache.scalar_type() == at::kFloat || bf16) &&
                  kv_cache.is_contiguous(),
              "kv_cache must be a contiguous float32 or bfloat16 [num_blocks, 2, block_size, num_kv_heads, head_dim] "
              "tensor");
  const int64_t num_seqs = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t num_blocks = kv_cache.size(0), num_kv_heads = kv_cache.size(3);
  TORCH_CHECK(kv_cache.size(4) == head_dim && num_kv_heads > 0 && num_heads % num_kv_heads == 0,
              "query heads must be a multiple of the cache's K/V heads, with the same head_dim");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == num_seqs && block_tables.scalar_type() == at::kLong &&
                  block_tables.is_contiguous(),
              "block_tables must be a contiguous int64 [num_seqs, max_blocks] tensor");
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.numel() == num_seqs && seq_lens.scalar_type() == at::kLong &&
                  seq_lens.is_contiguous(),
              "seq_lens must be a contiguous int64 [num_seqs] tensor");
  const Layout l{kv_cache.size(2), num_kv_heads, head_dim, num_heads / num_kv_heads, block_tables.size(1)};
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  for (int64_t s = 0; s < num_seqs; ++s) {
    TORCH_CHECK_INDEX(lens[s] >= 1 && lens[s] <= l.max_blocks * l.block_size, "sequence ", s, " has ", lens[s],
                      " tokens; its block table holds ", l.max_blocks * l.block_size);
    const int64_t used = (lens[s] + l.block_size - 1) / l.block_size;
    for (int64_t b = 0; b < used; ++b)
      TORCH_CHECK_INDEX(tables[s * l.max_blocks + b] >= 0 && tables[s * l.max_blocks + b] < num_blocks, "block ",
                        tables[s * l.max_blocks + b], " of sequence ", s, " is outside the KV cache");
  }
  at::Tensor out = at::empty({num_seqs, num_heads * head_dim}, query.options());
  const float scale_f = static_cast<float>(scale);
  if (bf16)
    attend_all(query.data_ptr<float>(), kv_cache.data_ptr<BF16>(), tables, lens, l, num_seqs, num_heads, window,
               scale_f, out.data_ptr<float>());
  else
    attend_all(query.data_ptr<float>(), kv_cache.data_ptr<float>(), tables, lens, l, num_seqs, num_heads, window,
               scale_f, out.data_ptr<float>());
  return out;
}
