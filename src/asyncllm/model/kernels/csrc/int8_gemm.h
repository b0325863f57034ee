// Products of int8 activations and an int8 weight with exact int32 sums, on AVX2 (`vpmaddubsw` + `vpmaddwd`, for
// CPUs whose torch and oneDNN int8 products are slow or wrong) and on AVX-512 VNNI (`vpdpbusd`) (int8_gemm.cpp;
// asyncllm/model/kernels/int8.py offers them to the kernel chooser as "avx2" and "vnni").
#pragma once
#include <torch/extension.h>

#include <tuple>

// Whether this build has the AVX2 path (compiled with -march=native on a CPU with AVX2).
bool int8_avx2_available();

// qweight [in, out] int8, every value in [-127, 127] (symmetric quantization never gives -128) -> the packed weight:
// uint8 [ceil(out / 8), ceil(in / 4), 8, 4]: panels of 8 columns, each a run of 4-value quads of those columns,
// zero-padded. Raises (c10::Error) on a wrong dtype or shape or a value of -128.
at::Tensor int8_pack_avx2(const at::Tensor& qweight);

// qx [rows, in_features] int8 (any value) times the packed weight of `in_features` x `out_features` (the packed shape
// holds the input count only in quads of 4, so the caller names it) -> [rows, out_features] float32,
// float(sum_k qx[r, k] * qweight[k, n]) * scale[n] with the int32 sum exact: the values `torch._int_mm(qx, qweight)
// .float() * scale` gives, bit for bit. Columns are shared out to threads in pairs of panels, each output summed by
// one thread, so values do not depend on the thread count or on the other rows. Releases the GIL. Raises
// (c10::Error) on wrong shapes or dtypes, or where this build has no AVX2 path.
at::Tensor int8_gemm_avx2(const at::Tensor& qx, const at::Tensor& packed, const at::Tensor& scale,
                          int64_t in_features, int64_t out_features);

// Whether this build has the AVX-512 VNNI path (compiled with -march=native on a CPU with AVX-512 F, BW and VNNI).
bool int8_vnni_available();

// qweight [in, out] int8 (any value) -> (packed, correction): packed uint8 [ceil(out / 16), ceil(in / 4), 16, 4],
// panels of 16 columns, each a run of 4-value quads of those columns, zero-padded; correction int32 [out],
// 128 * sum_k qweight[k, n] (modulo 2^32). Raises (c10::Error) on a wrong dtype or shape.
std::tuple<at::Tensor, at::Tensor> int8_pack_vnni(const at::Tensor& qweight);

// As int8_gemm_avx2, on int8_pack_vnni's packed weight and correction: [rows, out_features] float32,
// float(sum_k qx[r, k] * qweight[k, n]) * scale[n] with the int32 sum exact (`torch._int_mm`'s values bit for bit).
// Columns are shared out to threads in groups of 4 panels; values do not depend on the thread count or on the other
// rows. Releases the GIL. Raises (c10::Error) on wrong shapes or dtypes, or where this build has no VNNI path.
at::Tensor int8_gemm_vnni(const at::Tensor& qx, const at::Tensor& packed, const at::Tensor& correction,
                          const at::Tensor& scale, int64_t in_features, int64_t out_features);
