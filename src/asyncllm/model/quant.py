"""int8 weights (per output channel) with int8 dynamic activations (per row), for every linear layer.

`quantize_int8(w)` turns an fp32 `[in, out]` weight into an `Int8Weight`: int8 values and one fp32 scale per
output column, symmetric (`scale = max |w[:, j]| / 127`). `linear(x, w)` applies either kind of weight:
fp32 weights as `x @ w`; int8 weights by quantizing each row of `x` on the fly (symmetric, `max |x[i]| / 127`),
multiplying in int32 and scaling back. The int32 product runs in oneDNN's int8 inner-product kernel on weights
reordered once into its blocked layout (`torch.ops.onednn.qlinear_pointwise`, the kernel behind torch's x86
int8 inference; VNNI/AMX where the CPU has them), with the activation scale passed as 1 and applied per row
afterwards; torch builds without that op use `torch._int_mm` on the plain `[in, out]` int8 weight. Integer
accumulation is exact and both scale it by the weight scale, then by the row's, so both give the same values.

Every row has its own activation scale, so a row's result never depends on which rows share its batch
(fbgemm's dynamic quantized linear scales the whole batch with one activation range, which would make a
request's tokens depend on its batch-mates; see docs/benchmarks.md for the kernel measurements).

Activation outliers (a few input channels far larger than the rest) would waste a per-row int8 scale, so before
quantizing, the model is "smoothed" (SmoothQuant, Xiao et al., 2023): per input channel j of each linear layer,
`s_j = max|X_j|^0.7 / max|W_j|^0.3` over a short calibration text; X is divided by s (folded into the preceding
RMSNorm weight, V projection or up projection, so it costs nothing at run time) and W's row j multiplied by it.

Sources: LLM.int8() (Dettmers et al., 2022) for per-row / per-column absmax scaling without the outlier
decomposition; "Integer Quantization for Deep Learning Inference" (Wu et al., 2020) for symmetric scales.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from asyncllm.model.packed_fp32 import PackedFp32Weight, bucket_rows, packed_linear, pad_rows

SMOOTHING_ALPHA = 0.7  # SmoothQuant migration strength; 0.7 measured best here (docs/benchmarks.md)
_input_absmax: dict[int, torch.Tensor] | None = None  # set while `record_input_absmax` is active


@dataclass
class Int8Weight:
    """A linear weight stored as int8 with one float32 scale per output column.

    Fields:
        qweight: [in_features, out_features] int8, contiguous; `w ~= qweight * scale`.
        scale: [out_features] float32.
        packed: the same weight reordered for oneDNN's int8 kernel (`prepack_int8`), or None where this torch
            build has no such kernel (then `linear` multiplies `qweight` with `torch._int_mm`).
        zero_points: [out_features] int64 zeros (the weight is symmetric), passed with `packed`.
    """

    qweight: torch.Tensor
    scale: torch.Tensor
    packed: torch.Tensor | None = None
    zero_points: torch.Tensor | None = None

    @property
    def shape(self) -> torch.Size:
        return self.qweight.shape

    def dequantize(self) -> torch.Tensor:
        """[in_features, out_features] float32 approximation of the original weight."""
        return self.qweight.float() * self.scale


Weight = torch.Tensor | Int8Weight | PackedFp32Weight


def quantize_int8(weight: torch.Tensor) -> Int8Weight:
    """Symmetric per-output-channel int8 quantization of an `[in, out]` float weight.

    A column of zeros gets scale 1 (its values stay 0).
    """
    w = weight.detach().float()
    absmax = w.abs().amax(dim=0)
    scale = torch.where(absmax > 0, absmax / 127.0, torch.ones_like(absmax))
    qweight = torch.round(w / scale).clamp_(-127, 127).to(torch.int8).contiguous()
    return prepack_int8(Int8Weight(qweight, scale.contiguous()))


@functools.cache
def onednn_int8_available() -> bool:
    """Whether this torch build has oneDNN's prepacked int8 linear (`torch.ops.onednn.qlinear_pointwise`) and
    it computes exactly here. The check multiplies extreme values (+-127) both ways and compares with
    `torch._int_mm`: on CPUs without VNNI an int8 kernel may sum pairs of products in saturating int16, which
    would be a silently wrong result, so any difference keeps `torch._int_mm`."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.onednn, "qlinear_prepack")):
        return False
    x = torch.full((3, 256), 127, dtype=torch.int8)
    x[1] = -127
    x[2, ::2] = -127
    w = torch.full((256, 4), 127, dtype=torch.int8)
    w[:, 1] = -127
    w[::2, 2] = -127
    w[::3, 3] = 0
    scale = torch.ones(4)
    packed = torch.ops.onednn.qlinear_prepack(w.t().contiguous(), None)
    zeros = torch.zeros(4, dtype=torch.int64)
    out = torch.ops.onednn.qlinear_pointwise(
        x, 1.0, 0, packed, scale, zeros, None, 1.0, 0, torch.float32, "none", [], ""
    )
    return bool(torch.equal(out, torch._int_mm(x, w).float()))


def prepack_int8(weight: Int8Weight) -> Int8Weight:
    """`weight` with `packed` and `zero_points` set for oneDNN's int8 kernel, when this build has it."""
    if not onednn_int8_available():
        return weight
    packed = torch.ops.onednn.qlinear_prepack(weight.qweight.t().contiguous(), None)
    zero_points = torch.zeros(weight.scale.shape[0], dtype=torch.int64)
    return Int8Weight(weight.qweight, weight.scale, packed, zero_points)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8 quantization of `[rows, features]` float32 activations.

    Returns:
        (int8 [rows, features], float32 [rows, 1] scales); a row of zeros gets a tiny scale and stays zero.
    """
    scale = x.abs().amax(dim=1, keepdim=True).clamp_min_(1e-30).mul_(1 / 127)
    return x.div(scale).round_().to(torch.int8), scale


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


def smoothing_scale(input_absmax: torch.Tensor, weight_absmax: torch.Tensor) -> torch.Tensor:
    """SmoothQuant per-input-channel factors `s = a^alpha / w^(1 - alpha)`, [in_features] float32 (> 0).

    Args:
        input_absmax: [in_features] max |activation| per channel over the calibration text.
        weight_absmax: [in_features] max |weight| per input row (over every output column).
    """
    a, w = input_absmax.clamp(min=1e-5), weight_absmax.clamp(min=1e-5)
    return (a.pow(SMOOTHING_ALPHA) / w.pow(1 - SMOOTHING_ALPHA)).clamp(min=1e-5)


def linear(x: torch.Tensor, weight: Weight) -> torch.Tensor:
    """`x @ W` for a `[rows, in]` float32 input and an fp32 `[in, out]`, `PackedFp32Weight` or `Int8Weight` weight.

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
    qx, x_scale = quantize_rows(x)
    return int8_matmul(qx, weight).mul_(x_scale)


def int8_matmul(qx: torch.Tensor, weight: Int8Weight) -> torch.Tensor:
    """`qx @ qweight * scale`: an int8 `[rows, in]` input times an int8 weight, summed exactly in int32 and
    scaled by the weight's per-column scale (not by any activation scale).

    Returns:
        [rows, out] float32.
    """
    if weight.packed is not None:  # int32 accumulation scaled by the weight scale in-kernel; x scale is 1 here
        rows = qx.shape[0]
        out = torch.ops.onednn.qlinear_pointwise(
            pad_rows(qx, bucket_rows(rows)), 1.0, 0, weight.packed, weight.scale, weight.zero_points, None, 1.0, 0,
            torch.float32, "none", [], "",
        )  # fmt: skip
        return out if out.shape[0] == rows else out[:rows]
    acc = torch._int_mm(qx, weight.qweight)  # int32 [rows, out]
    return acc.float().mul_(weight.scale)  # (a mixed int32 * float32 mul is 15% slower at 32 rows)
