// The checks both attention kernels make on their queries and the paged KV cache (paged_attention.cpp,
// paged_prefill_attention.cpp).
#pragma once
#include <torch/extension.h>

// Raises RuntimeError unless `query` is a contiguous float32 [rows, num_heads, head_dim] tensor (`rows_name` names
// its first dimension in the message) and `kv_cache` a contiguous float32 or bfloat16 [num_blocks, 2, block_size,
// num_kv_heads, head_dim] tensor of the same head_dim, num_heads a multiple of num_kv_heads (GQA). Returns whether
// the cache holds bfloat16.
inline bool check_query_and_kv_cache(const at::Tensor& query, const at::Tensor& kv_cache, const char* rows_name) {
  TORCH_CHECK(query.dim() == 3 && query.scalar_type() == at::kFloat && query.is_contiguous(),
              "query must be a contiguous float32 [", rows_name, ", num_heads, head_dim] tensor");
  const bool bf16 = kv_cache.scalar_type() == at::kBFloat16;
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(1) == 2 && (kv_cache.scalar_type() == at::kFloat || bf16) &&
                  kv_cache.is_contiguous(),
              "kv_cache must be a contiguous float32 or bfloat16 [num_blocks, 2, block_size, num_kv_heads, head_dim] "
              "tensor");
  const int64_t num_kv_heads = kv_cache.size(3);
  TORCH_CHECK(kv_cache.size(4) == query.size(2) && num_kv_heads > 0 && query.size(1) % num_kv_heads == 0,
              "query heads must be a multiple of the cache's K/V heads, with the same head_dim");
  return bf16;
}
