"""The AMX block GEMM (`csrc/block_quant.cpp`, path "amx"): from 16 rows, every kind's products on int8 tiles give
the numpy reference's bits (exact per-block integer dots, then the same float32 steps in block order) at the edges
of its row tiles (16 rows), its panels (16 columns) and its three-block pipeline (1, 2, 3 blocks); a row's values do
not depend on its batch-mates or the thread count; the path is offered exactly where the CPU and Linux allow it.
These run only where this process may use AMX (the CPU has AMX-INT8 and Linux granted the tile data); elsewhere
they skip, saying why."""

from __future__ import annotations

import pathlib

import pytest
import torch

from asyncllm.model.kernels.block_quant import block_linear, quantize_blocks, reference_block_linear
from asyncllm.model.kernels.row_kernels import RowKernels
from tests.kernel_checks import require_kernels

KINDS = ("q8_0", "q4_0", "q4_1")
AMX_ROWS = (16, 17, 23, 31, 32, 33, 47, 48, 49, 100, 257)  # the GEMM's threshold, its 16-row tiles' edges, odd counts


@pytest.fixture(scope="module")
def kernels() -> RowKernels:
    found = require_kernels()
    if "amx" not in found.block_quant_paths():
        pytest.skip(f"no AMX block path in this process: {found.block_quant_amx_status()}")
    return found


def _weight(in_features: int, out_features: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    w = torch.randn(in_features, out_features, generator=generator) * 0.05
    w[:32, 0] = 0.0  # a block of zeros (scale 0)
    w[-32:, -1] = 0.3  # a constant block (Q4_1: d = 0)
    w[:, out_features // 2] *= 40  # an outlier column
    return w


def _input(rows: int, in_features: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_features, generator=generator) * 2
    x[0, :32] = 0.0  # an input block of zeros
    x[-1, -32:] = 1000.0  # a constant large block (every value 127)
    return x


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    ("in_features", "out_features"),
    [(32, 13), (64, 37), (96, 16), (160, 47), (576, 963)],  # 1, 2, 3, 5, 18 blocks; part, whole and odd panels
)
def test_the_amx_gemm_equals_the_reference_bit_for_bit(
    kernels: RowKernels, kind: str, in_features: int, out_features: int
) -> None:
    weight = quantize_blocks(_weight(in_features, out_features, out_features), kind)  # type: ignore[arg-type]
    x = _input(max(AMX_ROWS), in_features, in_features)
    for rows in AMX_ROWS:
        part = x[-rows:].contiguous()  # the last rows: the constant block is in the batch's last row
        want = reference_block_linear(part, weight)
        got = block_linear(part, weight, "amx")
        assert got.shape == (rows, out_features)
        assert torch.equal(got, want), (kind, rows, float((got - want).abs().max()))


@pytest.mark.parametrize("kind", KINDS)
def test_the_amx_gemm_equals_the_vnni_gemm_and_the_gemv(kernels: RowKernels, kind: str) -> None:
    """The same bits for each row alone (the GEMV), inside 40 rows on the vnni GEMM, and on the AMX GEMM, at
    every place of a 16-row tile (first, last, the part tile)."""
    weight = quantize_blocks(_weight(576, 100, 3), kind)  # type: ignore[arg-type]
    batch = _input(40, 576, 4)
    amx = block_linear(batch, weight, "amx")
    assert torch.equal(amx, block_linear(batch, weight, "vnni"))
    for i in (0, 1, 15, 16, 31, 32, 39):
        assert torch.equal(block_linear(batch[i : i + 1].contiguous(), weight, "amx")[0], amx[i]), (kind, i)


def test_amx_values_do_not_depend_on_the_thread_count(kernels: RowKernels) -> None:
    weight = quantize_blocks(_weight(576, 963, 5), "q4_1")
    x = _input(64, 576, 6)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = block_linear(x, weight, "amx")
        torch.set_num_threads(max(2, before))
        many = block_linear(x, weight, "amx")
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, many)
    assert torch.equal(one, reference_block_linear(x, weight))


def test_amx_is_offered_where_the_cpu_flags_it_and_linux_grants_it() -> None:
    """The status and the path list agree; a CPU without the amx_tile / amx_int8 flags never gets the path. (Runs on
    every host: this one is not skipped where AMX is missing.)"""
    found = require_kernels()
    status = found.block_quant_amx_status()
    assert ("amx" in found.block_quant_paths()) == (status == "")
    if status == "":
        assert found.block_quant_paths()[0] == "amx"
    cpuinfo = pathlib.Path("/proc/cpuinfo")
    flags = set()
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    if not {"amx_tile", "amx_int8"} <= flags:
        assert status != ""
