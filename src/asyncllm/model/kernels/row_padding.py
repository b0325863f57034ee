"""Row padding for oneDNN products: a few padded row counts instead of one oneDNN kernel per batch size."""

from __future__ import annotations

from collections.abc import Callable

import torch

WHOLE_ROWS = 1024  # above this many rows (the default token budget of a step) a product runs in pieces


def bucket_rows(rows: int) -> int:
    """The row count a oneDNN product of `rows` <= WHOLE_ROWS rows runs at: exact up to 8, then rounded up to a
    multiple of 8 (up to 64), of 16 (up to 256), of 32 (up to 512), then of 64 (up to 1,024). The step grows with
    the rows, so above 64 rows padding adds at most 23% to a product. With multiples of 64 from 65 rows, a mixed
    step of 64 prefill tokens and 11 decodes ran its fp32 products at 128 rows: 244-251 ms, against 187-216 at 80
    (AMD EPYC, AVX2). Larger products run in pieces (`row_pieces`).

    oneDNN builds and caches a kernel per distinct shape, and each costs memory (the process kept growing past
    its cache's 1,024 entries), so the rows are padded to a few sizes instead of one kernel per batch size. Small
    steps are not padded: a product's time grows with its rows even there, and a batch-1 decode would pay for 8.
    Sizes and costs: `benchmarks/analysis.md`, "Kernel choice".

    Raises:
        ValueError: rows < 1 or rows > WHOLE_ROWS.
    """
    if not 1 <= rows <= WHOLE_ROWS:
        raise ValueError(f"bucket_rows takes 1 to {WHOLE_ROWS} rows, not {rows}")
    if rows <= 8:
        return rows
    step = 8 if rows <= 64 else 16 if rows <= 256 else 32 if rows <= 512 else 64
    return -(-rows // step) * step


def row_pieces(rows: int) -> list[tuple[int, int]]:
    """The pieces a oneDNN product of `rows` rows runs in, as (rows of `x`, rows the kernel runs at) pairs.

    Up to WHOLE_ROWS rows: one piece padded by `bucket_rows`. Above: the largest multiple of WHOLE_ROWS exactly,
    then the rest padded by `bucket_rows` (pieces cost a copy of the output, so only steps over the default token
    budget take them). So at most 63 padded rows are computed, where rounding up to a multiple of 512 above 512 rows
    computed up to 511 (a 576-token prefill ran its products at 1,024 rows: 1.9x their time on an AMD EPYC, AVX2),
    and the kernel count stays as small as that rounding's: up to 8,192 rows, 8 + 7 + 15 sizes up to 1,024, then
    one per multiple of 1,024.

    Raises:
        ValueError: rows < 1.
    """
    if rows < 1:
        raise ValueError(f"a product needs at least 1 row, not {rows}")
    whole, rest = divmod(rows, WHOLE_ROWS) if rows > WHOLE_ROWS else (0, rows)
    pieces = [(whole * WHOLE_ROWS, whole * WHOLE_ROWS)] if whole else []
    return pieces + ([(rest, bucket_rows(rest))] if rest else [])


def pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """`x` `[n, features]` with zero rows appended to make `[rows, features]` (`x` itself if n == rows)."""
    missing = rows - x.shape[0]
    return x if missing == 0 else torch.cat([x, x.new_zeros(missing, x.shape[1])])


def run_in_row_pieces(x: torch.Tensor, product: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """`product(x)` for `x` `[rows, in]` -> `[rows, out]`, with `product` called only at the row counts of
    `row_pieces(rows)` (zero rows appended where a piece is padded; their outputs dropped); with no rows, once
    on `x` itself."""
    if x.shape[0] == 0:
        return product(x)
    outputs, start = [], 0
    for real, padded in row_pieces(x.shape[0]):
        out = product(pad_rows(x[start : start + real], padded))
        outputs.append(out if padded == real else out[:real])
        start += real
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs)
