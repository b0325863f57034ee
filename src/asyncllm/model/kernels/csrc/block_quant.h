// Products with weights kept as blocks of 32 quantized values along the input dimension (Q8_0, Q4_0, Q4_1, the
// block types of llama.cpp's GGUF files), activations quantized per block of 32 to int8, integer dot products
// (block_quant.cpp; asyncllm/model/kernels/block_quant.py prepares the weights and documents the layout).
#pragma once
#include <torch/extension.h>

// The fastest path this build and process have for block products: "amx" (AMX int8 tiles from 16 rows, else as
// "vnni"), "vnni" (AVX-512 VNNI), "avx2" or "scalar". The vector paths are chosen when the module is compiled for
// this CPU (-march=native); "amx" also needs the CPU's AMX-TILE / AMX-INT8 flags and Linux's permission for the tile
// data, asked at the first call (block_quant_amx_status).
std::string block_quant_best_path();

// The paths this build and process have, best first (a subset of "amx", "vnni", "avx2", "scalar"; "scalar" always).
std::vector<std::string> block_quant_paths();

// "" when the "amx" path is offered, else why not (no AMX in this build, on this CPU, or Linux refused the tile data
// permission). The permission is asked once per process (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA).
std::string block_quant_amx_status();

// x [rows, in] float32 contiguous, in a multiple of 32 -> (q [rows, in] int8, d [rows, in / 32] float32,
// s [rows, in / 32] int32): per block of 32, d = max|x| / 127, q = round_half_even(x / d) (0 where d == 0),
// s = the sum of the block's q. Raises (c10::Error) on a wrong dtype or shape.
std::vector<at::Tensor> block_quantize_rows(const at::Tensor& x);

// x [rows, in] float32 times a block weight of `out_features` columns -> [rows, out_features] float32.
// kind: 0 = Q8_0, 1 = Q4_0, 2 = Q4_1. Weight layout (columns in groups of 4, the last group zero-padded; nb = in / 32):
// qs uint8 [groups, nb, 4, 32] (Q8_0, int8 values) or [groups, nb, 4, 16] (Q4: byte j holds value j in its low and
// value j + 16 in its high nibble), d float16 [groups, nb, 4] scales, m float16 [groups, nb, 4] minimums (Q4_1; else
// an empty tensor). Per output (row, column), over blocks in order, in float32 without fused multiply-adds:
//   Q8_0: acc += float(dot) * (dw * dx);  Q4_0: acc += float(dot - 8 * s) * (dw * dx);
//   Q4_1: acc += float(dot) * (dw * dx) + (mw * dx) * float(s)
// with dot the exact integer sum over the block, so every path gives the same bits, and a column's value does not
// depend on the thread count or on the other rows (nor on whether a GEMV (1-5 rows; on "vnni" and "amx" over
// chunks of 16 columns) or, from 6 rows, the GEMM serves them: "vnni" every kind, "avx2" Q4_0 / Q4_1 (Q8_0 from 24
// rows); from 16 rows the AMX GEMM on "amx"). path: "" (the best) or one of block_quant_paths(). The activation
// blocks of inputs up to 256 K values live in a per-thread scratch (no allocation but the output).
// Releases the GIL. Raises (c10::Error) on wrong shapes or dtypes or a path this build does not have.
at::Tensor block_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d, const at::Tensor& m,
                        int64_t kind, int64_t out_features, const std::string& path);

// Columns of a block weight (layout as block_linear's; groups = d.numel() / (in_features / 32 * 4)) dequantized, as
// rows: columns [n] int64 -> [n, in_features] float32 with, per block, Q8_0 float(q) * d, Q4_0 float(q - 8) * d,
// Q4_1 d * float(q) + m (float32, no fused multiply-add: the values BlockQuantWeight.dequantize_columns gives in torch
// ops, bit for bit). A tied model's embedding lookup in its block LM head. Raises (c10::Error) on wrong shapes or
// dtypes, IndexError for a column outside the weight's padded columns.
at::Tensor block_dequantize_columns(const at::Tensor& qs, const at::Tensor& d, const at::Tensor& m, int64_t kind,
                                    int64_t in_features, const at::Tensor& columns);
