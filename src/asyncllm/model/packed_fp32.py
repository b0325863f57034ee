"""float32 linear weights kept twice: plain for steps of 1-3 rows, in oneDNN's blocked layout for the others.

`torch.mm` (MKL's sgemm) on a plain `[in, out]` weight is fastest for a single row (a matrix-vector product
that streams the weight once), but for 4-64 rows oneDNN's inner product on a weight reordered once into its
blocked layout (`torch.ops.mkldnn._linear_pointwise`, the kernel torch's x86 inference path uses for frozen
float32 linears) does the same work in 25-40% less time on these CPUs (`benchmarks/linear_kernels.py`); from
about 64 rows on they are even, so larger steps (prefill chunks) keep using `x @ W`.
Both compute in float32 (no reduced-precision math unless the user lowers torch's float32 matmul precision);
the two kernels sum in different orders, so a row's last bits depend on which one ran, as they already do on
the attention padding of its batch.

The price is memory: the linear weights and the LM head are stored a second time (about 540 MB more for the
default 135M-parameter model). int8 weights (`model/quant.py`) are packed for oneDNN instead.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

MIN_PACKED_ROWS = 4  # 1-3 rows: the plain weight is as fast or faster at 2 threads (benchmarks/linear_kernels.py)
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


@dataclass
class PackedFp32Weight:
    """A float32 linear weight in both layouts.

    Fields:
        weight: [in_features, out_features] float32, contiguous (steps of 1-3 rows, tied embedding lookups).
        packed: the same values reordered for oneDNN (`torch.ops.mkldnn._reorder_linear_weight`; opaque).
    """

    weight: torch.Tensor
    packed: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape


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


def pack_fp32(weight: torch.Tensor) -> PackedFp32Weight:
    """Both layouts of an `[in, out]` float32 weight.

    Raises:
        ValueError: `weight` is not a 2-D float32 tensor.
    """
    if weight.dtype != torch.float32 or weight.dim() != 2:
        raise ValueError(f"pack_fp32 takes a 2-D float32 [in, out] weight, not {weight.dtype} {tuple(weight.shape)}")
    plain = weight.detach().contiguous()
    return PackedFp32Weight(plain, torch.ops.mkldnn._reorder_linear_weight(plain.t().contiguous(), None))


def packed_linear(x: torch.Tensor, weight: PackedFp32Weight) -> torch.Tensor:
    """`x @ W` for `[rows, in]` float32 `x` -> `[rows, out]` float32, with the faster kernel for `rows`."""
    rows = x.shape[0]
    if not MIN_PACKED_ROWS <= rows <= MAX_PACKED_ROWS:
        return x @ weight.weight
    return _packed_mm(pad_rows(x, bucket_rows(rows)), weight.packed)[:rows]


def _packed_mm(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
