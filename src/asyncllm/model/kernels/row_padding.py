"""Row padding for oneDNN products: a few padded row counts instead of one oneDNN kernel per batch size."""

from __future__ import annotations

import torch


def bucket_rows(rows: int) -> int:
    """The row count a oneDNN product runs at for `rows` rows: exact up to 8, then rounded up to a multiple of 8
    (up to 64), of 64 (up to 512), then of 512.

    oneDNN builds and caches a kernel per distinct shape, and each costs memory (the process kept growing past
    its cache's 1,024 entries), so the rows are padded to a few sizes instead of one kernel per batch size. Small
    steps are not padded: a product's time grows with its rows even there, and a batch-1 decode would pay for 8.
    Sizes and costs: `benchmarks/analysis.md`, "Kernel choice".
    """
    if rows <= 8:
        return rows
    step = 8 if rows <= 64 else 64 if rows <= 512 else 512
    return -(-rows // step) * step


def pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """`x` `[n, features]` with zero rows appended to make `[rows, features]` (`x` itself if n == rows)."""
    missing = rows - x.shape[0]
    return x if missing == 0 else torch.cat([x, x.new_zeros(missing, x.shape[1])])
