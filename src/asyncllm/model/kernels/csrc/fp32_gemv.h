// float32 products of a few rows with the plain [in, out] weight, streaming it once at memory speed (fp32_gemv.cpp;
// asyncllm/model/kernels/fp32.py offers it to the kernel chooser as "gemv").
#pragma once
#include <torch/extension.h>

// Whether this build has the vector path (compiled with -march=native on a CPU with AVX2 and FMA).
bool fp32_gemv_available();

// x [rows, in] float32 contiguous times weight [in, out] float32 contiguous -> [rows, out] float32. The input
// features are cut into a fixed number of pieces (independent of the thread count), each piece's partial sums
// computed by one thread, then added in piece order: the values do not depend on the thread count. Rows are taken
// eight at a time, each group one pass over the weight. Releases the GIL. Raises (c10::Error) on wrong shapes or
// dtypes, or where this build has no vector path.
at::Tensor fp32_gemv(const at::Tensor& x, const at::Tensor& weight);
