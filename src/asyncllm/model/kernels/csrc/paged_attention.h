// Decode attention that reads the paged KV cache through the block tables (paged_attention.cpp).
#pragma once
#include <torch/extension.h>

at::Tensor paged_decode_attention(const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& block_tables,
                                  const at::Tensor& seq_lens, double scale, int64_t window);
