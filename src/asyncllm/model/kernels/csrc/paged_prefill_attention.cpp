// Prefill attention straight from the paged KV cache (asyncllm/model/layers/prefill_attention.py).
//
// A prefill chunk of Q query tokens at positions P .. P + Q - 1 (P tokens cached before the chunk) attends every key
// up to its own position; this step's keys and values are already in the cache. The kernel computes it the way flash
// attention does (scores of a tile of keys, an online softmax that rescales what was summed so far when the running
// maximum grows, then the tile's weighted values), reading the keys and values through the block table: nothing is
// gathered into a dense copy, and the cached prefix and the chunk's own keys are one pass, not two merged calls.
//
// The layout is chosen so that no step needs a sum across vector lanes. A task is Vec::size() query rows of one
// (sequence, K/V head); a row is a (token, query head) pair of that head's grouped-query-attention group, so the
// group's heads share every key and value load. The task keeps its queries transposed, `qt[d][row]`, and its output
// the same way, `ot[d][row]`. A tile's scores are then `s[key][row] = sum_d qt[d] * k[key][d]`: one vector per key,
// a fused multiply-add per (key, d) with the key's element broadcast. The softmax's running maximum and sum are
// per-row vectors, updated with lane-wise max, exp and add; the values pass is `ot[d] += p[key] * v[key][d]`, again
// broadcasts. A key after a row's position (the causal mask: only on the tiles that cross the chunk's diagonal)
// gets the score -inf, so its weight is exactly 0; so does a key before a row's sliding window (`window` > 0: a row
// sees the last `window` tokens, itself included).
//
// Float32 arithmetic throughout, with ATen's `exp_u20` (the exponential its own CPU flash-attention kernel uses).
// Each row's result depends only on its sequence: not on the batch, on the other rows of its task, or on the thread
// count. Not bit-exact with SDPA (another summation order and exponential): row_kernels.py checks it against SDPA
// at start-up with a tolerance.
//
// A bfloat16 cache on a CPU with AVX512_BF16 (and head_dim a multiple of 32) takes bfloat16 products instead, as
// SDPA in bfloat16 does: the queries (times the scale) and each tile's softmax weights are rounded to bfloat16
// (nearest even) and multiplied with the cached keys and values by `vdpbf16ps`, two products per instruction, summed
// in float32. The softmax itself (max, exp, sums) stays float32; the sum of weights is taken over the rounded
// weights, so a row's output is a convex combination of its values. Each product pairs two elements: queries are
// held as (d, d + 1) pairs per row, `qp[d / 2][row]`, and a tile's weights and values as (key, key + 1) pairs. The
// error against float32 arithmetic is about 2^-8 of the values' largest magnitude (BF16_DOT_TOLERANCE in
// attention_checks.py); elsewhere a bfloat16 cache is widened to float32 and the arithmetic is the float32 cache's.
//
// Sources: flash attention's online softmax (Dao et al., 2022; Milakov & Gimelshein, 2018); paged KV cache (Kwon et
// al., 2023, vLLM); grouped-query attention (Ainslie et al., 2023).
#include "vec_capability.h"

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "paged_kv_checks.h"
#include "paged_prefill_attention.h"

namespace {

using Vec = at::vec::Vectorized<float>;
using BF16 = c10::BFloat16;
constexpr int64_t W = Vec::size();         // query rows per task
constexpr int kKeys = W >= 16 ? 16 : 8;    // keys per tile: one score vector each, all in registers
constexpr int kValueColumns = W >= 16 ? 8 : 4;  // output columns per pass over a tile's values (registers: kKeys + this)

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
#define ASYNCLLM_BF16_DOT
#endif

inline float widen(float x) { return x; }
inline float widen(BF16 x) { return static_cast<float>(x); }

struct Shape {
  int64_t block_size, num_kv_heads, head_dim, per_kv, max_blocks, num_heads;
  int64_t token_stride() const { return num_kv_heads * head_dim; }
  int64_t block_stride() const { return 2 * block_size * token_stride(); }
  int64_t value_offset() const { return block_size * token_stride(); }
};

// One task: query rows [row0, row0 + W) of K/V head g of one sequence; row r is the chunk's token r / per_kv at
// query head g * per_kv + r % per_kv.
struct Task {
  int64_t seq, g, row0, last_key;  // last_key: the position of the task's last row (its keys are 0 .. last_key)
};

struct SeqSpan {
  int64_t query_start, query_len, seq_len;
};

// The task's per-thread state: transposed queries (times the softmax scale), transposed output sums, each row's
// position (as float: the mask compares lanes).
struct Scratch {
  std::vector<float> qt, ot;
#if defined(ASYNCLLM_BF16_DOT)
  std::vector<uint32_t> qp;      // bfloat16 queries in (d, d + 1) pairs per row: [head_dim / 2][W]
  std::vector<uint32_t> vpairs;  // a tile's values in (key, key + 1) pairs per column: [kKeys / 2][head_dim]
  std::vector<BF16> zeros;       // [head_dim]: the key and value row of a tile's missing keys
#endif
};

// Scores of one tile: s[k][row] = sum_d qt[d][row] * key_k[d], for `count` keys (count == kKeys unless FULL is false).
template <bool FULL, typename T>
inline void tile_scores(const float* qt, const T* const* keys, int count, int64_t head_dim, Vec* s) {
  for (int k = 0; k < kKeys; ++k) s[k] = Vec(0.f);
  for (int64_t d = 0; d < head_dim; ++d) {
    const Vec qd = Vec::loadu(qt + d * W);
    if (FULL) {
#pragma GCC unroll 16
      for (int k = 0; k < kKeys; ++k) s[k] = at::vec::fmadd(qd, Vec(widen(keys[k][d])), s[k]);
    } else {
      for (int k = 0; k < count; ++k) s[k] = at::vec::fmadd(qd, Vec(widen(keys[k][d])), s[k]);
    }
  }
}

// ot[d] = ot[d] * alpha + sum_k p[k] * value_k[d] for every column d, kValueColumns at a time.
template <bool FULL, typename T>
inline void tile_values(const Vec* p, const T* const* values, int count, int64_t head_dim, const Vec& alpha,
                        float* ot) {
  for (int64_t d0 = 0; d0 < head_dim; d0 += kValueColumns) {
    Vec acc[kValueColumns];
    for (int i = 0; i < kValueColumns; ++i) acc[i] = Vec::loadu(ot + (d0 + i) * W) * alpha;
    const int n = FULL ? kKeys : count;
    for (int k = 0; k < n; ++k) {
      const T* v = values[k] + d0;
#pragma GCC unroll 8
      for (int i = 0; i < kValueColumns; ++i) acc[i] = at::vec::fmadd(p[k], Vec(widen(v[i])), acc[i]);
    }
    for (int i = 0; i < kValueColumns; ++i) acc[i].store(ot + (d0 + i) * W);
  }
}

// Row j of a task: the chunk's token r / per_kv at query head g * per_kv + r % per_kv (r = row0 + j).
struct TaskRow {
  int64_t token, head;
  TaskRow(const Task& task, int64_t j, int64_t per_kv)
      : token((task.row0 + j) / per_kv), head(task.g * per_kv + (task.row0 + j) % per_kv) {}
};

// The task's query rows (rows of them, at most W) handed to `take(j, q)` one at a time (q: the row's head_dim
// query elements), and each lane's position in `pos` (padding lanes repeat the last row's; they are never written
// out).
template <typename Take>
inline void load_rows(const Task& task, const SeqSpan& span, const float* query, const Shape& sh, int64_t rows,
                      float* pos, Take take) {
  const int64_t prefix = span.seq_len - span.query_len;
  for (int64_t j = 0; j < W; ++j) {
    const TaskRow row(task, std::min(j, rows - 1), sh.per_kv);
    pos[j] = static_cast<float>(prefix + row.token);
    if (j < rows) take(j, query + ((span.query_start + row.token) * sh.num_heads + row.head) * sh.head_dim);
  }
}

// out's rows of the task = the transposed sums ot[d][row] divided by each row's sum of weights.
inline void store_rows(const Task& task, const SeqSpan& span, const Shape& sh, int64_t rows, const float* ot,
                       const Vec& sum, float* out) {
  float inv[W];
  (Vec(1.f) / sum).store(inv);
  for (int64_t j = 0; j < rows; ++j) {
    const TaskRow row(task, j, sh.per_kv);
    float* o = out + ((span.query_start + row.token) * sh.num_heads + row.head) * sh.head_dim;
    for (int64_t d = 0; d < sh.head_dim; ++d) o[d] = ot[d * W + j] * inv[j];
  }
}

// Which keys a task's rows see: the causal mask (a key after a row's position) and the window (a key at or before
// the row's position - window), as lane-wise compares against each row's position.
struct TaskMasks {
  Vec position;    // each row's position (padding lanes repeat the last row's)
  Vec window_end;  // a key at or before this is outside a row's window
  int64_t first_key;     // the first key any row sees (0 without a window)
  int64_t first_masked;  // from this key on, some row of the task is causally masked
  int64_t all_see;       // from this key on, every row sees every key up to its own position

  TaskMasks(const Task& task, const float* pos, int64_t prefix, int64_t per_kv, int64_t window)
      : position(Vec::loadu(pos)), window_end(position - Vec(static_cast<float>(window))) {
    const int64_t first_pos = prefix + task.row0 / per_kv;  // of the task's first row
    first_masked = first_pos + 1;
    first_key = window > 0 ? std::max<int64_t>(0, first_pos - window + 1) : 0;
    all_see = window > 0 ? task.last_key - window + 1 : 0;
  }

  // Scores s[0 .. count) of keys t0 .. t0 + count - 1 set to -inf where a row does not see the key; returns the
  // tile's maximum per row.
  Vec mask(Vec* s, int count, int64_t t0) const {
    const Vec minus_inf(-std::numeric_limits<float>::infinity());
    if (t0 + count > first_masked)
      for (int k = 0; k < count; ++k)
        s[k] = Vec::blendv(s[k], minus_inf, position < Vec(static_cast<float>(t0 + k)));
    if (t0 < all_see)
      for (int k = 0; k < count; ++k)
        s[k] = Vec::blendv(s[k], minus_inf, Vec(static_cast<float>(t0 + k)) <= window_end);
    Vec tile_max = s[0];
    for (int k = 1; k < count; ++k) tile_max = at::vec::maximum(tile_max, s[k]);
    return tile_max;
  }
};

// keys[k] and values[k]: K/V head `g`'s rows of cached tokens t0 .. t0 + count - 1, read through the block table
// (one division per tile).
template <typename T>
inline void tile_rows(const T* cache, const int64_t* table, const Shape& sh, int64_t g, int64_t t0, int count,
                      const T** keys, const T** values) {
  int64_t block = t0 / sh.block_size, offset = t0 % sh.block_size;
  for (int k = 0; k < count; ++k) {
    const T* row = cache + table[block] * sh.block_stride() + offset * sh.token_stride() + g * sh.head_dim;
    keys[k] = row;
    values[k] = row + sh.value_offset();
    if (++offset == sh.block_size) {
      offset = 0;
      ++block;
    }
  }
}

template <typename T>
void run_task(const Task& task, const SeqSpan& span, const float* query, const T* cache, const int64_t* table,
              const Shape& sh, float scale, int64_t window, Scratch& scratch, float* out) {
  const int64_t hd = sh.head_dim, per_kv = sh.per_kv, prefix = span.seq_len - span.query_len;
  const int64_t rows = std::min<int64_t>(W, span.query_len * per_kv - task.row0);
  scratch.qt.assign(hd * W, 0.f);
  scratch.ot.assign(hd * W, 0.f);
  float* qt = scratch.qt.data();
  float* ot = scratch.ot.data();
  float pos[W];
  load_rows(task, span, query, sh, rows, pos, [&](int64_t j, const float* q) {
    for (int64_t d = 0; d < hd; ++d) qt[d * W + j] = q[d] * scale;
  });
  const TaskMasks masks(task, pos, prefix, per_kv, window);
  // The running maximum starts finite, so a tile whose keys are all masked for a row (a window not reached yet)
  // leaves that row's sums as they are instead of computing exp(-inf - -inf).
  Vec m(-1e30f), sum(0.f);
  const T* keys[kKeys];
  const T* values[kKeys];
  for (int64_t t0 = masks.first_key; t0 <= task.last_key; t0 += kKeys) {
    const int count = static_cast<int>(std::min<int64_t>(kKeys, task.last_key + 1 - t0));
    tile_rows(cache, table, sh, task.g, t0, count, keys, values);
    Vec s[kKeys];
    if (count == kKeys)
      tile_scores<true>(qt, keys, count, hd, s);
    else
      tile_scores<false>(qt, keys, count, hd, s);
    const Vec m_new = at::vec::maximum(m, masks.mask(s, count, t0));
    const Vec alpha = (m - m_new).exp_u20();
    Vec tile_sum(0.f);
    for (int k = 0; k < count; ++k) {
      s[k] = (s[k] - m_new).exp_u20();
      tile_sum = tile_sum + s[k];
    }
    sum = sum * alpha + tile_sum;
    m = m_new;
    if (count == kKeys)
      tile_values<true>(s, values, count, hd, alpha, ot);
    else
      tile_values<false>(s, values, count, hd, alpha, ot);
  }
  store_rows(task, span, sh, rows, ot, sum, out);
}

#if defined(ASYNCLLM_BF16_DOT)
// Lanes 0-15 (widen_low) or 16-31 (widen_high) of 32 bfloat16, as float32 (exact).
inline __m512 widen_low(__m512bh x) {
  const __m256i half = _mm512_castsi512_si256(reinterpret_cast<__m512i>(x));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}
inline __m512 widen_high(__m512bh x) {
  const __m256i half = _mm512_extracti64x4_epi64(reinterpret_cast<__m512i>(x), 1);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

// Two bfloat16 from p (a K or V row), as the one 32-bit word `vdpbf16ps` pairs with a (d, d + 1) query pair.
inline __m512bh broadcast_pair(const BF16* p) {
  uint32_t word;
  std::memcpy(&word, p, sizeof(word));
  return reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(word)));
}

constexpr int kPairs = kKeys / 2;  // (key, key + 1) pairs per tile

// Scores of one tile: acc[k][row] = sum over pairs (d, d + 1) of the row's two bfloat16 query elements (qp) times
// key k's two, in float32.
inline void bf16_tile_scores(const uint32_t* qp, const BF16* const* keys, int64_t head_dim, __m512* acc) {
  for (int k = 0; k < kKeys; ++k) acc[k] = _mm512_setzero_ps();
  for (int64_t d = 0; d < head_dim; d += 2) {
    const __m512bh qd = reinterpret_cast<__m512bh>(_mm512_loadu_si512(qp + d / 2 * W));
#pragma GCC unroll 16
    for (int k = 0; k < kKeys; ++k) acc[k] = _mm512_dpbf16_ps(acc[k], qd, broadcast_pair(keys[k] + d));
  }
}

// vpairs[k / 2][c] = (values[k][c], values[k + 1][c]) for every even k of the tile and column c (head_dim a multiple
// of 32).
inline void pair_values(const BF16* const* values, int64_t head_dim, uint32_t* vpairs) {
  // column c of two value rows a, b: (a[c], b[c]) for c in [0, 16), then in [16, 32), of a 32-column stretch
  alignas(64) static const uint16_t kLow[32] = {0, 32, 1, 33, 2,  34, 3,  35, 4,  36, 5,  37, 6,  38, 7,  39,
                                                8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static const uint16_t kHigh[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                                 24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i low = _mm512_load_si512(kLow), high = _mm512_load_si512(kHigh);
  for (int k = 0; k < kKeys; k += 2)
    for (int64_t c0 = 0; c0 < head_dim; c0 += 32) {
      const __m512i a = _mm512_loadu_si512(values[k] + c0), b = _mm512_loadu_si512(values[k + 1] + c0);
      _mm512_storeu_si512(vpairs + (k / 2) * head_dim + c0, _mm512_permutex2var_epi16(a, low, b));
      _mm512_storeu_si512(vpairs + (k / 2) * head_dim + c0 + 16, _mm512_permutex2var_epi16(a, high, b));
    }
}

// ot[c] = ot[c] * alpha + sum over key pairs of the rows' two weights times the keys' two values in column c, for
// every column, 16 at a time.
inline void bf16_tile_values(const __m512bh* weights, const uint32_t* vpairs, int64_t head_dim, const Vec& alpha,
                             float* ot) {
  constexpr int kColumns = 16;
  for (int64_t c0 = 0; c0 < head_dim; c0 += kColumns) {
    __m512 o[kColumns];
    for (int i = 0; i < kColumns; ++i) o[i] = _mm512_mul_ps(_mm512_loadu_ps(ot + (c0 + i) * W), alpha);
    for (int k = 0; k < kPairs; ++k) {
      const uint32_t* pair = vpairs + k * head_dim + c0;
#pragma GCC unroll 16
      for (int i = 0; i < kColumns; ++i) {
        const __m512bh value = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(pair[i])));
        o[i] = _mm512_dpbf16_ps(o[i], weights[k], value);
      }
    }
    for (int i = 0; i < kColumns; ++i) _mm512_storeu_ps(ot + (c0 + i) * W, o[i]);
  }
}

// The task with bfloat16 products (the file's header). Same tiles, masks and online softmax as run_task.
void run_task_bf16(const Task& task, const SeqSpan& span, const float* query, const BF16* cache, const int64_t* table,
                   const Shape& sh, float scale, int64_t window, Scratch& scratch, float* out) {
  static_assert(W == 16 && kKeys == 16, "the bfloat16 path is written for AVX-512");
  const int64_t hd = sh.head_dim, per_kv = sh.per_kv, prefix = span.seq_len - span.query_len;
  const int64_t rows = std::min<int64_t>(W, span.query_len * per_kv - task.row0);
  scratch.qp.assign(hd / 2 * W, 0);
  scratch.ot.assign(hd * W, 0.f);
  scratch.vpairs.resize(kPairs * hd);
  scratch.zeros.assign(hd, BF16(0.f));
  uint32_t* qp = scratch.qp.data();
  const __m512 vscale = _mm512_set1_ps(scale);
  float* ot = scratch.ot.data();
  uint32_t* vpairs = scratch.vpairs.data();
  float pos[W];
  load_rows(task, span, query, sh, rows, pos, [&](int64_t j, const float* q) {
    for (int64_t d0 = 0; d0 < hd; d0 += 32) {  // 16 (d, d + 1) pairs of the row at a time, rounded to nearest even
      const __m512 low = _mm512_mul_ps(_mm512_loadu_ps(q + d0), vscale);
      const __m512 high = _mm512_mul_ps(_mm512_loadu_ps(q + d0 + 16), vscale);
      uint32_t words[16];  // word i: the pair (d0 + 2i, d0 + 2i + 1)
      _mm512_storeu_si512(words, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(high, low)));
      for (int64_t i = 0; i < 16; ++i) qp[(d0 / 2 + i) * W + j] = words[i];
    }
  });
  const TaskMasks masks(task, pos, prefix, per_kv, window);
  // lane 2j of a weights pair = key 2k's weight of row j, lane 2j + 1 = key 2k + 1's
  alignas(64) static const uint16_t kInterleave[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
                                                       8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i interleave = _mm512_load_si512(kInterleave);
  Vec m(-1e30f), sum(0.f);
  const BF16* keys[kKeys];
  const BF16* values[kKeys];
  for (int64_t t0 = masks.first_key; t0 <= task.last_key; t0 += kKeys) {
    const int count = static_cast<int>(std::min<int64_t>(kKeys, task.last_key + 1 - t0));
    tile_rows(cache, table, sh, task.g, t0, count, keys, values);
    for (int k = count; k < kKeys; ++k) keys[k] = values[k] = scratch.zeros.data();
    __m512 acc[kKeys];
    bf16_tile_scores(qp, keys, hd, acc);
    Vec s[kKeys];
    for (int k = 0; k < kKeys; ++k) s[k] = k < count ? Vec(acc[k]) : Vec(-std::numeric_limits<float>::infinity());
    const Vec m_new = at::vec::maximum(m, masks.mask(s, count, t0));
    const Vec alpha = (m - m_new).exp_u20();
    // weights rounded to bfloat16, in (key, key + 1) pairs per row; their sum is taken after the rounding
    __m512bh weights[kPairs];
    Vec tile_sum(0.f);
    for (int k = 0; k < kKeys; k += 2) {
      const __m512 even = (s[k] - m_new).exp_u20(), odd = (s[k + 1] - m_new).exp_u20();
      const __m512i both = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(odd, even));  // even in lanes 0-15
      weights[k / 2] = reinterpret_cast<__m512bh>(_mm512_permutexvar_epi16(interleave, both));
      const __m512bh rounded = reinterpret_cast<__m512bh>(both);
      tile_sum = tile_sum + Vec(widen_low(rounded)) + Vec(widen_high(rounded));
    }
    sum = sum * alpha + tile_sum;
    m = m_new;
    pair_values(values, hd, vpairs);
    bf16_tile_values(weights, vpairs, hd, alpha, ot);
  }
  store_rows(task, span, sh, rows, ot, sum, out);
}
#endif

// Every task of the call, grouped by (sequence, K/V head) so that a thread's consecutive tasks reuse the keys and
// values it just read, the latest rows (the most keys) first in each group.
std::vector<Task> make_tasks(const std::vector<SeqSpan>& spans, const Shape& sh) {
  std::vector<Task> tasks;
  for (int64_t s = 0; s < static_cast<int64_t>(spans.size()); ++s) {
    const SeqSpan& span = spans[s];
    const int64_t rows = span.query_len * sh.per_kv, prefix = span.seq_len - span.query_len;
    for (int64_t g = 0; g < sh.num_kv_heads; ++g)
      for (int64_t row0 = (rows - 1) / W * W; row0 >= 0; row0 -= W) {
        const int64_t last_row = std::min(rows, row0 + W) - 1;
        tasks.push_back({s, g, row0, prefix + last_row / sh.per_kv});
      }
  }
  return tasks;
}

template <typename T>
void attend_all(const float* query, const T* cache, const int64_t* tables, const std::vector<SeqSpan>& spans,
                const Shape& sh, float scale, int64_t window, float* out) {
  const std::vector<Task> tasks = make_tasks(spans, sh);
  std::atomic<int64_t> next{0};
  const int64_t num_tasks = static_cast<int64_t>(tasks.size());
  // tasks are handed out on demand: their costs differ (a row's keys are all the tokens before it)
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    Scratch scratch;
    for (int64_t i = next.fetch_add(1); i < num_tasks; i = next.fetch_add(1)) {
      const Task& task = tasks[i];
#if defined(ASYNCLLM_BF16_DOT)
      if constexpr (std::is_same_v<T, BF16>) {
        if (sh.head_dim % 32 == 0) {
          run_task_bf16(task, spans[task.seq], query, cache, tables + task.seq * sh.max_blocks, sh, scale, window,
                        scratch, out);
          continue;
        }
      }
#endif
      run_task(task, spans[task.seq], query, cache, tables + task.seq * sh.max_blocks, sh, scale, window, scratch,
               out);
    }
  });
}

}  // namespace

bool paged_prefill_attention_bf16_dot() {
#if defined(ASYNCLLM_BF16_DOT)
  return true;
#else
  return false;
#endif
}

bool paged_prefill_attention_available() {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  return true;
#else
  return false;
#endif
}

void paged_prefill_attention_(at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
                              const at::Tensor& block_tables, const at::Tensor& query_starts,
                              const at::Tensor& query_lens, const at::Tensor& seq_lens, double scale,
                              int64_t window) {
  const bool bf16 = check_query_and_kv_cache(query, kv_cache, "num_tokens");
  const int64_t num_tokens = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t num_blocks = kv_cache.size(0), num_kv_heads = kv_cache.size(3);
  TORCH_CHECK(head_dim % 8 == 0, "head_dim ", head_dim, " is not a multiple of 8");  // of kValueColumns on any build
  TORCH_CHECK(out.dim() == 2 && out.scalar_type() == at::kFloat && out.is_contiguous() &&
                  out.size(1) == num_heads * head_dim && out.size(0) >= num_tokens,
              "out must be a contiguous float32 [>= num_tokens, num_heads * head_dim] tensor");
  const int64_t num_seqs = block_tables.size(0);
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.scalar_type() == at::kLong && block_tables.is_contiguous(),
              "block_tables must be a contiguous int64 [num_seqs, max_blocks] tensor");
  for (const at::Tensor* t : {&query_starts, &query_lens, &seq_lens})
    TORCH_CHECK(t->dim() == 1 && t->numel() == num_seqs && t->scalar_type() == at::kLong && t->is_contiguous(),
                "query_starts, query_lens and seq_lens must be contiguous int64 [num_seqs] tensors");
  const Shape sh{kv_cache.size(2), num_kv_heads, head_dim, num_heads / num_kv_heads, block_tables.size(1), num_heads};
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  std::vector<SeqSpan> spans(num_seqs);
  for (int64_t s = 0; s < num_seqs; ++s) {
    const SeqSpan span{query_starts.data_ptr<int64_t>()[s], query_lens.data_ptr<int64_t>()[s],
                       seq_lens.data_ptr<int64_t>()[s]};
    TORCH_CHECK_INDEX(span.query_len >= 1 && span.query_len <= span.seq_len && span.query_start >= 0 &&
                          span.query_start + span.query_len <= num_tokens,
                      "sequence ", s, ": ", span.query_len, " query tokens from row ", span.query_start, " with ",
                      span.seq_len, " tokens in all do not fit ", num_tokens, " query rows");
    TORCH_CHECK_INDEX(span.seq_len <= sh.max_blocks * sh.block_size, "sequence ", s, " has ", span.seq_len,
                      " tokens; its block table holds ", sh.max_blocks * sh.block_size);
    const int64_t used = (span.seq_len + sh.block_size - 1) / sh.block_size;
    for (int64_t b = 0; b < used; ++b)
      TORCH_CHECK_INDEX(tables[s * sh.max_blocks + b] >= 0 && tables[s * sh.max_blocks + b] < num_blocks, "block ",
                        tables[s * sh.max_blocks + b], " of sequence ", s, " is outside the KV cache");
    spans[s] = span;
  }
  const float scale_f = static_cast<float>(scale);
  pybind11::gil_scoped_release no_gil;  // the caller's other Python threads (an event loop) run meanwhile
  TORCH_CHECK(window >= 0, "window must be >= 0 (0: none)");
  if (bf16)
    attend_all(query.data_ptr<float>(), kv_cache.data_ptr<BF16>(), tables, spans, sh, scale_f, window,
               out.data_ptr<float>());
  else
    attend_all(query.data_ptr<float>(), kv_cache.data_ptr<float>(), tables, spans, sh, scale_f, window,
               out.data_ptr<float>());
}
