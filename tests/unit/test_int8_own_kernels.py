"""asyncllm's own int8 products (`csrc/int8_gemm.cpp`): the AVX2 one ("avx2") and the AVX-512 VNNI one ("vnni"), each
exact int32 sums scaled as `torch._int_mm`'s, on odd shapes, every int8 activation value, any thread count; offered
to the kernel chooser under those names."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from asyncllm.model.kernels.choice import ROW_CLASSES, KernelChooser
from asyncllm.model.kernels.int8 import INT8_PRODUCT, quantize_int8
from asyncllm.model.kernels.linear import linear
from asyncllm.model.kernels.row_quant import quantize_rows
from tests.kernel_checks import require_kernels

KERNELS = ("avx2", "vnni")
Product = Callable[[torch.Tensor], torch.Tensor]  # qx -> [rows, out] float32


def _exact(qx: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (qx.double() @ qweight.double()).float() * scale  # float64 sums of int8 products are exact


def _kernels_with(name: str) -> Any:
    kernels = require_kernels()
    if not getattr(kernels, f"int8_{name}_available")():
        pytest.skip(f"this CPU or build has no {name} int8 path")
    return kernels


def _packed_product(name: str, qweight: torch.Tensor, scale: torch.Tensor) -> Product:
    """`name`'s product with `qweight` packed once."""
    kernels = _kernels_with(name)
    in_features, out_features = qweight.shape
    if name == "avx2":
        packed = kernels.int8_pack_avx2(qweight)
        assert packed.shape == (-(-out_features // 8), -(-in_features // 4), 8, 4)
        return lambda qx: kernels.int8_gemm_avx2(qx, packed, scale, in_features, out_features)
    packed, correction = kernels.int8_pack_vnni(qweight)
    assert packed.shape == (-(-out_features // 16), -(-in_features // 4), 16, 4)
    assert torch.equal(correction, qweight.long().sum(0).mul(128).int())
    return lambda qx: kernels.int8_gemm_vnni(qx, packed, correction, scale, in_features, out_features)


@pytest.mark.parametrize("name", KERNELS)
@pytest.mark.parametrize(
    ("in_features", "out_features"), [(576, 1536), (577, 13), (3, 8), (1536, 9), (64, 200), (576, 80), (40, 49)]
)
def test_values_are_the_exact_sums_scaled(name: str, in_features: int, out_features: int) -> None:
    """Row counts around the 4-row tiles and the VNNI path's 48-row blocks, column counts around the panels (8 / 16
    columns) and the 4-panel groups."""
    gen = torch.Generator().manual_seed(in_features + out_features)
    qweight = torch.randint(-127, 128, (in_features, out_features), generator=gen, dtype=torch.int8)
    qweight[:, 0], qweight[:, -1] = 127, -127  # against rows of -128 / 127 the largest pair sums (32512, no saturation)
    scale = torch.rand(out_features, generator=gen) + 0.01
    product = _packed_product(name, qweight, scale)
    for rows in (1, 2, 3, 4, 5, 8, 9, 33, 101):  # 101: three blocks of rows on the VNNI path
        qx = torch.randint(-128, 128, (rows, in_features), generator=gen, dtype=torch.int8)
        qx[0], qx[-1] = -128, 127
        got = product(qx)
        assert torch.equal(got, _exact(qx, qweight, scale)), rows
        if in_features % 8 == 0 and rows > 16:  # shapes torch._int_mm takes: the same bits
            assert torch.equal(got, torch._int_mm(qx, qweight).float() * scale)


def test_vnni_takes_a_weight_of_minus_128_and_sums_past_2_to_the_24() -> None:
    """The VNNI path needs no sign trick, so -128 is a weight like any other; with 4,096 inputs of -128 times -128
    the offset sums pass 2^24, where a float32 correction (oneDNN's uint8 route) would be off."""
    qweight = torch.full((4096, 20), -128, dtype=torch.int8)
    qweight[:, 1] = 127
    qweight[::3, 2] = 1
    scale = torch.ones(20)
    product = _packed_product("vnni", qweight, scale)
    qx = torch.full((3, 4096), -128, dtype=torch.int8)
    qx[1, ::2] = 127
    qx[2, 5] = 3
    assert torch.equal(product(qx), _exact(qx, qweight, scale))


@pytest.mark.parametrize("name", KERNELS)
def test_values_do_not_depend_on_the_thread_count_or_the_batch(name: str) -> None:
    gen = torch.Generator().manual_seed(1)
    qweight = torch.randint(-127, 128, (576, 1536), generator=gen, dtype=torch.int8)
    scale = torch.rand(1536, generator=gen)
    product = _packed_product(name, qweight, scale)
    qx = torch.randint(-127, 128, (7, 576), generator=gen, dtype=torch.int8)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = product(qx)
        torch.set_num_threads(2)
        two = product(qx)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    assert torch.equal(product(qx[3:4]), one[3:4])


def test_bad_avx2_operands_are_refused() -> None:
    kernels = _kernels_with("avx2")
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


def test_bad_vnni_operands_are_refused() -> None:
    kernels = _kernels_with("vnni")
    with pytest.raises(RuntimeError, match="expected a 2-D int8 weight"):
        kernels.int8_pack_vnni(torch.ones(8, 8))
    packed, correction = kernels.int8_pack_vnni(torch.ones(8, 8, dtype=torch.int8))
    with pytest.raises(RuntimeError, match="not int8_pack_vnni's"):
        kernels.int8_gemm_vnni(torch.ones(2, 12, dtype=torch.int8), packed, correction, torch.ones(8), 12, 8)
    with pytest.raises(RuntimeError, match="activations of 7 features for a weight of 8 input features"):
        kernels.int8_gemm_vnni(torch.ones(2, 7, dtype=torch.int8), packed, correction, torch.ones(8), 8, 8)
    with pytest.raises(RuntimeError, match="correction must be"):
        kernels.int8_gemm_vnni(torch.ones(2, 8, dtype=torch.int8), packed, correction.long(), torch.ones(8), 8, 8)
    with pytest.raises(RuntimeError, match="scale must be float32 with 8"):
        kernels.int8_gemm_vnni(torch.ones(2, 8, dtype=torch.int8), packed, correction, torch.ones(9), 8, 8)


@pytest.mark.parametrize("name", KERNELS)
def test_the_chooser_can_run_it_in_a_model_product(name: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Forced, it passes the chooser's own check and serves every row class of `linear`."""
    _kernels_with(name)
    gen = torch.Generator().manual_seed(2)
    weight = quantize_int8(torch.randn(576, 200, generator=gen), KernelChooser(INT8_PRODUCT, name, tmp_path))
    assert weight.choice is not None
    assert weight.choice.kernels == (name,) * len(ROW_CLASSES)
    x = torch.randn(40, 576, generator=gen)
    qx, x_scale = quantize_rows(x)
    assert torch.equal(linear(x, weight), _exact(qx, weight.qweight, weight.scale) * x_scale)
