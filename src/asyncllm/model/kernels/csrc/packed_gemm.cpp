// float32 products with a weight packed once into MKL's internal layout, in column chunks shared out to threads
// on demand (asyncllm/model/kernels/fp32.py uses them; row_kernels.cpp exports them).
//
// The weight [in, out] is packed as independent column chunks (`cblas_sgemm_pack` per chunk). A product runs the
// chunks on `num_threads` threads (the caller and a pool of helpers), each thread taking the next unstarted chunk
// and computing it with MKL on one thread (`cblas_sgemm_compute`), so no thread waits for another at a barrier
// while chunks are left. Why: beside another CPU-bound process, the OS deschedules one of our threads now and then;
// a product split statically (OpenMP's, MKL's) then waits for that thread's share at its end, and a waiter that
// spins keeps the core from it. Here the other thread takes the remaining chunks, and a waiter spins briefly, then
// sleeps, giving its core back. When torch itself runs on `num_threads` threads (a quiet machine), its OpenMP threads
// take the chunks instead: a pool beside them would compete with their spinning. Measured in the engine (fp32, 32
// streams, 2 cores, one busy process beside, the thread policy running the rest of each step on one thread):
// 308-320 tok/s vs 269-279 with the whole product on one thread; quiet 458-473 vs 460-475 (4 chunks per weight:
// the chunks cost a little of MKL's speed, 44.6 vs 43.0 ms for this model's 30 layers + LM head at 32 rows; 8 chunks
// cost 17%).
//
// The values are MKL's float32 products (not bit-exact with other GEMMs); a chunk's values do not depend on which
// thread computed it, so a product's result does not depend on the thread count or timing.
#include "packed_gemm.h"

#include <ATen/Parallel.h>

#include <immintrin.h>
#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <functional>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

// MKL's packed GEMM (Intel oneMKL Developer Reference: cblas_?gemm_pack_get_size, cblas_?gemm_pack,
// cblas_?gemm_compute, mkl_set_num_threads_local; LP64 integers). Declared weak: where torch links no MKL they stay
// null and `has_packed_sgemm()` is false, instead of the whole extension failing to load.
extern "C" {
__attribute__((weak)) size_t cblas_sgemm_pack_get_size(int identifier, int m, int n, int k);
__attribute__((weak)) void cblas_sgemm_pack(int layout, int identifier, int trans, int m, int n, int k, float alpha,
                                            const float* src, int ld, float* dest);
__attribute__((weak)) void cblas_sgemm_compute(int layout, int transa, int transb, int m, int n, int k, const float* a,
                                               int lda, const float* b, int ldb, float beta, float* c, int ldc);
__attribute__((weak)) int MKL_Set_Num_Threads_Local(int num_threads);
}

namespace {

constexpr int kRowMajor = 101, kNoTrans = 111, kPacked = 151, kBMatrix = 162;  // MKL's CBLAS enum values
constexpr int kPackRowsHint = 128;  // the `m` given to the pack routines; products of any row count may use the pack
constexpr int kSpinPauses = 2000;   // a waiting thread spins this many pause instructions (tens of us), then sleeps
constexpr int64_t kAlign = 64;      // each chunk's packed data starts 64-byte aligned, as MKL's pack did

// ---- the pool: helpers that run numbered tasks with the caller, handing them out one at a time ----
class TaskPool {
 public:
  explicit TaskPool(int helpers) {
    for (int i = 0; i < helpers; ++i) threads_.emplace_back([this] { serve(); });
  }
  TaskPool(const TaskPool&) = delete;
  TaskPool& operator=(const TaskPool&) = delete;
  ~TaskPool() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
      generation_.fetch_add(1);
    }
    wake_.notify_all();
    for (auto& t : threads_) t.join();
  }
  int helpers() const { return static_cast<int>(threads_.size()); }

  // Runs task(0) .. task(num_tasks - 1), each once, on the caller and the helpers; returns when all are done and
  // no helper touches this job any more. One job at a time (callers serialize on `busy`).
  void run(int64_t num_tasks, const std::function<void(int64_t)>& task) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      task_ = &task;
      num_tasks_ = num_tasks;
      next_.store(0);
      done_.store(0);
      open_ = true;
      generation_.fetch_add(1, std::memory_order_release);
    }
    wake_.notify_all();
    work(num_tasks, task);
    wait_until([&] { return done_.load(std::memory_order_acquire) >= num_tasks; });
    {
      std::lock_guard<std::mutex> lock(mu_);
      open_ = false;  // a helper waking from now on finds no job
    }
    while (active_.load(std::memory_order_acquire) != 0) _mm_pause();  // helpers past their last task
  }

  std::mutex busy;

 private:
  void work(int64_t num_tasks, const std::function<void(int64_t)>& task) {
    for (int64_t i = next_.fetch_add(1); i < num_tasks; i = next_.fetch_add(1)) {
      task(i);
      if (done_.fetch_add(1, std::memory_order_acq_rel) + 1 == num_tasks) {
        std::lock_guard<std::mutex> lock(mu_);
        finished_.notify_all();
      }
    }
  }

  template <typename Ready>
  void wait_until(Ready ready) {
    for (int i = 0; i < kSpinPauses && !ready(); ++i) _mm_pause();
    if (ready()) return;
    std::unique_lock<std::mutex> lock(mu_);
    finished_.wait(lock, ready);
  }

  void serve() {
    if (MKL_Set_Num_Threads_Local != nullptr) MKL_Set_Num_Threads_Local(1);  // chunks run on one thread each
    uint64_t seen = 0;
    for (;;) {
      for (int i = 0; i < kSpinPauses && generation_.load(std::memory_order_acquire) == seen; ++i) _mm_pause();
      int64_t num_tasks = 0;
      const std::function<void(int64_t)>* task = nullptr;
      {
        std::unique_lock<std::mutex> lock(mu_);
        wake_.wait(lock, [&] { return generation_.load() != seen; });
        seen = generation_.load();
        if (stopping_) return;
        if (!open_) continue;
        active_.fetch_add(1);
        num_tasks = num_tasks_;
        task = task_;
      }
      work(num_tasks, *task);
      active_.fetch_sub(1, std::memory_order_release);
    }
  }

  std::vector<std::thread> threads_;
  std::mutex mu_;
  std::condition_variable wake_, finished_;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int64_t> next_{0}, done_{0}, active_{0};
  const std::function<void(int64_t)>* task_ = nullptr;  // guarded by mu_, with num_tasks_, open_, stopping_
  int64_t num_tasks_ = 0;
  bool open_ = false, stopping_ = false;
};

// The process's pool for `helpers` helper threads, made on first use and kept (a product may be using it; idle
// helpers sleep). After a fork the parent's helpers do not exist in the child: its pools are left alone (never
// joined) and new ones are made.
TaskPool& pool_with(int helpers) {
  static std::mutex mu;
  static auto* pools = new std::map<int, TaskPool*>();
  static pid_t owner = getpid();
  std::lock_guard<std::mutex> lock(mu);
  if (owner != getpid()) {
    pools = new std::map<int, TaskPool*>();
    owner = getpid();
  }
  TaskPool*& pool = (*pools)[helpers];
  if (pool == nullptr) pool = new TaskPool(helpers);
  return *pool;
}

// ---- the pack buffer ----
// A header of int64s: [in, out, chunk_cols, num_chunks, offset of chunk 0, offset of chunk 1, ...] (byte offsets
// into the buffer), padded to 64 bytes; then each chunk's MKL-packed data, 64-byte aligned. A product with the wrong
// shape is an error instead of garbage.
constexpr int64_t kFixedHeader = 4;

int64_t header_bytes(int64_t num_chunks) { return (8 * (kFixedHeader + num_chunks) + kAlign - 1) / kAlign * kAlign; }

int64_t chunk_bytes(int64_t in_features, int64_t cols) {
  const auto bytes = static_cast<int64_t>(cblas_sgemm_pack_get_size(kBMatrix, kPackRowsHint, cols, in_features));
  return (bytes + kAlign - 1) / kAlign * kAlign;
}

const int64_t* checked_header(const at::Tensor& packed, int64_t in_features, int64_t out_features) {
  TORCH_CHECK(packed.dim() == 1 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.numel() >= header_bytes(1),
              "packed must be a buffer made by sgemm_pack");
  const auto* header = reinterpret_cast<const int64_t*>(packed.data_ptr<uint8_t>());
  TORCH_CHECK(header[0] == in_features && header[1] == out_features, "packed holds a [", header[0], ", ", header[1],
              "] weight, not [", in_features, ", ", out_features, "]");
  const int64_t chunk_cols = header[2], num_chunks = header[3];
  TORCH_CHECK(chunk_cols > 0 && num_chunks == (out_features + chunk_cols - 1) / chunk_cols &&
                  packed.numel() >= header_bytes(num_chunks),
              "packed must be a buffer made by sgemm_pack");
  const int64_t last_cols = out_features - (num_chunks - 1) * chunk_cols;
  TORCH_CHECK(header[kFixedHeader + num_chunks - 1] + chunk_bytes(in_features, last_cols) <= packed.numel(),
              "packed must be a buffer made by sgemm_pack");
  return header;
}

// When torch runs on `num_threads` threads itself, its OpenMP threads take the chunks (they are awake, and a pool
// beside them would compete with their spinning for the cores).
void run_on_torch_threads(int64_t num_threads, int64_t num_chunks, const std::function<void(int64_t)>& chunk) {
  std::atomic<int64_t> next{0};
  at::parallel_for(0, num_threads, 1, [&](int64_t, int64_t) {
    const int previous = MKL_Set_Num_Threads_Local(1);
    for (int64_t i = next.fetch_add(1); i < num_chunks; i = next.fetch_add(1)) chunk(i);
    MKL_Set_Num_Threads_Local(previous);
  });
}

// When torch runs on fewer threads (the thread policy's choice beside a busy process), the pool's helpers join
// the caller, unless another thread's product is using the pool: then every chunk runs here.
void run_on_pool(int helpers, int64_t num_chunks, const std::function<void(int64_t)>& chunk) {
  TaskPool& pool = pool_with(helpers);
  if (!pool.busy.try_lock()) {
    for (int64_t i = 0; i < num_chunks; ++i) chunk(i);
    return;
  }
  std::lock_guard<std::mutex> own(pool.busy, std::adopt_lock);
  pool.run(num_chunks, chunk);
}

}  // namespace

bool has_packed_sgemm() {
  return cblas_sgemm_pack_get_size != nullptr && cblas_sgemm_pack != nullptr && cblas_sgemm_compute != nullptr &&
         MKL_Set_Num_Threads_Local != nullptr;
}

at::Tensor sgemm_pack(const at::Tensor& weight, int64_t chunk_cols) {
  TORCH_CHECK(has_packed_sgemm(), "this torch build has no MKL packed GEMM");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.is_contiguous(),
              "weight must be a contiguous 2-D float32 tensor");
  const int64_t k = weight.size(0), n = weight.size(1);
  TORCH_CHECK(k > 0 && n > 0 && k < INT32_MAX && n < INT32_MAX, "weight must be non-empty with sides < 2^31");
  TORCH_CHECK(chunk_cols > 0, "chunk_cols must be positive");
  const int64_t num_chunks = (n + chunk_cols - 1) / chunk_cols;
  std::vector<int64_t> offsets(num_chunks);
  int64_t total = header_bytes(num_chunks);
  for (int64_t c = 0; c < num_chunks; ++c) {
    offsets[c] = total;
    total += chunk_bytes(k, std::min(chunk_cols, n - c * chunk_cols));
  }
  at::Tensor packed = at::empty({total}, weight.options().dtype(at::kByte));  // MKL writes less than it asks for: untouched pages stay unallocated
  std::fill_n(packed.data_ptr<uint8_t>(), header_bytes(num_chunks), uint8_t{0});
  uint8_t* base = packed.data_ptr<uint8_t>();
  auto* header = reinterpret_cast<int64_t*>(base);
  header[0] = k;
  header[1] = n;
  header[2] = chunk_cols;
  header[3] = num_chunks;
  for (int64_t c = 0; c < num_chunks; ++c) {
    header[kFixedHeader + c] = offsets[c];
    const int64_t cols = std::min(chunk_cols, n - c * chunk_cols);
    cblas_sgemm_pack(kRowMajor, kBMatrix, kNoTrans, kPackRowsHint, cols, k, 1.0f,
                     weight.data_ptr<float>() + c * chunk_cols, n, reinterpret_cast<float*>(base + offsets[c]));
  }
  return packed;
}

at::Tensor sgemm_packed(const at::Tensor& x, const at::Tensor& packed, int64_t out_features, int64_t num_threads) {
  TORCH_CHECK(has_packed_sgemm(), "this torch build has no MKL packed GEMM");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "x must be a contiguous 2-D float32 tensor");
  TORCH_CHECK(num_threads >= 1 && num_threads <= 1024, "num_threads must be 1 .. 1024");
  const int64_t rows = x.size(0), k = x.size(1);
  const int64_t* header = checked_header(packed, k, out_features);
  TORCH_CHECK(rows < INT32_MAX, "x must have fewer than 2^31 rows");
  at::Tensor out = at::empty({rows, out_features}, x.options());
  if (rows == 0) return out;
  const int64_t chunk_cols = header[2], num_chunks = header[3];
  const float* a = x.data_ptr<float>();
  const uint8_t* base = packed.data_ptr<uint8_t>();
  float* c = out.data_ptr<float>();
  const std::function<void(int64_t)> chunk = [&](int64_t i) {
    const int64_t cols = std::min(chunk_cols, out_features - i * chunk_cols);
    cblas_sgemm_compute(kRowMajor, kNoTrans, kPacked, rows, cols, k, a, k,
                        reinterpret_cast<const float*>(base + header[kFixedHeader + i]), k, 0.0f, c + i * chunk_cols,
                        out_features);
  };
  pybind11::gil_scoped_release no_gil;  // the caller's other Python threads (an event loop) run meanwhile
  const int previous = MKL_Set_Num_Threads_Local(1);
  if (num_threads == 1 || num_chunks == 1) {
    for (int64_t i = 0; i < num_chunks; ++i) chunk(i);
  } else if (at::get_num_threads() >= num_threads && !at::in_parallel_region()) {
    run_on_torch_threads(num_threads, num_chunks, chunk);
  } else {
    run_on_pool(static_cast<int>(num_threads) - 1, num_chunks, chunk);
  }
  MKL_Set_Num_Threads_Local(previous);
  return out;
}
