// float32 products with an MKL-packed weight, in column chunks run on a pool of threads (packed_gemm.cpp).
#pragma once
#include <torch/extension.h>

// Whether the MKL routines packed_gemm.cpp calls are linked (torch's MKL exports them).
bool has_packed_sgemm();

// weight [in, out] float32 contiguous -> an opaque uint8 buffer: a header, then each `chunk_cols`-wide column chunk
// packed by MKL. The buffer must stay where it is (MKL's packed data depends on its address's alignment): a copy is
// not a valid pack; pack again instead. Raises (c10::Error) without MKL or for an empty weight.
at::Tensor sgemm_pack(const at::Tensor& weight, int64_t chunk_cols);

// x [rows, in] float32 contiguous times the packed [in, out_features] weight -> [rows, out_features] float32, the
// chunks shared out on demand to `num_threads` threads (the caller and num_threads - 1 pool helpers), each chunk on
// one MKL thread. Releases the GIL while it computes. Raises (c10::Error) for a buffer of another shape.
at::Tensor sgemm_packed(const at::Tensor& x, const at::Tensor& packed, int64_t out_features, int64_t num_threads);
