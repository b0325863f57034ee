"""float32 linear weights with a kernel per row count: `x @ W`, MKL's packed GEMM or oneDNN's reordered weights.

The candidates (`FP32_PRODUCT`, chosen per weight shape and row class by `model/kernels/choice.py`):
- `matmul`: `x @ W` on the plain `[in, out]` weight (MKL's sgemm; for one row a matrix-vector product that streams
  the weight once).
- `mkl_packed`: MKL's packed GEMM (`cblas_sgemm_pack` / `cblas_sgemm_compute`, Intel oneMKL Developer Reference),
  called through the fused row-kernel module (`model/kernels/row_kernels.py`, `csrc/packed_gemm.cpp`) from the MKL torch
  links. One pack serves every row count. The weight is packed in column chunks (`chunk_columns`) that a product
  hands out on demand to `gemm_threads()` threads, one MKL thread each, so a thread the OS deschedules (beside
  another busy process) does not hold the others up.
- `onednn`: oneDNN's inner product on a weight reordered into its blocked layout
  (`torch.ops.mkldnn._linear_pointwise`, the kernel torch's x86 inference path uses for frozen float32 linears),
  rows run at a few counts (`row_pieces`).
- `gemv`: our matrix-vector kernel on the plain weight (`csrc/fp32_gemv.cpp`, AVX2 + FMA), offered for products
  of up to `GEMV_MAX_ROWS` rows: one contiguous stretch of the weight per thread, prefetched ahead, so a decode
  step of 1-8 rows streams its weights at memory speed (about twice oneDNN's and MKL's rate on an AMD EPYC).
Every kernel computes in float32; they sum in different orders, so a row's last bits depend on which one ran, as
they already do on the attention padding of its batch. A packed kernel keeps a second copy of the weight (about
540 MB for the default model); a weight whose every row class runs `matmul` keeps only the plain one.
Measurements: docs/benchmarks.md ("linear kernels").
"""

from __future__ import annotations

import copy
import functools
import itertools
from dataclasses import dataclass, field
from typing import Any

import torch

from asyncllm.model.kernels.choice import (
    Candidate,
    KernelChoice,
    KernelChooser,
    ProductKind,
    forced_kernels_from_env,
    prepare_operands,
)
from asyncllm.model.kernels.row_kernels import RowKernels, load_kernels
from asyncllm.model.kernels.row_padding import run_in_row_pieces

CHUNKS_PER_WEIGHT = 4  # column chunks of an MKL-packed weight, at least: enough to even out two threads' shares
MAX_CHUNK_COLUMNS = 4096  # wider weights (an LM head) get more chunks, so no chunk is a long wait
GEMV_MAX_ROWS = 8  # the GEMV is offered to the row classes up to this many rows (it reads the weight once per 8 rows)
_gemm_threads: int | None = None  # threads of an MKL-packed product (`set_gemm_threads`); None: torch's count


def chunk_columns(out_features: int) -> int:
    """Columns per chunk of an MKL-packed `[in, out_features]` weight: out_features / CHUNKS_PER_WEIGHT rounded up
    to a multiple of 16 (whole AVX-512 vectors), at most MAX_CHUNK_COLUMNS."""
    per_chunk = -(-out_features // CHUNKS_PER_WEIGHT)
    return min(MAX_CHUNK_COLUMNS, -(-per_chunk // 16) * 16)


def set_gemm_threads(num_threads: int | None) -> None:
    """Threads that MKL-packed products run on from now on in this process (None: torch's thread count at each
    product). The worker sets its quiet thread count here: a product keeps both threads when the thread policy
    runs the rest of a step on one (`worker/thread_policy.py`), since its chunks do not wait for a descheduled
    thread.

    Raises:
        ValueError: num_threads < 1.
    """
    global _gemm_threads
    if num_threads is not None and num_threads < 1:
        raise ValueError(f"set_gemm_threads needs at least 1 thread, not {num_threads}")
    _gemm_threads = num_threads


def gemm_threads() -> int:
    """Threads an MKL-packed product runs on now (`set_gemm_threads`)."""
    return _gemm_threads if _gemm_threads is not None else torch.get_num_threads()


@dataclass
class PackedFp32Weight:
    """A float32 linear weight with the kernel of each row class chosen for its shape.

    Fields:
        weight: [in_features, out_features] float32, contiguous (`matmul`, tied embedding lookups).
        choice: the kernel of each row class (`model/kernels/choice.py`).
        operands: the weight prepared for each kernel of `choice` (name -> operand; MKL's or oneDNN's packed copy).
    """

    weight: torch.Tensor
    choice: KernelChoice
    operands: dict[str, Any] = field(default_factory=dict)

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    def __deepcopy__(self, memo: dict[int, object]) -> PackedFp32Weight:
        """A copy prepared afresh: MKL's packed data must not move to another address."""
        weight = copy.deepcopy(self.weight, memo)
        operands = prepare_operands(FP32_PRODUCT, weight, self.operands)
        return PackedFp32Weight(weight, self.choice, operands)


@functools.cache
def onednn_fp32_available() -> bool:
    """Whether this torch build has oneDNN's float32 linear with reordered weights (whether it is right and fast
    here is for the kernel chooser to measure)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


@functools.cache
def mkl_packed_kernels() -> RowKernels | None:
    """The row-kernel module if its MKL packed GEMM links here and agrees with `x @ W` (within float32 rounding) on
    products of 1-300 rows packed once, on one, two and torch's count of threads (for the chunks) with torch at one
    thread and at its count; else None. Never raises."""
    kernels = load_kernels()
    if kernels is None or not kernels.has_packed_sgemm():
        return None
    generator = torch.Generator().manual_seed(0)
    w = torch.randn(200, 328, generator=generator)
    threads = torch.get_num_threads()
    try:
        packed = kernels.sgemm_pack(w, 48)  # 7 chunks, the last narrower
        for num_threads in sorted({1, threads}):
            torch.set_num_threads(num_threads)
            for rows, chunk_threads in itertools.product((1, 2, 5, 17, 64, 300), sorted({1, 2, threads})):
                x = torch.randn(rows, 200, generator=generator)
                if not torch.allclose(kernels.sgemm_packed(x, packed, 328, chunk_threads), x @ w, rtol=1e-5, atol=1e-4):
                    return None
    finally:
        torch.set_num_threads(threads)
    return kernels


def _mkl_pack(weight: torch.Tensor) -> tuple[torch.Tensor, int, RowKernels]:
    kernels = mkl_packed_kernels()
    if kernels is None:
        raise RuntimeError("MKL's packed GEMM is not available here")
    return kernels.sgemm_pack(weight, chunk_columns(weight.shape[1])), weight.shape[1], kernels


def _run_mkl(x: torch.Tensor, operand: tuple[torch.Tensor, int, RowKernels]) -> torch.Tensor:
    packed, out_features, kernels = operand
    return kernels.sgemm_packed(x.contiguous(), packed, out_features, gemm_threads())


def _onednn_reorder(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.t().contiguous(), None)


def _run_onednn(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return run_in_row_pieces(x, lambda rows: torch.ops.mkldnn._linear_pointwise(rows, packed, None, "none", [], ""))


def _plain(weight: torch.Tensor) -> torch.Tensor:
    return weight


def _run_matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x @ weight


@functools.cache
def gemv_kernels() -> RowKernels | None:
    """The row-kernel module if it has the float32 GEMV (`csrc/fp32_gemv.cpp`: AVX2 and FMA); else None. Whether it
    is right on a shape is for the kernel chooser to check. Never raises."""
    kernels = load_kernels()
    return kernels if kernels is not None and kernels.fp32_gemv_available() else None


def _run_gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    kernels = gemv_kernels()
    if kernels is None:
        raise RuntimeError("the float32 GEMV is not available here")
    return kernels.fp32_gemv(x.contiguous(), weight)


def _float64_product(x: torch.Tensor, weight: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    return (x.double() @ weight[:, columns].double()).float()


def _within_float32_rounding(out: torch.Tensor, reference: torch.Tensor) -> bool:
    """Equal up to float32 summation error (reduced-precision math, e.g. bfloat16 or TF32, is not)."""
    return out.shape == reference.shape and torch.allclose(
        out, reference, rtol=1e-4, atol=1e-4 * float(reference.abs().max())
    )


def _random_fp32(rows: int, columns: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(rows, columns, generator=generator)


FP32_PRODUCT = ProductKind[torch.Tensor](
    name="fp32",
    # MKL's packed GEMM first, and within 10%: its column chunks keep a product going when the OS deschedules a
    # thread beside a busy process, which a quiet timing cannot see (docs/kernels.md)
    candidates=(
        Candidate("mkl_packed", lambda: mkl_packed_kernels() is not None, _mkl_pack, _run_mkl),
        Candidate("matmul", lambda: True, _plain, _run_matmul, copies_weight=False),
        Candidate("onednn", onednn_fp32_available, _onednn_reorder, _run_onednn),
        # batch-1 and few-row decode steps: streams the plain weight at memory speed (one pass per 8 rows)
        Candidate(
            "gemv", lambda: gemv_kernels() is not None, _plain, _run_gemv, copies_weight=False, max_rows=GEMV_MAX_ROWS
        ),
    ),
    make_weight=_random_fp32,
    make_input=_random_fp32,
    reference=_float64_product,
    agrees=_within_float32_rounding,
    out_features=lambda weight: weight.shape[1],
    itemsize=4,
    tie_margin=0.10,
)
_FP32_RUN = {candidate.name: candidate.run for candidate in FP32_PRODUCT.candidates}


def fp32_chooser(forced: str | None = None) -> KernelChooser[torch.Tensor]:
    """This process's chooser of float32 kernels (`model/kernels/choice.py`) running `forced`, else the kernel
    `ASYNCLLM_LINEAR_KERNELS` forces, else the measured ones (one chooser per forced kernel, kept for the process).

    Raises:
        ConfigError: the forced kernel is not available here, or the environment variable is malformed.
    """
    return _fp32_chooser(forced or forced_kernels_from_env().get("fp32"))


@functools.cache
def _fp32_chooser(forced: str | None) -> KernelChooser[torch.Tensor]:
    return KernelChooser(FP32_PRODUCT, forced)


def pack_fp32(weight: torch.Tensor, chooser: KernelChooser[torch.Tensor] | None = None) -> PackedFp32Weight:
    """An `[in, out]` float32 weight prepared for the kernels `chooser` picks for its shape (default:
    `fp32_chooser()`, measured on this host).

    Raises:
        ValueError: `weight` is not a 2-D float32 tensor.
    """
    if weight.dtype != torch.float32 or weight.dim() != 2:
        raise ValueError(f"pack_fp32 takes a 2-D float32 [in, out] weight, not {weight.dtype} {tuple(weight.shape)}")
    plain = weight.detach().contiguous()
    chooser = chooser or fp32_chooser()
    choice = chooser.choose(*plain.shape)
    return PackedFp32Weight(plain, choice, chooser.prepare(plain, choice))


def packed_linear(x: torch.Tensor, weight: PackedFp32Weight) -> torch.Tensor:
    """`x @ W` for `[rows, in]` float32 `x` -> `[rows, out]` float32, on the kernel chosen for `rows`."""
    name = weight.choice.kernel_for(x.shape[0])
    return _FP32_RUN[name](x, weight.operands[name])
