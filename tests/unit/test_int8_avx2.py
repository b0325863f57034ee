"""The AVX2 int8 product (`csrc/int8_gemm.cpp`): exact int32 sums scaled as `torch._int_mm`'s, on odd shapes, every
int8 activation value, any thread count; offered to the kernel chooser as "avx2"."""

from __future__ import annotations

import pytest
import torch

from asyncllm.model.kernels.choice import ROW_CLASSES, KernelChooser
from asyncllm.model.kernels.int8 import INT8_PRODUCT, quantize_int8
from asyncllm.model.kernels.linear import linear
from asyncllm.model.kernels.row_quant import quantize_rows
from tests.kernel_checks import require_kernels


def _exact(qx: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (qx.double() @ qweight.double()).float() * scale  # float64 sums of int8 products are exact


@pytest.mark.parametrize(("in_features", "out_features"), [(576, 1536), (577, 13), (3, 8), (1536, 9), (64, 200)])
def test_values_are_the_exact_sums_scaled(in_features: int, out_features: int) -> None:
    kernels = require_kernels()
    if not kernels.int8_avx2_available():
        pytest.skip("this CPU has no AVX2")
    gen = torch.Generator().manual_seed(in_features + out_features)
    qweight = torch.randint(-127, 128, (in_features, out_features), generator=gen, dtype=torch.int8)
    qweight[:, 0], qweight[:, -1] = 127, -127  # against rows of -128 / 127 the largest pair sums (32512, no saturation)
    scale = torch.rand(out_features, generator=gen) + 0.01
    packed = kernels.int8_pack_avx2(qweight)
    assert packed.shape == (-(-out_features // 8), -(-in_features // 4), 8, 4)
    for rows in (1, 2, 3, 4, 5, 9, 33):
        qx = torch.randint(-128, 128, (rows, in_features), generator=gen, dtype=torch.int8)
        qx[0], qx[-1] = -128, 127
        got = kernels.int8_gemm_avx2(qx, packed, scale, in_features, out_features)
        assert torch.equal(got, _exact(qx, qweight, scale)), rows
        if in_features % 8 == 0 and rows > 16:  # shapes torch._int_mm takes: the same bits
            assert torch.equal(got, torch._int_mm(qx, qweight).float() * scale)


def test_values_do_not_depend_on_the_thread_count_or_the_batch() -> None:
    kernels = require_kernels()
    if not kernels.int8_avx2_available():
        pytest.skip("this CPU has no AVX2")
    gen = torch.Generator().manual_seed(1)
    qweight = torch.randint(-127, 128, (576, 1536), generator=gen, dtype=torch.int8)
    scale = torch.rand(1536, generator=gen)
    packed = kernels.int8_pack_avx2(qweight)
    qx = torch.randint(-127, 128, (7, 576), generator=gen, dtype=torch.int8)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernels.int8_gemm_avx2(qx, packed, scale, 576, 1536)
        torch.set_num_threads(2)
        two = kernels.int8_gemm_avx2(qx, packed, scale, 576, 1536)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    assert torch.equal(kernels.int8_gemm_avx2(qx[3:4], packed, scale, 576, 1536), one[3:4])


def test_bad_operands_are_refused() -> None:
    kernels = require_kernels()
    if not kernels.int8_avx2_available():
        pytest.skip("this CPU has no AVX2")
    weight = torch.zeros(8, 8, dtype=torch.int8)
    weight[0, 0] = -128
    with pytest.raises(RuntimeError, match="-128"):
        kernels.int8_pack_avx2(weight)
    packed = kernels.int8_pack_avx2(torch.ones(8, 8, dtype=torch.int8))
    with pytest.raises(RuntimeError, match="not int8_pack_avx2's"):
        kernels.int8_gemm_avx2(torch.ones(2, 12, dtype=torch.int8), packed, torch.ones(8), 12, 8)
    six_inputs = kernels.int8_pack_avx2(torch.ones(6, 8, dtype=torch.int8))  # 2 quads, as 7 or 8 inputs would give
    with pytest.raises(RuntimeError, match="activations of 7 features for a weight of 6 input features"):
        kernels.int8_gemm_avx2(torch.ones(2, 7, dtype=torch.int8), six_inputs, torch.ones(8), 6, 8)  # once accepted
    with pytest.raises(RuntimeError, match="scale must be float32 with 8"):
        kernels.int8_gemm_avx2(torch.ones(2, 8, dtype=torch.int8), packed, torch.ones(9), 8, 8)


def test_the_chooser_can_run_it_in_a_model_product(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Forced, it passes the chooser's own check and serves every row class of `linear`."""
    kernels = require_kernels()
    if not kernels.int8_avx2_available():
        pytest.skip("this CPU has no AVX2")
    gen = torch.Generator().manual_seed(2)
    weight = quantize_int8(torch.randn(576, 200, generator=gen), KernelChooser(INT8_PRODUCT, "avx2", tmp_path))
    assert weight.choice is not None
    assert weight.choice.kernels == ("avx2",) * len(ROW_CLASSES)
    x = torch.randn(40, 576, generator=gen)
    qx, x_scale = quantize_rows(x)
    assert torch.equal(linear(x, weight), _exact(qx, weight.qweight, weight.scale) * x_scale)
