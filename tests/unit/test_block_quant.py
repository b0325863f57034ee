"""Block-quantized weights and their C++ kernels (`model/kernels/block_quant.py`, `csrc/block_quant.cpp`): every
path this CPU has equals the numpy reference bit for bit (exact integer block sums, then the same float32 steps) on
1 row and many, odd output counts and zero blocks; values independent of the thread count and of the batch; the
quantizers' error within half a step; the real GGUF file's Q4_1 and Q8_0 blocks kept exactly as
`gguf.quants.dequantize` reads them."""

from __future__ import annotations

import json
import math
import pathlib

import numpy as np
import pytest
import torch

from asyncllm.model.kernels import block_quant
from asyncllm.model.kernels.block_quant import (
    BlockQuantWeight,
    BlockShapeError,
    FileBlocks,
    block_linear,
    from_values,
    quantize_blocks,
    reference_block_linear,
)
from asyncllm.model.kernels.row_kernels import RowKernels
from tests.kernel_checks import require_kernels

KINDS = ("q8_0", "q4_0", "q4_1")
KIND_CODE = block_quant.KIND_CODES


@pytest.fixture(scope="module")
def kernels() -> RowKernels:
    return require_kernels()


@pytest.fixture(scope="module")
def paths(kernels: RowKernels) -> list[str]:
    """Every path this build has; on an AVX-512 VNNI host all three (AVX2 and scalar forced by argument)."""
    found = list(kernels.block_quant_paths())
    assert found[-1] == "scalar"
    return found


def _weight(in_features: int, out_features: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    w = torch.randn(in_features, out_features, generator=generator) * 0.05
    w[:32, 0] = 0.0  # a block of zeros (scale 0)
    w[32:64, -1] = 0.3  # a constant block (Q4_1: d = 0)
    w[:, out_features // 2] *= 40  # an outlier column
    return w


def _input(rows: int, in_features: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_features, generator=generator) * 2
    x[0, :32] = 0.0  # an input block of zeros
    x[-1, 32:64] = 1000.0  # a constant large block (every value 127)
    return x


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("rows", "in_features", "out_features"), [(1, 576, 963), (5, 96, 13), (64, 576, 37)])
def test_every_path_equals_the_numpy_reference_bit_for_bit(
    kernels: RowKernels, paths: list[str], kind: str, rows: int, in_features: int, out_features: int
) -> None:
    weight = quantize_blocks(_weight(in_features, out_features, rows), kind)  # type: ignore[arg-type]
    x = _input(rows, in_features, rows + 1)
    want = reference_block_linear(x, weight)
    for path in paths:
        got = block_linear(x, weight, path)
        assert got.shape == (rows, out_features)
        assert torch.equal(got, want), (kind, path, float((got - want).abs().max()))


# the 6-row tile's edges, the GEMMs' thresholds (6; avx2 Q8_0: 24) and the 4-row tile's rests after them
GEMM_ROWS = (1, 3, 4, 5, 6, 7, 11, 12, 13, 15, 16, 17, 23, 24, 25, 26, 27, 63, 64, 65, 257)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("in_features", "out_features"), [(64, 13), (96, 37), (160, 47)])
def test_the_many_row_gemm_equals_the_reference_at_every_tile_edge(
    kernels: RowKernels, paths: list[str], kind: str, in_features: int, out_features: int
) -> None:
    """Row counts around the GEMMs' thresholds (vnni and avx2 Q4: 6; avx2 Q8_0: 24) and their tiles (vnni: 6 rows x
    32 columns; avx2: 4 rows x 8 or 16), column counts that are no multiple of 8, 16 or 32 (13: one part panel; 37,
    47: full tiles of 2 panels and a part one): bit for bit."""
    weight = quantize_blocks(_weight(in_features, out_features, out_features), kind)  # type: ignore[arg-type]
    x = _input(max(GEMM_ROWS), in_features, in_features)
    want = reference_block_linear(x, weight)
    for rows in GEMM_ROWS:
        for path in paths:
            got = block_linear(x[:rows].contiguous(), weight, path)
            assert torch.equal(got, want[:rows]), (kind, rows, path, float((got - want[:rows]).abs().max()))


@pytest.mark.parametrize("kind", KINDS)
def test_a_row_gets_the_same_bits_alone_and_inside_a_64_row_batch(kernels: RowKernels, kind: str) -> None:
    """A row alone goes through the GEMV, inside 64 rows through the GEMM (vnni) at each of the 6 places of a row
    tile: the same bits, and equal to the reference's, on the best path."""
    weight = quantize_blocks(_weight(576, 100, 11), kind)  # type: ignore[arg-type]
    batch = _input(64, 576, 12)
    many = block_linear(batch, weight)
    for i in (0, 1, 2, 3, 4, 5, 31, 62, 63):
        alone = block_linear(batch[i : i + 1].contiguous(), weight)
        assert torch.equal(alone[0], many[i]), (kind, i)
    assert torch.equal(many, reference_block_linear(batch, weight))


@pytest.mark.parametrize("kind", KINDS)
def test_the_reference_is_the_product_of_the_dequantized_weight_within_activation_rounding(kind: str) -> None:
    """The reference itself against float64 `x @ dequantize()`: only the int8 activation blocks differ (at most
    half a step, d_x / 2, per value), so the error is bounded by sum |w| * d_x / 2 per output."""
    w = quantize_blocks(_weight(256, 24, 7), kind)  # type: ignore[arg-type]
    x = _input(6, 256, 8)
    dense = w.dequantize().double()
    exact = x.double() @ dense
    blocks = x.reshape(6, -1, 32)
    half_step = (blocks.abs().amax(-1) / 127 / 2).repeat_interleave(32, dim=1).double()  # [rows, in]
    bound = half_step @ dense.abs() * 1.001 + 1e-4 * exact.abs() + 1e-5
    assert ((reference_block_linear(x, w).double() - exact).abs() <= bound).all()


@pytest.mark.parametrize("kind", KINDS)
def test_quantization_error_is_within_half_a_step_or_the_q4_0_clamp(kind: str) -> None:
    w = _weight(128, 10, 3)
    blocks = quantize_blocks(w, kind)  # type: ignore[arg-type]
    assert blocks.shape == (128, 10)
    error = (blocks.dequantize() - w).abs().reshape(4, 32, 10)
    _, d, _ = blocks.values()  # [out, nb]
    step = d.abs().t()[:, None, :]  # [nb, 1, out]
    # half a step, plus float16 rounding of the scale (and the minimum) over the block's largest value
    scale_rounding = w.abs().reshape(4, 32, 10).amax(1, keepdim=True) * 2**-10
    # Q4_0 reaches -8 d but only +7 d: a value opposite the block's peak may clamp a whole step short
    allowed = step if kind == "q4_0" else step / 2
    assert (error <= allowed + scale_rounding + 1e-7).all()
    assert blocks.dequantize()[:32, 0].eq(0).all()  # the zero block stays zero


def test_bytes_per_value() -> None:
    w = _weight(576, 960, 0)
    sizes = {kind: quantize_blocks(w, kind).nbytes for kind in KINDS}  # type: ignore[arg-type]
    values = 576 * 960
    assert sizes["q8_0"] == values + values // 32 * 2  # 8.5 bits per value
    assert sizes["q4_0"] == values // 2 + values // 32 * 2  # 4.5 bits
    assert sizes["q4_1"] == values // 2 + values // 32 * 4  # 5 bits


@pytest.mark.parametrize("kind", KINDS)
def test_values_do_not_depend_on_the_thread_count_or_the_batch(kernels: RowKernels, kind: str) -> None:
    weight = quantize_blocks(_weight(576, 1536, 1), kind)  # type: ignore[arg-type]
    x = _input(33, 576, 2)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = block_linear(x, weight)
        solo = torch.cat([block_linear(x[i : i + 1], weight) for i in range(x.shape[0])])
    finally:
        torch.set_num_threads(threads)
    torch.set_num_threads(max(2, threads))
    try:
        many = block_linear(x, weight)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, many)
    assert torch.equal(one, solo)


@pytest.mark.parametrize("kind", KINDS)
def test_the_few_row_gemv_gives_the_same_bits_on_one_thread_and_two(kernels: RowKernels, kind: str) -> None:
    """1-5 rows take the GEMV (vnni: chunks of 16 columns shared out to threads from 2 chunks at 576 inputs);
    1000 columns end in a part chunk of 2 groups. Split over 2 threads, alone on one and the reference: equal."""
    weight = quantize_blocks(_weight(576, 1000, 5), kind)  # type: ignore[arg-type]
    x = _input(5, 576, 6)
    want = reference_block_linear(x, weight)
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            for rows in range(1, 6):
                got = block_linear(x[:rows].contiguous(), weight)
                assert torch.equal(got, want[:rows]), (kind, count, rows, float((got - want[:rows]).abs().max()))
    finally:
        torch.set_num_threads(threads)


def test_the_activation_blocks_equal_the_reference_ties_to_even_included(kernels: RowKernels) -> None:
    """`block_quantize_rows` (vectorized where the CPU has AVX-512) against `reference_quantize_rows`: a block whose
    scale is exactly 1 with values at half steps (2.5 -> 2, -3.5 -> -4, 0.5 -> 0: ties to even), a zero block, a
    block of negatives, random rows."""
    x = _input(3, 160, 7)
    x[1, :32] = torch.tensor([127.0, 2.5, -3.5, 0.5, -0.5, 1.5] + [0.0] * 26)
    x[1, 64:96] = 0.0
    x[2, 96:128] = -torch.arange(1.0, 33.0)
    q, d, s = kernels.block_quantize_rows(x)
    rq, rd, rs = block_quant.reference_quantize_rows(x.numpy())
    assert q.tolist()[1][:6] == [127, 2, -4, 0, 0, 2]
    assert np.array_equal(q.numpy().reshape(rq.shape), rq)
    assert np.array_equal(d.numpy(), rd)
    assert np.array_equal(s.numpy(), rs)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("rows", "hidden", "inter"), [(1, 96, 160), (3, 96, 160), (8, 96, 160), (1100, 256, 256)])
def test_the_fused_call_gives_the_separate_calls_bits(
    kernels: RowKernels, kind: str, rows: int, hidden: int, inter: int
) -> None:
    """`fused_block_linear` (RMSNorm or SiLU x mul before the product, the residual added after, in one call)
    equals `block_linear(kernels.rms_norm(x) / kernels.silu_mul(x)) + residual` bit for bit: GEMV and GEMM rows,
    and 1100 x 256 inputs, past the per-thread scratch (256 K values: a prefill chunk's rows get tensors of their
    own)."""
    chosen = block_quant.block_kernels()
    assert chosen is not None
    module, path = chosen
    norm = torch.rand(hidden, generator=torch.Generator().manual_seed(3)) + 0.5
    x = _input(rows, hidden, 8)
    gate_up = _input(rows, 2 * inter, 9)
    residual = _input(rows, hidden, 10)
    w_in = quantize_blocks(_weight(hidden, 2 * inter, 12), kind)  # type: ignore[arg-type]
    w_out = quantize_blocks(_weight(inter, hidden, 13), kind)  # type: ignore[arg-type]
    w_sq = quantize_blocks(_weight(hidden, hidden, 14), kind)  # type: ignore[arg-type]
    fused = block_quant.fused_block_linear
    normed = fused(module, path, x, w_in, "rms_norm", norm, 1e-5)
    assert torch.equal(normed, block_linear(kernels.rms_norm(x, norm, 1e-5), w_in, path))
    down = fused(module, path, gate_up, w_out, "silu_mul", residual=residual)
    assert torch.equal(down, block_linear(kernels.silu_mul(gate_up), w_out, path).add_(residual))
    plain = fused(module, path, x, w_sq, residual=residual)
    assert torch.equal(plain, block_linear(x, w_sq, path) + residual)
    with pytest.raises(RuntimeError, match="residual"):
        fused(module, path, x, w_sq, residual=residual[:, :32].contiguous())
    with pytest.raises(RuntimeError, match="prologue"):
        module.block_linear_fused(x, 3, None, 0.0, None, w_sq.qs, w_sq.d, w_sq.d, KIND_CODE[kind], hidden, path)


def test_dequantize_columns_equals_the_dense_columns() -> None:
    weight = quantize_blocks(_weight(64, 11, 4), "q4_0")
    columns = torch.tensor([10, 0, 5, 5])
    assert torch.equal(weight.dequantize_columns(columns), weight.dequantize().t()[columns])


@pytest.mark.parametrize("kind", KINDS)
def test_the_column_dequantizing_kernel_gives_the_torch_ops_bits(kernels: RowKernels, kind: str) -> None:
    """`block_dequantize_columns` (a tied model's embedding lookup) equals the torch ops bit for bit, on columns in
    any order, repeated, in the last (part) group, at 1 and 2 threads; refuses a column past the padded ones."""
    weight = quantize_blocks(_weight(576, 963, 7), kind)  # type: ignore[arg-type]
    m = weight.m if weight.m is not None else torch.empty(0, dtype=torch.float16)
    columns = torch.tensor([962, 0, 481, 17, 17, 960, 3] * 20)  # 140 columns: split at 2 threads
    want = weight.reference_dequantize_columns(columns)
    threads = torch.get_num_threads()
    try:
        for num_threads in (1, 2):
            torch.set_num_threads(num_threads)
            got = kernels.block_dequantize_columns(weight.qs, weight.d, m, KIND_CODE[kind], 576, columns)
            assert torch.equal(got, want)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(weight.dequantize_columns(columns[:3]), want[:3])  # the method takes the kernel
    assert torch.equal(want[:, :32].abs().amax(1)[1:2], torch.zeros(1))  # column 0's block of zeros...
    assert want[0].abs().amax() > 0  # ...and real values elsewhere
    with pytest.raises(IndexError, match="outside"):
        kernels.block_dequantize_columns(weight.qs, weight.d, m, KIND_CODE[kind], 576, torch.tensor([964]))


def test_bad_shapes_and_paths_are_refused(kernels: RowKernels) -> None:
    with pytest.raises(BlockShapeError, match="blocks of 32"):
        quantize_blocks(torch.zeros(48, 4), "q8_0")
    with pytest.raises(ValueError, match="unknown block kind"):
        quantize_blocks(torch.zeros(32, 4), "q5_0")  # type: ignore[arg-type]
    weight = quantize_blocks(_weight(64, 5, 0), "q8_0")
    with pytest.raises(RuntimeError, match="not in this build"):
        block_linear(torch.zeros(1, 64), weight, "neon")
    with pytest.raises(RuntimeError, match="multiple of 32"):
        kernels.block_linear(torch.zeros(1, 40), weight.qs, weight.d, torch.empty(0, dtype=torch.float16), 0, 5, "")


def test_the_start_up_check_passes_on_the_best_path(kernels: RowKernels) -> None:
    chosen = block_quant.block_kernels()
    assert chosen is not None
    assert chosen[1] == kernels.block_quant_paths()[0]
    assert block_quant.self_check(kernels, "scalar") == ""


def _gguf_tensors(model_path: str, types: set[str]) -> list[tuple[str, str, np.ndarray, torch.Tensor]]:
    """(name, type, raw blocks [out, row bytes], gguf's dequantized float32 [out, in]) of the first tensor of each of
    `types` in the file, plus the first layer's attention output of Q4_1."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(pathlib.Path(model_path))
    found = []
    for tensor in reader.tensors:
        kind = tensor.tensor_type.name
        if kind in types and (tensor.name == "token_embd.weight" or tensor.name.startswith("blk.0.")):
            raw = np.asarray(tensor.data)
            values = torch.from_numpy(np.array(dequantize(raw, tensor.tensor_type), dtype=np.float32))
            found.append((tensor.name, kind, raw, values.reshape(raw.shape[0], -1)))
    return found


def test_the_real_files_q4_1_and_q8_0_blocks_are_kept_exactly(model_path: str) -> None:
    """Every Q4_1 tensor of layer 0 and the Q8_0 token embedding: the blocks `from_values` finds dequantize to
    gguf's values bit for bit, and their scales are the file's own float16 bits."""
    tensors = _gguf_tensors(model_path, {"Q4_1", "Q8_0"})
    assert {kind for _, kind, _, _ in tensors} == {"Q4_1", "Q8_0"}
    for name, kind, raw, values in tensors:
        blocks = from_values(values.t(), kind.lower())  # type: ignore[arg-type]
        assert blocks is not None, name
        assert torch.equal(blocks.dequantize(), values.t()), name
        _, d, m = blocks.values()
        per_block = raw.reshape(raw.shape[0], -1, 20 if kind == "Q4_1" else 34)
        file_d = torch.from_numpy(per_block[..., :2].copy().view(np.float16)[..., 0].astype(np.float32))
        assert torch.equal(d, file_d), name
        if kind == "Q4_1":
            assert m is not None
            file_m = torch.from_numpy(per_block[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32))
            assert torch.equal(m, file_m), name


def test_values_of_another_block_type_are_not_taken_as_exact(model_path: str) -> None:
    """Q4_1 values are not Q4_0 blocks: `from_values` says so (None) instead of keeping an approximation."""
    (_, _, _, values), *_ = _gguf_tensors(model_path, {"Q4_1"})
    assert from_values(values.t(), "q4_0") is None
    assert isinstance(from_values(values.t(), "q4_1"), BlockQuantWeight)
    assert math.prod(values.shape) > 0


def test_engine_args_take_the_block_modes_and_refuse_what_cannot_run() -> None:
    import argparse

    from asyncllm.config import EngineArgs
    from asyncllm.entrypoints.arg_utils import add_engine_args, engine_args_from
    from asyncllm.errors import ConfigError

    for mode in ("q8_0", "q4_0", "gguf"):
        EngineArgs(quantization=mode).validate()  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match="tensor_parallel_size > 1"):
            EngineArgs(quantization=mode, tensor_parallel_size=2).validate()  # type: ignore[arg-type]
        EngineArgs(quantization=mode, enable_lora=True).validate()  # type: ignore[arg-type]  # adapters run on blocks
    with pytest.raises(ConfigError, match="'q8_0', 'q4_0' or 'gguf'"):
        EngineArgs(quantization="q4_k").validate()  # type: ignore[arg-type]
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_args_from(parser.parse_args(["--quantization", "gguf"]), "m").quantization == "gguf"
    with pytest.raises(SystemExit):
        parser.parse_args(["--quantization", "q4_k"])


def test_gguf_mode_keeps_exact_blocks_and_requantizes_the_rest() -> None:
    from asyncllm.model.kernels.block_quant import block_weight_for

    w = _weight(64, 8, 9)
    q4_1_values = quantize_blocks(w, "q4_1").dequantize()
    kept, how = block_weight_for(q4_1_values, "gguf")
    assert how == "kept q4_1"
    assert torch.equal(kept.dequantize(), q4_1_values)
    requantized, how = block_weight_for(w, "gguf")  # float values: no block type gives them exactly
    assert how == "requantized q8_0"
    assert requantized.kind == "q8_0"
    assert block_weight_for(w, "q4_0")[1] == "quantized q4_0"
    assert block_weight_for(w, "q4_0", lm_head=True)[1] == "quantized q8_0"
    with pytest.raises(ValueError, match="unknown block quantization mode"):
        block_weight_for(w, "int8")


def test_the_path_environment_variable_forces_a_checked_path(
    kernels: RowKernels, monkeypatch: pytest.MonkeyPatch
) -> None:
    slower = kernels.block_quant_paths()[-1]  # "scalar": every build has it
    monkeypatch.setenv(block_quant.PATH_ENV, slower)
    block_quant.block_kernels.cache_clear()
    try:
        chosen = block_quant.block_kernels()
        assert chosen is not None
        assert chosen[1] == slower
        weight = quantize_blocks(_weight(64, 6, 5), "q4_1")
        x = _input(2, 64, 6)
        assert torch.equal(block_linear(x, weight), reference_block_linear(x, weight))
    finally:
        monkeypatch.delenv(block_quant.PATH_ENV)
        block_quant.block_kernels.cache_clear()
    best = block_quant.block_kernels()
    assert best is not None
    assert best[1] == kernels.block_quant_paths()[0]


def _same_blocks(got: BlockQuantWeight, want: BlockQuantWeight) -> bool:
    """Kind, shape, values and the float16 bits of scales and minimums all equal."""
    if (got.kind, got.shape) != (want.kind, want.shape) or (got.m is None) != (want.m is None):
        return False
    same_m = got.m is None or want.m is None or torch.equal(got.m.view(torch.int16), want.m.view(torch.int16))
    return torch.equal(got.qs, want.qs) and torch.equal(got.d.view(torch.int16), want.d.view(torch.int16)) and same_m


@pytest.mark.parametrize(("kind", "qtype"), [("q8_0", 8), ("q4_0", 2), ("q4_1", 3)])
def test_a_files_bytes_give_the_blocks_the_values_route_finds(kind: str, qtype: int) -> None:
    """`FileBlocks` (a GGUF tensor's own bytes, as `gguf.quants.quantize` writes them) regrouped without
    dequantizing equal, bit for bit, the blocks `from_values` finds in `gguf.quants.dequantize`'s values; its
    `dequantize` is those values; rows split and concatenated like a tensor's stay the same blocks."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    weight = _weight(96, 11, seed=5)  # [in, out]; 11 outputs: a zero-padded last group
    raw = quantize(weight.t().contiguous().numpy(), GGMLQuantizationType(qtype))  # [out, row bytes]
    blocks = FileBlocks(kind, torch.from_numpy(raw).reshape(11, 3, -1))  # type: ignore[arg-type]
    values = torch.from_numpy(np.array(dequantize(raw, GGMLQuantizationType(qtype)), dtype=np.float32))
    assert torch.equal(blocks.dequantize(), values)
    want = from_values(values.t().contiguous(), kind)  # type: ignore[arg-type]
    assert want is not None
    assert _same_blocks(blocks.to_weight(), want)
    rejoined = FileBlocks.concat([FileBlocks(blocks.kind, part) for part in blocks.raw.split([4, 7])])
    assert rejoined is not None
    assert _same_blocks(rejoined.to_weight(), want)
    other = "q8_0" if kind != "q8_0" else "q4_0"
    assert FileBlocks.concat([blocks, FileBlocks(other, blocks.raw)]) is None


def test_the_decode_stack_adds_qkv_biases_as_the_layer_calls_do(tmp_path: pathlib.Path, kernels: RowKernels) -> None:
    """A tiny Qwen2 (q/k/v biases, random, with random weights) in blocks: a decode step of 2 sequences through the
    decode stack equals the per-layer calls bit for bit (the SmolLM2 tests have no biases)."""
    from asyncllm.config import ModelConfig
    from asyncllm.model.layers.attention_metadata import build_attention_metadata
    from asyncllm.model.llama import LlamaForCausalLM
    from asyncllm.model.loading.loader import load_model
    from tests.model_weights import randomize_matrices
    from tests.unit.test_quant import TINY_LLAMA

    config = {**TINY_LLAMA, "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = load_model(ModelConfig("tiny", str(tmp_path), load_format="dummy"))
    assert isinstance(model, LlamaForCausalLM)
    randomize_matrices(model)
    gen = torch.Generator().manual_seed(2)
    for layer in model.layers:
        assert layer.qkv_bias is not None
        layer.qkv_bias.copy_(torch.randn(layer.qkv_bias.shape, generator=gen))
    model.quantize_blocks("q8_0")
    arch = model.arch
    shape = (8, 2, 8, arch.num_key_value_heads, arch.head_dim)
    base = [torch.randn(shape, generator=gen) for _ in range(arch.num_hidden_layers)]
    meta = build_attention_metadata([1, 1], [13, 29], [[0, 1], [4, 5, 6, 7]], 8)
    results = []
    for fused in (False, True):
        model.fuse_decode_layers = fused
        caches = [c.clone() for c in base]
        with torch.inference_mode():
            results.append((model(torch.tensor([5, 300]), torch.tensor([12, 28]), caches, meta), caches))
    assert model._decode_stacks.last is not None
    assert torch.equal(results[0][0], results[1][0])
    assert all(torch.equal(a, b) for a, b in zip(results[0][1], results[1][1], strict=True))
    model.fuse_decode_layers = False
    for layer in model.layers:
        layer.qkv_bias.zero_()  # the biases matter: without them the step differs
    with torch.inference_mode():
        unbiased = model(torch.tensor([5, 300]), torch.tensor([12, 28]), [c.clone() for c in base], meta)
    assert not torch.equal(unbiased, results[1][0])
