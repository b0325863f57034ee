// Decode attention straight from the paged KV cache (asyncllm/model/layers/attention.py `_decode_attention`).
//
// Each sequence has one query token (its newest, already written to the cache). For each sequence (or each
// (sequence, K/V head) when there are too few sequences to share among the threads) the kernel walks the block
// table once for the keys and once for the values, in tiles of 16 tokens in the cache's own order (a token's row of
// every K/V head, then the next token), asking for the next tile's cache lines while computing this one. Each K or V
// row is loaded once for all the query heads that share it (grouped-query attention, HF's `repeat_kv` order: query
// head h reads K/V head h / (num_heads / num_kv_heads)): scores q.k * scale, an exact softmax (max subtracted,
// ATen's vectorized exp), then the weighted sum of the values. Nothing is gathered into a dense copy first, which is
// what the torch path does per layer and step. With `window` > 0 a query sees only the last `window` tokens (itself
// included), as sliding-window layers do.
//
// The cache holds float32 or bfloat16 (`EngineArgs.kv_cache_dtype`): bfloat16 rows are widened to float32 in registers
// as they are loaded (exact: a bfloat16 is the top half of a float32), so the arithmetic is the same either way and a
// bfloat16 cache reads half the bytes.
//
// Float32 arithmetic throughout, in a fixed order per (sequence, head): a sequence's output does not depend on its
// batch, on how its heads are split into tasks, or on the thread count (and equals, bit for bit, the kernel before
// the tiles, which loaded each row once per query head). Not bit-exact with torch's SDPA (another summation order):
// row_kernels.py checks it against SDPA at start-up with a tolerance.
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
#include "paged_kv_checks.h"

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
// Lane j of the result = the sum of v[j]'s lanes (Vec::size() vectors).
#define ASYNCLLM_LANE_REDUCTION
inline Vec reduce_lanes(const Vec* v) { return Vec(reduce16(reinterpret_cast<const __m512*>(v))); }
#elif defined(CPU_CAPABILITY_AVX2)
// Lane j of the result = the sum of v[j]'s 8 lanes: pairs of vectors are folded within 128-bit lanes (unpack, then
// shuffle), then the halves are added across (permute2f128), 7 adds per sum as in a sequential sum.
inline __m256 reduce8(const __m256* v) {
  __m256 x[4], y[2];
  for (int i = 0; i < 4; ++i)
    x[i] = _mm256_add_ps(_mm256_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm256_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 2; ++i)
    y[i] = _mm256_add_ps(_mm256_shuffle_ps(x[2 * i], x[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm256_shuffle_ps(x[2 * i], x[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm256_add_ps(_mm256_permute2f128_ps(y[0], y[1], 0x20), _mm256_permute2f128_ps(y[0], y[1], 0x31));
}
#define ASYNCLLM_LANE_REDUCTION
inline Vec reduce_lanes(const Vec* v) { return Vec(reduce8(reinterpret_cast<const __m256*>(v))); }
#endif

struct Layout {
  int64_t block_size, num_kv_heads, head_dim, per_kv, max_blocks;
  int64_t token_stride() const { return num_kv_heads * head_dim; }
  int64_t block_stride() const { return 2 * block_size * token_stride(); }  // [2, block_size, kv_heads, head_dim]
};

constexpr int64_t kTile = 16;  // tokens per tile: one reduce16 (AVX-512) or two reduce8 (AVX2) per query head

// The start of each cached token's row (all K/V heads) for tokens [first, last) of one sequence, walked in tiles
// of up to kTile tokens: one division per sequence, none per token.
template <typename T>
struct TileWalk {
  const T* cache;
  const int64_t* table;
  const Layout& l;
  int64_t block, offset;  // of the next token
  TileWalk(const T* cache_, const int64_t* table_, const Layout& l_, int64_t first)
      : cache(cache_), table(table_), l(l_), block(first / l_.block_size), offset(first % l_.block_size) {}
  // rows[j] = token j's keys (index 0 of its block); the values are `block_size * token_stride()` further.
  void next(int64_t count, const T** rows) {
    for (int64_t j = 0; j < count; ++j) {
      rows[j] = cache + table[block] * l.block_stride() + offset * l.token_stride();
      if (++offset == l.block_size) {
        offset = 0;
        ++block;
      }
    }
  }
};

// Asks for the cache lines of the tile after the one being computed, into L2, one row's K/V head at a time while
// the same row of this tile is computed, so the requests are spread over the tile's arithmetic. Without it the
// kernel waits on memory at every block (blocks lie anywhere in the cache). Measured on an AMD EPYC (AVX2, two
// threads, 32 decodes at 320 tokens x 30 layers, float32 cache on huge pages): the whole next tile asked for into
// L1 at once took 32 ms, as into L1 row by row 30.5 ms, as into L2 row by row 20.5 ms (benchmarks/analysis.md).
template <typename T>
struct Prefetcher {
  TileWalk<T> walk;
  int64_t left, skip;  // tokens not walked yet; elements into a token's row where the task's span starts
  const T* rows[kTile];
  int64_t count = 0;  // rows of the next tile
  Prefetcher(const T* cache, const int64_t* table, const Layout& l, int64_t first, int64_t n, int64_t skip_)
      : walk(cache, table, l, first), left(n), skip(skip_) {
    next();
  }
  // Moves on one tile. Called once before computing each tile, so that `fetch` then asks for the tile after it.
  void next() {
    count = std::min(kTile, left);
    if (count <= 0) return;
    walk.next(count, rows);
    left -= count;
  }
  // Asks for `bytes` of the next tile's row j from element `offset` of the task's span. Always inlined: GCC takes a
  // function that only prefetches for one without side effects and drops the calls to it (seen with -O1 and -O3).
  __attribute__((always_inline)) void fetch(int64_t j, int64_t offset, int64_t bytes) const {
    if (j >= count) return;
    const char* p = reinterpret_cast<const char*>(rows[j] + skip + offset);
    for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(p + b, _MM_HINT_T1);
  }
};

// The largest of s[0 .. n) (n >= 1), lane-wise then across lanes: a scalar running max waits on each compare.
float max_of(const float* s, int64_t n) {
  int64_t i = 0;
  float best = s[0];
  if (n >= Vec::size()) {
    Vec vbest = Vec::loadu(s);
    for (i = Vec::size(); i + Vec::size() <= n; i += Vec::size()) vbest = at::vec::maximum(vbest, Vec::loadu(s + i));
    float lanes[Vec::size()];
    vbest.store(lanes);
    best = *std::max_element(lanes, lanes + Vec::size());
  }
  for (; i < n; ++i) best = std::max(best, s[i]);
  return best;
}

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

// Per-thread scratch of one call (reused across its tasks).
struct Scratch {
  std::vector<float> scores, acc, inv;
#if defined(ASYNCLLM_LANE_REDUCTION)
  std::vector<Vec> partial;  // [per_kv][kTile] lane sums of one tile and K/V head
#endif
};

// One task: the query heads of K/V heads [g0, g1) of one sequence (query `q` and output `out` at the sequence's
// head 0), over its tokens [first, last). Each cached K (then V) row is loaded once for all the query heads that
// share it (the GQA group), tile by tile in the cache's order (every K/V head of a token, then the next token), so
// every cache line fetched is used at once. The arithmetic per (sequence, query head) is fixed: scores
// q . k * scale (on AVX-512 and AVX2 the lanes summed by transposing reductions, one per Vec::size() tokens), an
// exact softmax (max subtracted, ATen's vectorized exp), then sum_t p_t * v_t in token order, times 1 / sum p: it
// does not depend on the batch, on how heads are grouped into tasks, or on the thread count. NV vectors per head
// row (head_dim == NV * Vec::size()); H query heads share a pass of the values (per_kv % H == 0, H * NV
// accumulators in registers).
template <int NV, int H, typename T>
void attend_task(const float* q, const T* cache, const int64_t* table, int64_t first, int64_t last, const Layout& l,
                 int64_t g0, int64_t g1, float scale, Scratch& scratch, float* out) {
  constexpr int64_t W = Vec::size();
  const int64_t n = last - first, per_kv = l.per_kv, hd = l.head_dim;
  const int64_t heads = (g1 - g0) * per_kv;  // rows of `scores`: head (g - g0) * per_kv + h
  const int64_t value_skip = l.block_size * l.token_stride();
  scratch.scores.resize(heads * n);
  float* scores = scratch.scores.data();
  const T* rows[kTile];
  const int64_t head_bytes = hd * static_cast<int64_t>(sizeof(T));  // of one K/V head's row
  const float* qt = q + g0 * per_kv * hd;  // the task's first query head

  // Scores, tile by tile; the next tile's rows are fetched while this one is computed.
  {
    TileWalk<T> walk(cache, table, l, first);
    Prefetcher<T> prefetch(cache, table, l, first, n, g0 * hd);
#if defined(ASYNCLLM_LANE_REDUCTION)
    scratch.partial.resize(per_kv * kTile);
    Vec* partial = scratch.partial.data();
#endif
    for (int64_t t0 = 0; t0 < n; t0 += kTile) {
      const int64_t count = std::min(kTile, n - t0);
      walk.next(count, rows);
      prefetch.next();
#if defined(ASYNCLLM_LANE_REDUCTION)
      for (int64_t g = g0; g < g1; ++g) {
        for (int64_t j = 0; j < kTile; ++j) {
          if (j >= count) {
            for (int64_t h = 0; h < per_kv; ++h) partial[h * kTile + j] = Vec(0.f);
            continue;
          }
          prefetch.fetch(j, (g - g0) * hd, head_bytes);
          const T* k = rows[j] + g * hd;
          Vec kv[NV];
          for (int i = 0; i < NV; ++i) kv[i] = load(k + i * W);
          for (int64_t h = 0; h < per_kv; ++h) {
            const float* qh = qt + ((g - g0) * per_kv + h) * hd;
            Vec acc = Vec::loadu(qh) * kv[0];
            for (int i = 1; i < NV; ++i) acc = at::vec::fmadd(Vec::loadu(qh + i * W), kv[i], acc);
            partial[h * kTile + j] = acc;
          }
        }
        for (int64_t h = 0; h < per_kv; ++h)
          for (int64_t c = 0; c < count; c += W) {
            const Vec sums = reduce_lanes(partial + h * kTile + c) * Vec(scale);
            sums.store(scores + ((g - g0) * per_kv + h) * n + t0 + c, static_cast<int>(std::min(W, count - c)));
          }
      }
#else
      for (int64_t g = g0; g < g1; ++g)
        for (int64_t j = 0; j < count; ++j) {
          prefetch.fetch(j, (g - g0) * hd, head_bytes);
          const T* k = rows[j] + g * hd;
          Vec kv[NV];
          for (int i = 0; i < NV; ++i) kv[i] = load(k + i * W);
          for (int64_t h = 0; h < per_kv; ++h) {
            const float* qh = qt + ((g - g0) * per_kv + h) * hd;
            Vec acc = Vec::loadu(qh) * kv[0];
            for (int i = 1; i < NV; ++i) acc = at::vec::fmadd(Vec::loadu(qh + i * W), kv[i], acc);
            scores[((g - g0) * per_kv + h) * n + t0 + j] = hsum(acc) * scale;
          }
        }
#endif
    }
  }

  // Softmax of each head's scores, in place; the values pass scales by 1 / sum at the end.
  scratch.inv.resize(heads);
  float* inv = scratch.inv.data();
  for (int64_t h = 0; h < heads; ++h) {
    float* s = scores + h * n;
    inv[h] = 1.f / exp_shifted(s, n, max_of(s, n));
  }

  // Values: per tile and K/V head, H query heads at a time accumulate p * v in registers, in token order.
  scratch.acc.assign(heads * hd, 0.f);
  float* acc_all = scratch.acc.data();
  TileWalk<T> walk(cache, table, l, first);
  Prefetcher<T> prefetch(cache, table, l, first, n, value_skip + g0 * hd);
  for (int64_t t0 = 0; t0 < n; t0 += kTile) {
    const int64_t count = std::min(kTile, n - t0);
    walk.next(count, rows);
    prefetch.next();
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t h0 = 0; h0 < per_kv; h0 += H) {
        const int64_t head0 = (g - g0) * per_kv + h0;
        Vec acc[H][NV];
        for (int hh = 0; hh < H; ++hh)
          for (int i = 0; i < NV; ++i) acc[hh][i] = Vec::loadu(acc_all + (head0 + hh) * hd + i * W);
        for (int64_t j = 0; j < count; ++j) {
          if (h0 == 0) prefetch.fetch(j, (g - g0) * hd, head_bytes);
          const T* v = rows[j] + value_skip + g * hd;
          Vec vv[NV];
          for (int i = 0; i < NV; ++i) vv[i] = load(v + i * W);
          for (int hh = 0; hh < H; ++hh) {
            const Vec pv(scores[(head0 + hh) * n + t0 + j]);
            for (int i = 0; i < NV; ++i) acc[hh][i] = at::vec::fmadd(vv[i], pv, acc[hh][i]);
          }
        }
        for (int hh = 0; hh < H; ++hh)
          for (int i = 0; i < NV; ++i) acc[hh][i].store(acc_all + (head0 + hh) * hd + i * W);
      }
  }
  for (int64_t h = 0; h < heads; ++h) {
    const Vec vinv(inv[h]);
    for (int64_t i = 0; i < hd; i += W)
      (Vec::loadu(acc_all + h * hd + i) * vinv).store(out + (g0 * per_kv + h) * hd + i);
  }
}

template <typename T>
using TaskFn = void (*)(const float*, const T*, const int64_t*, int64_t, int64_t, const Layout&, int64_t, int64_t,
                        float, Scratch&, float*);

template <int NV, typename T>
TaskFn<T> task_for_heads(int64_t per_kv) {
  // H query heads per values pass: the widest of 4, 3, 2, 1 that divides per_kv with H * NV <= 16 accumulators
  if (per_kv % 4 == 0 && 4 * NV <= 16) return attend_task<NV, 4, T>;
  if (per_kv % 3 == 0 && 3 * NV <= 16) return attend_task<NV, 3, T>;
  if (per_kv % 2 == 0 && 2 * NV <= 16) return attend_task<NV, 2, T>;
  return attend_task<NV, 1, T>;
}

// The instance for head_dim and the group size, or nullptr if head_dim is not 1, 2, 4, 8, 16 or 32 vectors wide.
template <typename T>
TaskFn<T> task_for(int64_t head_dim, int64_t per_kv) {
  if (head_dim % Vec::size() != 0) return nullptr;
  switch (head_dim / Vec::size()) {
    case 1: return task_for_heads<1, T>(per_kv);
    case 2: return task_for_heads<2, T>(per_kv);
    case 4: return task_for_heads<4, T>(per_kv);
    case 8: return task_for_heads<8, T>(per_kv);
    case 16: return task_for_heads<16, T>(per_kv);
    case 32: return task_for_heads<32, T>(per_kv);  // 256 floats on AVX2 (Gemma 3), as decode_reads_cache offers
    default: return nullptr;
  }
}

// All tasks of one call, on a cache of element type T. A task is one sequence (every K/V head) when there are
// enough sequences to share among the threads, else one (sequence, K/V head); either way the same arithmetic.
template <typename T>
void attend_all(const float* qp, const T* cache, const int64_t* tables, const int64_t* lens, const Layout& l,
                int64_t num_seqs, int64_t num_heads, int64_t window, float scale, float* op) {
  const TaskFn<T> task = task_for<T>(l.head_dim, l.per_kv);
  TORCH_CHECK(task != nullptr, "head_dim ", l.head_dim, " is not 1, 2, 4, 8, 16 or 32 vectors of ", Vec::size(),
              " floats");
  const int64_t kv_heads = l.num_kv_heads;
  // K/V heads per task: all while each thread gets at least 4 sequences, else one
  const int64_t per_task = num_seqs >= 4 * at::get_num_threads() ? kv_heads : 1;
  const int64_t splits = kv_heads / per_task;
  at::parallel_for(0, num_seqs * splits, 1, [&](int64_t begin, int64_t end) {
    Scratch scratch;
    for (int64_t index = begin; index < end; ++index) {
      const int64_t s = index / splits, g0 = (index % splits) * per_task;
      const int64_t last = lens[s], first = window > 0 ? std::max<int64_t>(0, last - window) : 0;
      task(qp + s * num_heads * l.head_dim, cache, tables + s * l.max_blocks, first, last, l, g0, g0 + per_task, scale,
           scratch, op + s * num_heads * l.head_dim);
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
  const bool bf16 = check_query_and_kv_cache(query, kv_cache, "num_seqs");
  const int64_t num_seqs = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t num_blocks = kv_cache.size(0), num_kv_heads = kv_cache.size(3);
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
