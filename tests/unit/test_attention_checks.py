"""The attention kernels' start-up checks (`model/kernels/attention_checks.py`): the built kernels pass them, and a
kernel that is wrong by a little more than the tolerance, or that drops a key, is caught, with the bfloat16
products' wider tolerance as well as without it."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from asyncllm.model.kernels.attention_checks import (
    ATTENTION_TOLERANCE,
    BF16_DOT_TOLERANCE,
    compare_decode_attention,
    compare_prefill_attention,
)
from asyncllm.model.kernels.row_kernels import RowKernels
from tests.kernel_checks import require_kernels


@pytest.fixture(scope="module")
def kernels() -> RowKernels:
    """Built here; where they cannot be, every test of this module fails under CI (`tests/kernel_checks.py`)."""
    return require_kernels()


def gen() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def scaled_prefill(kernels: RowKernels, factor: float) -> Callable[..., None]:
    """The prefill kernel with its output multiplied by `factor` afterwards."""

    def prefill_(out: torch.Tensor, *args: object) -> None:
        kernels.paged_prefill_attention_(out, *args)
        out.mul_(factor)

    return prefill_


def test_the_built_kernels_pass(kernels: RowKernels) -> None:
    assert compare_decode_attention(kernels.paged_decode_attention, gen()) == ""
    bf16_dot = kernels.paged_prefill_attention_bf16_dot()
    assert compare_prefill_attention(kernels.paged_prefill_attention_, gen(), bf16_dot=bf16_dot) == ""


def test_a_decode_kernel_off_by_more_than_the_tolerance_is_caught(kernels: RowKernels) -> None:
    def off(*args: object) -> torch.Tensor:
        return kernels.paged_decode_attention(*args) * (1 + 20 * ATTENTION_TOLERANCE)

    assert "paged_decode_attention differs" in compare_decode_attention(off, gen())


@pytest.mark.parametrize("bf16_dot", [False, True])
def test_a_prefill_kernel_off_by_more_than_the_tolerance_is_caught(kernels: RowKernels, bf16_dot: bool) -> None:
    """Off by 4x the bfloat16 tolerance (relative, so more than that of the largest value somewhere): caught on the
    float32 cache whichever tolerance the bfloat16 cache gets."""
    problem = compare_prefill_attention(scaled_prefill(kernels, 1 + 4 * BF16_DOT_TOLERANCE), gen(), bf16_dot=bf16_dot)
    assert "paged_prefill_attention_ differs" in problem


@pytest.mark.parametrize("bf16_dot", [False, True])
def test_a_prefill_kernel_that_drops_a_key_is_caught_on_the_bfloat16_cache(kernels: RowKernels, bf16_dot: bool) -> None:
    """The widened tolerance of the bfloat16 products does not hide a wrong answer: on the bfloat16 cache alone,
    every sequence's last cached token (the chunk's last key) is zeroed in the cache the kernel reads."""

    def drop_last_key(
        out: torch.Tensor,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        block_tables: torch.Tensor,
        query_starts: torch.Tensor,
        query_lens: torch.Tensor,
        seq_lens: torch.Tensor,
        *rest: object,
    ) -> None:
        damaged = kv_cache.clone()
        if kv_cache.dtype == torch.bfloat16:
            block_size = kv_cache.shape[2]
            for s, length in enumerate(seq_lens.tolist()):
                damaged[block_tables[s, (length - 1) // block_size], :, (length - 1) % block_size] = 0
        kernels.paged_prefill_attention_(out, query, damaged, block_tables, query_starts, query_lens, seq_lens, *rest)

    assert "bfloat16 cache" in compare_prefill_attention(drop_last_key, gen(), bf16_dot=bf16_dot)
