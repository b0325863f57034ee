// Prefill attention that reads the paged KV cache through the block tables (paged_prefill_attention.cpp).
#pragma once
#include <torch/extension.h>

// Whether this build has the kernel's vector code (AVX-512 or AVX2); elsewhere it runs ATen's generic vectors.
bool paged_prefill_attention_available();

// Whether this build multiplies a bfloat16 cache's keys and values in bfloat16 (AVX512_BF16's `vdpbf16ps`, for
// head_dim a multiple of 32; paged_prefill_attention.cpp's header) instead of widening them to float32.
bool paged_prefill_attention_bf16_dot();

// out[query_starts[s] + i] = attention of sequence s's query token i (at position seq_lens[s] - query_lens[s] + i)
// over its cached tokens 0 .. that position (`window` > 0: only the last `window` of them), for every sequence s. query [num_tokens, num_heads, head_dim] float32;
// kv_cache [num_blocks, 2, block_size, num_kv_heads, head_dim] float32 or bfloat16 (this step's keys and values
// already written); block_tables [num_seqs, max_blocks] int64; query_starts, query_lens, seq_lens [num_seqs] int64;
// out [>= num_tokens, num_heads * head_dim] float32 (other rows untouched). All contiguous.
// Raises RuntimeError on a wrong dtype, shape or layout, IndexError on a span outside the query rows, a block id
// outside the cache or a sequence longer than its table.
void paged_prefill_attention_(at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
                              const at::Tensor& block_tables, const at::Tensor& query_starts,
                              const at::Tensor& query_lens, const at::Tensor& seq_lens, double scale,
                              int64_t window);
