"""float32 linear weights kept twice: plain for single-row steps, packed once for a faster kernel for the others.

`torch.mm` (MKL's sgemm) on a plain `[in, out]` weight is fastest for a single row (a matrix-vector product that
streams the weight once). For more rows the weight is packed once at load time into a kernel's own layout:
- MKL's packed GEMM (`cblas_sgemm_pack` / `cblas_sgemm_compute`, Intel oneMKL Developer Reference), called through
  the fused row-kernel module (`model/row_kernels.py`, `csrc/packed_gemm.cpp`) from the MKL torch links. One pack
  serves every row count (no per-shape kernels, no padding). The weight is packed in column chunks
  (`chunk_columns`) that a product hands out on demand to `gemm_threads()` threads, one MKL thread each, so a
  thread the OS deschedules (beside another busy process) does not hold the others up. Measured on this model's
  30 layers plus LM head, 2 threads (`benchmarks/linear_kernels.py`): 32 rows 43-46 ms vs oneDNN's 48-52 and
  `x @ W`'s 53-57; 64 rows 60-67 vs 74-83 and 70-74; 2 rows 21 vs 24-25 and 25-26 (whole weights; 4 chunks per
  weight cost ~4%: 44.6 vs 43.0 ms at 32 rows, and beside a busy process gain 6-10% over one thread).
- Where that is missing (no compiler, torch without MKL, `ASYNCLLM_FUSED_KERNELS=0`) or fails its start-up check:
  oneDNN's inner product on a weight reordered into its blocked layout (`torch.ops.mkldnn._linear_pointwise`,
  the kernel torch's x86 inference path uses for frozen float32 linears), for 4-64 rows (padded to a few row
  counts); `x @ W` for the rest.
Every kernel computes in float32 (no reduced-precision math unless the user lowers torch's float32 matmul
precision); they sum in different orders, so a row's last bits depend on which one ran, as they already do on the
attention padding of its batch.

The price is memory: the linear weights and the LM head are stored a second time (about 540 MB more for the
default 135M-parameter model). int8 weights (`model/quant.py`) are packed for oneDNN instead.
"""

from __future__ import annotations

import copy
import functools
import itertools
from dataclasses import dataclass

import torch

from asyncllm.model.row_kernels import RowKernels, load_kernels

MIN_MKL_ROWS = 2  # 1 row: MKL's sgemv on the plain weight is faster than the packed GEMM
CHUNKS_PER_WEIGHT = 4  # column chunks of an MKL-packed weight, at least: enough to even out two threads' shares
MAX_CHUNK_COLUMNS = 4096  # wider weights (an LM head) get more chunks, so no chunk is a long wait
_gemm_threads: int | None = None  # threads of an MKL-packed product (`set_gemm_threads`); None: torch's count
MIN_PACKED_ROWS = 4  # oneDNN: 1-3 rows run the plain weight (as fast or faster at 2 threads)
MAX_PACKED_ROWS = 64  # beyond, MKL's sgemm is as fast (compute-bound) and needs no padding


def bucket_rows(rows: int) -> int:
    """The row count a oneDNN product runs at for `rows` rows: exact up to 8, then rounded up to a multiple of 8
    (up to 64), of 64 (up to 512), then of 512.

    oneDNN builds and caches a kernel per distinct shape, and each costs memory (measured: ~1.2 MB per fp32 and
    ~0.3 MB per int8 kernel of this model's shapes, and the process kept growing past its cache's 1,024
    entries), so the rows are padded to a few sizes instead of one kernel per batch size. Small steps are not
    padded: a product's time grows with its rows even there (int8, 2 threads: 1 row 5.9 ms, 8 rows 8.3 ms for the
    default model's layers), and a batch-1 decode would pay for 8.
    """
    if rows <= 8:
        return rows
    step = 8 if rows <= 64 else 64 if rows <= 512 else 512
    return -(-rows // step) * step


def pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """`x` `[n, features]` with zero rows appended to make `[rows, features]` (`x` itself if n == rows)."""
    missing = rows - x.shape[0]
    return x if missing == 0 else torch.cat([x, x.new_zeros(missing, x.shape[1])])


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
    """A float32 linear weight in both layouts.

    Fields:
        weight: [in_features, out_features] float32, contiguous (single-row steps, tied embedding lookups).
        packed: the same values packed for `mkl`'s packed GEMM (opaque uint8) or, when `mkl` is None, reordered for
            oneDNN (`torch.ops.mkldnn._reorder_linear_weight`; opaque).
        mkl: the kernel module that packed `packed` with MKL, or None.
    """

    weight: torch.Tensor
    packed: torch.Tensor
    mkl: RowKernels | None = None

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    def __deepcopy__(self, memo: dict[int, object]) -> PackedFp32Weight:
        """A copy packed afresh: MKL's packed data must not move to another address."""
        weight = copy.deepcopy(self.weight, memo)
        if self.mkl is None:
            return PackedFp32Weight(weight, copy.deepcopy(self.packed, memo))
        return PackedFp32Weight(weight, self.mkl.sgemm_pack(weight, chunk_columns(weight.shape[1])), self.mkl)


@functools.cache
def onednn_fp32_available() -> bool:
    """Whether this torch build has oneDNN's float32 linear with reordered weights, and it agrees with `x @ W`
    on a small random product (within float32 rounding) on this CPU."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    generator = torch.Generator().manual_seed(0)
    x, w = torch.randn(4, 96, generator=generator), torch.randn(96, 40, generator=generator)
    out = _packed_mm(x, torch.ops.mkldnn._reorder_linear_weight(w.t().contiguous(), None))
    return bool(torch.allclose(out, x @ w, rtol=1e-5, atol=1e-4))


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


def fp32_packing_available() -> bool:
    """Whether `pack_fp32` has a faster kernel to pack for here (MKL's packed GEMM or oneDNN's)."""
    return mkl_packed_kernels() is not None or onednn_fp32_available()


def pack_fp32(weight: torch.Tensor) -> PackedFp32Weight:
    """Both layouts of an `[in, out]` float32 weight: packed for MKL's packed GEMM where it passed its check
    (`mkl_packed_kernels`), else for oneDNN.

    Raises:
        ValueError: `weight` is not a 2-D float32 tensor.
    """
    if weight.dtype != torch.float32 or weight.dim() != 2:
        raise ValueError(f"pack_fp32 takes a 2-D float32 [in, out] weight, not {weight.dtype} {tuple(weight.shape)}")
    plain = weight.detach().contiguous()
    kernels = mkl_packed_kernels()
    if kernels is not None:
        return PackedFp32Weight(plain, kernels.sgemm_pack(plain, chunk_columns(plain.shape[1])), kernels)
    return PackedFp32Weight(plain, torch.ops.mkldnn._reorder_linear_weight(plain.t().contiguous(), None))


def packed_linear(x: torch.Tensor, weight: PackedFp32Weight) -> torch.Tensor:
    """`x @ W` for `[rows, in]` float32 `x` -> `[rows, out]` float32, with the faster kernel for `rows`."""
    rows = x.shape[0]
    if weight.mkl is not None:
        if rows < MIN_MKL_ROWS:
            return x @ weight.weight
        return weight.mkl.sgemm_packed(x.contiguous(), weight.packed, weight.weight.shape[1], gemm_threads())
    if not MIN_PACKED_ROWS <= rows <= MAX_PACKED_ROWS:
        return x @ weight.weight
    return _packed_mm(pad_rows(x, bucket_rows(rows)), weight.packed)[:rows]


def _packed_mm(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
