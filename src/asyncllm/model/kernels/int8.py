"""int8 weights (per output channel) with int8 dynamic activations (per row): the int8 products' kernels.

`quantize_int8(w)` turns an fp32 `[in, out]` weight into an `Int8Weight`: int8 values and one fp32 scale per output
column, symmetric (`scale = max |w[:, j]| / 127`), prepared for the kernels the chooser picks for its shape
(`kernels/choice.py`). `int8_matmul(qx, w)` multiplies int8 activations (quantized per row by
`row_quant.quantize_rows`, symmetric, `max |x[i]| / 127`, or by the fused row kernels) in int32 and scales by the
weight scale; the caller applies each row's own scale. The candidates (`INT8_PRODUCT`): oneDNN's int8 matmul on
weights prepacked once (`torch.ops.onednn.qlinear_pointwise`, the kernel behind torch's x86 int8 inference; VNNI/AMX
where the CPU has them), with the activation scale passed as 1; `torch._int_mm` on the plain `[in, out]` int8
weight; asyncllm's own AVX2 kernel (`csrc/int8_gemm.cpp`, "avx2": for CPUs without VNNI, where the other two are
wrong or 15-45x slower than float32; docs/kernels.md); and its AVX-512 VNNI kernel (same file, "vnni": `vpdpbusd` on
`x + 128` less an exact per-column correction, for CPUs with VNNI but no AMX, where oneDNN's int8 linear runs its
reference kernel). Integer accumulation is exact and each scales it by the
weight scale in the same order, so all give the same values (the chooser's start-up check drops one that does not).

Every row has its own activation scale, so a row's products never depend on which rows share its batch (fbgemm's
dynamic quantized linear scales the whole batch with one activation range).

Sources: LLM.int8() (Dettmers et al., 2022) for per-row / per-column absmax scaling without the outlier
decomposition; "Integer Quantization for Deep Learning Inference" (Wu et al., 2020) for symmetric scales.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch

from asyncllm.model.kernels.choice import Candidate, KernelChoice, KernelChooser, ProductKind, forced_kernels_from_env
from asyncllm.model.kernels.row_kernels import load_kernels
from asyncllm.model.kernels.row_padding import run_in_row_pieces


@dataclass
class Int8Weight:
    """A linear weight stored as int8 with one float32 scale per output column.

    Fields:
        qweight: [in_features, out_features] int8, contiguous; `w ~= qweight * scale`.
        scale: [out_features] float32.
        choice: the kernel of each row class (`model/kernels/choice.py`), or None: `torch._int_mm` for every row count.
        operands: the weight prepared for each kernel of `choice` (name -> operand; oneDNN's prepacked copy).
    """

    qweight: torch.Tensor
    scale: torch.Tensor
    choice: KernelChoice | None = None
    operands: dict[str, Any] = field(default_factory=dict)

    @property
    def shape(self) -> torch.Size:
        return self.qweight.shape

    def dequantize(self) -> torch.Tensor:
        """[in_features, out_features] float32 approximation of the original weight."""
        return self.qweight.float() * self.scale


OneDNNInt8 = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (packed weight, [out] scales, [out] zero points)


def quantize_int8(weight: torch.Tensor, chooser: KernelChooser[Int8Weight] | None = None) -> Int8Weight:
    """Symmetric per-output-channel int8 quantization of an `[in, out]` float weight, prepared for the kernels
    `chooser` picks for its shape (default: `int8_chooser()`, measured on this host).

    A column of zeros gets scale 1 (its values stay 0).
    """
    w = weight.detach().float()
    absmax = w.abs().amax(dim=0)
    scale = torch.where(absmax > 0, absmax / 127.0, torch.ones_like(absmax))
    qweight = torch.round(w / scale).clamp_(-127, 127).to(torch.int8).contiguous()
    plain = Int8Weight(qweight, scale.contiguous())
    chooser = chooser or int8_chooser()
    choice = chooser.choose(*qweight.shape)
    return Int8Weight(plain.qweight, plain.scale, choice, chooser.prepare(plain, choice))


@functools.cache
def onednn_int8_available() -> bool:
    """Whether this torch build has oneDNN's prepacked int8 linear (`torch.ops.onednn.qlinear_pointwise`).
    Whether it is exact and fast on this CPU is for the kernel chooser to measure."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.onednn, "qlinear_prepack")


def _prepack_onednn(weight: Int8Weight) -> OneDNNInt8:
    """(oneDNN's packed copy, [out] float32 scales, [out] int64 zero points) of a symmetric int8 weight."""
    packed = torch.ops.onednn.qlinear_prepack(weight.qweight.t().contiguous(), None)
    return packed, weight.scale, torch.zeros(weight.scale.shape[0], dtype=torch.int64)


def _run_onednn(
    qx: torch.Tensor, operand: tuple[torch.Tensor, torch.Tensor, torch.Tensor], zero_point: int
) -> torch.Tensor:
    """oneDNN's int8 product, the weight scale applied in-kernel (activation scale 1); rows run at a few counts
    (`row_pieces`)."""
    packed, scale, zero_points = operand

    def product(rows: torch.Tensor) -> torch.Tensor:
        return torch.ops.onednn.qlinear_pointwise(
            rows, 1.0, zero_point, packed, scale, zero_points, None, 1.0, 0, torch.float32, "none", [], ""
        )

    return run_in_row_pieces(qx, product)


def _run_onednn_s8(qx: torch.Tensor, operand: OneDNNInt8) -> torch.Tensor:
    return _run_onednn(qx, operand, 0)


@functools.cache
def avx2_int8_available() -> bool:
    """Whether the fused kernel module (`row_kernels.load_kernels`) loaded here with its AVX2 int8 product."""
    kernels = load_kernels()
    return kernels is not None and kernels.int8_avx2_available()


Avx2Int8 = tuple[torch.Tensor, torch.Tensor, int, int]  # (packed weight, [out] scales, in_features, out_features)


def _pack_avx2(weight: Int8Weight) -> Avx2Int8:
    kernels = load_kernels()
    assert kernels is not None  # (only offered where `avx2_int8_available()`)
    in_features, out_features = weight.qweight.shape
    return kernels.int8_pack_avx2(weight.qweight), weight.scale, in_features, out_features


def _run_avx2(qx: torch.Tensor, operand: Avx2Int8) -> torch.Tensor:
    kernels = load_kernels()
    assert kernels is not None
    return kernels.int8_gemm_avx2(qx, *operand)


@functools.cache
def vnni_int8_available() -> bool:
    """Whether the fused kernel module loaded here with its AVX-512 VNNI int8 product."""
    kernels = load_kernels()
    return kernels is not None and kernels.int8_vnni_available()


VnniInt8 = tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int]  # (packed, correction, scales, in, out)


def _pack_vnni(weight: Int8Weight) -> VnniInt8:
    kernels = load_kernels()
    assert kernels is not None  # (only offered where `vnni_int8_available()`)
    in_features, out_features = weight.qweight.shape
    packed, correction = kernels.int8_pack_vnni(weight.qweight)
    return packed, correction, weight.scale, in_features, out_features


def _run_vnni(qx: torch.Tensor, operand: VnniInt8) -> torch.Tensor:
    kernels = load_kernels()
    assert kernels is not None
    return kernels.int8_gemm_vnni(qx, *operand)


def _run_int_mm(qx: torch.Tensor, operand: Int8Weight) -> torch.Tensor:
    acc = torch._int_mm(qx, operand.qweight)  # int32 [rows, out]
    return acc.float().mul_(operand.scale)  # (a mixed int32 * float32 mul is slower)


def _random_int8_weight(in_features: int, out_features: int, generator: torch.Generator) -> Int8Weight:
    """Random int8 values and random scales, with a column of +127 and one of -127, one entry of each 126 / -126:
    against an all-127 input row their sums are odd and large, so a kernel that saturates pair sums or rounds
    sums through float32 shows (oneDNN on uint8 activations `x + 128` with zero point 128 does: docs/kernels.md)."""
    qweight = torch.randint(-127, 128, (in_features, out_features), generator=generator, dtype=torch.int8)
    qweight[:, 0], qweight[:, -1] = 127, -127
    qweight[0, 0], qweight[0, -1] = 126, -126
    scale = torch.rand(out_features, generator=generator) * 0.01 + 1e-4
    return Int8Weight(qweight, scale)


def _random_int8_input(rows: int, in_features: int, generator: torch.Generator) -> torch.Tensor:
    qx = torch.randint(-127, 128, (rows, in_features), generator=generator, dtype=torch.int8)
    qx[0] = 127
    qx[-1, ::2] = -127  # (on one row: alternating +-127)
    return qx


def _exact_int8_product(qx: torch.Tensor, weight: Int8Weight, columns: torch.Tensor) -> torch.Tensor:
    """float32(exact integer sums) * scale on `columns`, as every int8 kernel computes it (float64 sums of int8
    products are exact)."""
    return (qx.double() @ weight.qweight[:, columns].double()).float().mul_(weight.scale[columns])


INT8_PRODUCT = ProductKind[Int8Weight](
    name="int8",
    candidates=(
        Candidate("onednn", onednn_int8_available, _prepack_onednn, _run_onednn_s8),
        Candidate("int_mm", lambda: hasattr(torch, "_int_mm"), lambda weight: weight, _run_int_mm, copies_weight=False),
        Candidate("avx2", avx2_int8_available, _pack_avx2, _run_avx2),
        Candidate("vnni", vnni_int8_available, _pack_vnni, _run_vnni),
    ),
    make_weight=_random_int8_weight,
    make_input=_random_int8_input,
    reference=_exact_int8_product,
    agrees=torch.equal,
    out_features=lambda weight: weight.qweight.shape[1],
    itemsize=1,
)
_INT8_RUN = {candidate.name: candidate.run for candidate in INT8_PRODUCT.candidates}


def int8_chooser(forced: str | None = None) -> KernelChooser[Int8Weight]:
    """This process's chooser of int8 kernels (`model/kernels/choice.py`) running `forced`, else the kernel
    `ASYNCLLM_LINEAR_KERNELS` forces, else the measured ones (one chooser per forced kernel, kept for the process).

    Raises:
        ConfigError: the forced kernel is not available here, or the environment variable is malformed.
    """
    return _int8_chooser(forced or forced_kernels_from_env().get("int8"))


@functools.cache
def _int8_chooser(forced: str | None) -> KernelChooser[Int8Weight]:
    return KernelChooser(INT8_PRODUCT, forced)


def int8_matmul(qx: torch.Tensor, weight: Int8Weight) -> torch.Tensor:
    """`qx @ qweight * scale`: an int8 `[rows, in]` input times an int8 weight, summed exactly in int32 and
    scaled by the weight's per-column scale (not by any activation scale), on the kernel chosen for `rows`.

    Returns:
        [rows, out] float32.
    """
    if weight.choice is None:
        return _run_int_mm(qx, weight)
    name = weight.choice.kernel_for(qx.shape[0])
    return _INT8_RUN[name](qx, weight.operands[name])
