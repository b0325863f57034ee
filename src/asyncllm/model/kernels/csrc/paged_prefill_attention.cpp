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
#include <limits>
#include <vector>

#include "paged_kv_checks.h"
#include "paged_prefill_attention.h"

namespace {

using Vec = at::vec::Vectorized<float>;
using BF16 = c10::BFloat16;
constexpr int64_t W = Vec::size();         // query rows per task
constexpr int kKeys = W >= 16 ? 16 : 8;    // keys per tile: one score vector each, all in registers
constexpr int kValueColumns = W >= 16 ? 8 : 4;  // output columns per pass over a tile's values (registers: kKeys + this)

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
  for (int64_t j = 0; j < W; ++j) {
    const int64_t r = task.row0 + std::min(j, rows - 1);  // padding lanes repeat the last row (never written out)
    const int64_t token = r / per_kv, head = task.g * per_kv + r % per_kv;
    pos[j] = static_cast<float>(prefix + token);
    if (j >= rows) continue;
    const float* q = query + ((span.query_start + token) * sh.num_heads + head) * hd;
    for (int64_t d = 0; d < hd; ++d) qt[d * W + j] = q[d] * scale;
  }
  const Vec vpos = Vec::loadu(pos);
  const int64_t first_pos = prefix + task.row0 / per_kv;  // of the task's first row
  const int64_t first_masked = first_pos + 1;  // from this key on, some row of the task is causally masked
  // with a window, the keys the first row sees start here, and every row sees all keys from `all_see` on
  const int64_t first_key = window > 0 ? std::max<int64_t>(0, first_pos - window + 1) : 0;
  const int64_t all_see = window > 0 ? task.last_key - window + 1 : 0;
  const Vec vwindow_end = vpos - Vec(static_cast<float>(window));  // a key at or before this is outside the window
  const Vec minus_inf(-std::numeric_limits<float>::infinity());
  // The running maximum starts finite, so a tile whose keys are all masked for a row (a window not reached yet)
  // leaves that row's sums as they are instead of computing exp(-inf - -inf).
  Vec m(-1e30f), sum(0.f);
  const T* keys[kKeys];
  const T* values[kKeys];
  const int64_t head_offset = task.g * hd;
  for (int64_t t0 = first_key; t0 <= task.last_key; t0 += kKeys) {
    const int count = static_cast<int>(std::min<int64_t>(kKeys, task.last_key + 1 - t0));
    for (int k = 0; k < count; ++k) {
      const int64_t t = t0 + k;
      const T* row = cache + table[t / sh.block_size] * sh.block_stride() + (t % sh.block_size) * sh.token_stride();
      keys[k] = row + head_offset;
      values[k] = row + sh.value_offset() + head_offset;
    }
    Vec s[kKeys];
    if (count == kKeys)
      tile_scores<true>(qt, keys, count, hd, s);
    else
      tile_scores<false>(qt, keys, count, hd, s);
    if (t0 + count > first_masked)
      for (int k = 0; k < count; ++k)
        s[k] = Vec::blendv(s[k], minus_inf, vpos < Vec(static_cast<float>(t0 + k)));
    if (t0 < all_see)
      for (int k = 0; k < count; ++k)
        s[k] = Vec::blendv(s[k], minus_inf, Vec(static_cast<float>(t0 + k)) <= vwindow_end);
    Vec tile_max = s[0];
    for (int k = 1; k < count; ++k) tile_max = at::vec::maximum(tile_max, s[k]);
    const Vec m_new = at::vec::maximum(m, tile_max);
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
  float inv[W];
  (Vec(1.f) / sum).store(inv);
  for (int64_t j = 0; j < rows; ++j) {
    const int64_t r = task.row0 + j, token = r / per_kv, head = task.g * per_kv + r % per_kv;
    float* o = out + (span.query_start + token) * sh.num_heads * hd + head * hd;
    for (int64_t d = 0; d < hd; ++d) o[d] = ot[d * W + j] * inv[j];
  }
}

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
      run_task(task, spans[task.seq], query, cache, tables + task.seq * sh.max_blocks, sh, scale, window, scratch,
               out);
    }
  });
}

}  // namespace

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
