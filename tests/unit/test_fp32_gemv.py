"""The float32 GEMV (`csrc/fp32_gemv.cpp`): `x @ W` on the plain weight for 1-8 rows per pass, within float32
rounding of exact sums on odd shapes (input rows not a multiple of 4, output columns not a multiple of 8, LM-head
widths cut into column chunks), the same bits on any thread count and for any batch; offered to the kernel chooser as
"gemv" for the row classes up to `GEMV_MAX_ROWS` rows."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from asyncllm.model.kernels.choice import ROW_CLASSES, TIMED_ROWS, KernelChooser
from asyncllm.model.kernels.fp32 import FP32_PRODUCT, GEMV_MAX_ROWS, gemv_kernels, pack_fp32, packed_linear
from tests.kernel_checks import require_kernels

SHAPES = [(576, 960), (1536, 576), (13, 7), (7, 13), (3, 8), (577, 9), (64, 8193), (37, 20000)]


def _gemv() -> Any:
    kernels = require_kernels()
    if not kernels.fp32_gemv_available():
        pytest.skip("this CPU has no AVX2 and FMA")
    return kernels


def _exact(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return (x.double() @ weight.double()).float()


@pytest.mark.parametrize(("in_features", "out_features"), SHAPES)
def test_values_are_the_products_within_float32_rounding(in_features: int, out_features: int) -> None:
    kernels = _gemv()
    gen = torch.Generator().manual_seed(in_features * 7 + out_features)
    weight = torch.randn(in_features, out_features, generator=gen)
    for rows in (1, 2, 3, 5, 8, 9, 17):
        x = torch.randn(rows, in_features, generator=gen)
        got = kernels.fp32_gemv(x, weight)
        exact = _exact(x, weight)
        assert got.shape == (rows, out_features)
        # float32 sums of in_features terms: an error of a few ulps of the largest partial sum
        assert torch.allclose(got, exact, rtol=0, atol=2e-6 * in_features**0.5 * float(exact.abs().max())), rows
        assert FP32_PRODUCT.agrees(got, exact)


def test_values_do_not_depend_on_the_thread_count_or_the_batch() -> None:
    kernels = _gemv()
    gen = torch.Generator().manual_seed(3)
    for shape in ((576, 3072), (576, 49152)):  # input pieces; column chunks
        weight = torch.randn(*shape, generator=gen)
        x = torch.randn(11, shape[0], generator=gen)
        threads = torch.get_num_threads()
        try:
            torch.set_num_threads(1)
            one = kernels.fp32_gemv(x, weight)
            torch.set_num_threads(2)
            two = kernels.fp32_gemv(x, weight)
        finally:
            torch.set_num_threads(threads)
        assert torch.equal(one, two), shape
        for row in (0, 7, 10):  # a row alone, the last of a full pass, one of the second pass
            assert torch.equal(kernels.fp32_gemv(x[row : row + 1].contiguous(), weight), one[row : row + 1]), row


def test_zero_rows_and_zero_input_features() -> None:
    kernels = _gemv()
    assert kernels.fp32_gemv(torch.empty(0, 5), torch.randn(5, 9)).shape == (0, 9)
    assert torch.equal(kernels.fp32_gemv(torch.empty(3, 0), torch.empty(0, 9)), torch.zeros(3, 9))


@pytest.mark.parametrize(
    ("x", "weight", "message"),
    [
        (torch.randn(2, 5), torch.randn(6, 9), r"x \[rows, in\] and weight \[in, out\]"),
        (torch.randn(2, 5).double(), torch.randn(5, 9), "float32 only"),
        (torch.randn(5, 2).t(), torch.randn(5, 9), "contiguous"),
        (torch.randn(2, 5), torch.randn(9, 5).t(), "contiguous"),
    ],
)
def test_wrong_inputs_raise(x: torch.Tensor, weight: torch.Tensor, message: str) -> None:
    kernels = _gemv()
    with pytest.raises(RuntimeError, match=message):
        kernels.fp32_gemv(x, weight)


def test_offered_for_few_rows_only(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Measured on this host, the GEMV is timed at the row counts of the classes up to `GEMV_MAX_ROWS` and never
    picked above; a forced GEMV runs every class and gives the products' values there too."""
    if gemv_kernels() is None:
        pytest.skip("this CPU has no AVX2 and FMA")
    chooser = KernelChooser(FP32_PRODUCT, cache_dir=tmp_path)
    choice = chooser.choose(576, 960)
    served = [index for index, (_, last) in enumerate(ROW_CLASSES) if last is not None and last <= GEMV_MAX_ROWS]
    assert served == [0, 1]
    for index, times in enumerate(choice.times_ms):
        assert ("gemv" in times) == (index in served), (TIMED_ROWS[index], times)
        if index not in served:
            assert choice.kernels[index] != "gemv"
    forced = pack_fp32(torch.randn(64, 40), KernelChooser(FP32_PRODUCT, "gemv", cache_dir=tmp_path))
    assert forced.choice.kernels == ("gemv",) * len(ROW_CLASSES)
    x = torch.randn(600, 64)
    assert FP32_PRODUCT.agrees(packed_linear(x, forced), _exact(x, forced.weight))
