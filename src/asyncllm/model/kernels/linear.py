"""`linear(x, w)`: the one call the model makes for a linear product, whatever the weight's kind and kernel.

A weight is a plain float32 `[in, out]` tensor (`x @ w`), a `PackedFp32Weight` (`kernels/fp32.py`) or an
`Int8Weight` (`kernels/int8.py`: `x` quantized per row, multiplied in int32, scaled back), each on the kernel
chosen for its shape and row count (`kernels/choice.py`), or a `BlockQuantWeight` (`kernels/block_quant.py`: Q8_0 /
Q4_0 / Q4_1 blocks, `x` quantized per block of 32, our own C++ kernels). `record_input_absmax` records every
product's input range for SmoothQuant's calibration (`model/smoothquant.py`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from asyncllm.model.kernels.block_quant import BlockQuantWeight, block_linear
from asyncllm.model.kernels.fp32 import PackedFp32Weight, packed_linear
from asyncllm.model.kernels.int8 import Int8Weight, int8_matmul
from asyncllm.model.kernels.row_quant import quantize_rows

Weight = torch.Tensor | Int8Weight | PackedFp32Weight | BlockQuantWeight
_input_absmax: dict[int, torch.Tensor] | None = None  # set while `record_input_absmax` is active


@contextmanager
def record_input_absmax() -> Iterator[dict[int, torch.Tensor]]:
    """While active, every `linear` call records its input's per-channel max |x| ([in_features] float32),
    keyed by `id(weight)`, into the yielded dict (maxima over all calls)."""
    global _input_absmax
    stats: dict[int, torch.Tensor] = {}
    _input_absmax = stats
    try:
        yield stats
    finally:
        _input_absmax = None


def linear(x: torch.Tensor, weight: Weight) -> torch.Tensor:
    """`x @ W` for a `[rows, in]` float32 input and an fp32 `[in, out]`, `PackedFp32Weight`, `Int8Weight` or
    `BlockQuantWeight` weight.

    Returns:
        [rows, out] float32.
    """
    if _input_absmax is not None:
        seen = x.detach().abs().amax(dim=0)
        previous = _input_absmax.get(id(weight))
        _input_absmax[id(weight)] = seen if previous is None else torch.maximum(previous, seen)
    if isinstance(weight, torch.Tensor):
        return x @ weight
    if isinstance(weight, PackedFp32Weight):
        return packed_linear(x, weight)
    if isinstance(weight, BlockQuantWeight):
        return block_linear(x, weight)
    qx, x_scale = quantize_rows(x)
    return int8_matmul(qx, weight).mul_(x_scale)
